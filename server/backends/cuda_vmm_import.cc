#include "backends/cuda_vmm_import.h"

#include <cuda.h>  // types and declarations only: the functions are looked up at run time
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace attn {
namespace {

// The driver calls a VMM import needs, looked up once.
struct VmmDriver {
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) free_range = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  bool ok = false;
};

template <typename Fn>
bool Find(const char* name, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

const VmmDriver& Driver() {
  static const VmmDriver d = [] {
    VmmDriver v;
    v.ok = Find("cuMemImportFromShareableHandle", &v.import_handle) &&
           Find("cuMemGetAllocationPropertiesFromHandle", &v.properties) &&
           Find("cuMemGetAllocationGranularity", &v.granularity) &&
           Find("cuMemAddressReserve", &v.reserve) && Find("cuMemAddressFree", &v.free_range) &&
           Find("cuMemMap", &v.map) && Find("cuMemUnmap", &v.unmap) &&
           Find("cuMemSetAccess", &v.set_access) && Find("cuMemRelease", &v.release);
    return v;
  }();
  return d;
}

std::string DriverError(CUresult r) {
  return absl::StrCat("CUDA driver error ", static_cast<int>(r));
}

}  // namespace

absl::StatusOr<GpuImport> ImportVmmAllocation(int fd, int device, uint64_t bytes) {
  const VmmDriver& d = Driver();
  if (!d.ok) return absl::UnavailableError("this CUDA driver has no virtual memory API");
  CUmemGenericAllocationHandle handle{};
  if (CUresult r = d.import_handle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handle: the descriptor is not a CUDA VMM allocation's (cuMemImportFromShareableHandle: ",
        DriverError(r), "); export it with cuMemExportToShareableHandle, handle type "
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"));
  }
  // From here on the handle is released on every path: a mapping holds the memory by itself.
  CUmemAllocationProp prop{};
  size_t granularity = 0;
  CUresult r = d.properties(&prop, handle);
  if (r == CUDA_SUCCESS) {
    r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  }
  if (r != CUDA_SUCCESS || granularity == 0) {
    d.release(handle);
    return absl::InternalError(absl::StrCat("cannot read the VMM allocation's properties: ",
                                            DriverError(r)));
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device) {
    d.release(handle);
    return absl::InvalidArgumentError(absl::StrCat(
        "device_id: the VMM allocation lies on device ", prop.location.id, ", not attnd's GPU (",
        device, ")"));
  }
  const size_t size = (bytes + granularity - 1) / granularity * granularity;
  CUdeviceptr ptr = 0;
  if (r = d.reserve(&ptr, size, granularity, 0, 0); r != CUDA_SUCCESS) {
    d.release(handle);
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve ", size,
                                                     " bytes of GPU address space: ",
                                                     DriverError(r)));
  }
  // The driver refuses a mapping past the end of the allocation: that is the bounds check.
  if (r = d.map(ptr, size, 0, handle, 0); r != CUDA_SUCCESS) {
    d.free_range(ptr, size);
    d.release(handle);
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes ", bytes, " (", size, " rounded up to the allocation granularity of ", granularity,
        ") does not fit in the VMM allocation (cuMemMap: ", DriverError(r), ")"));
  }
  d.release(handle);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (r = d.set_access(ptr, size, &access, 1); r != CUDA_SUCCESS) {
    d.unmap(ptr, size);
    d.free_range(ptr, size);
    return absl::InternalError(absl::StrCat("cannot make the VMM mapping accessible: ",
                                            DriverError(r)));
  }
  GpuImport out;
  out.data = reinterpret_cast<char*>(ptr);
  out.bytes = bytes;
  out.release = [ptr, size, device] {
    cudaSetDevice(device);
    const VmmDriver& drv = Driver();
    drv.unmap(ptr, size);
    drv.free_range(ptr, size);
  };
  return out;
}

}  // namespace attn
