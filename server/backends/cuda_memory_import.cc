// The CUDA backend's imports of shared-memory regions: GPU memory of another process (legacy CUDA
// IPC handles, CUDA VMM file descriptors) mapped into attnd's context, and host regions
// page-locked for direct copies.
#include <cuda.h>  // types of cuMemGetAddressRange only: it is looked up through the runtime

#include <cstring>

#include "absl/strings/str_cat.h"
#include "backends/cuda_backend.h"
#include "backends/cuda_util.h"
#include "backends/cuda_vmm_import.h"
#include "common/status_util.h"

namespace attn {

absl::StatusOr<GpuImport> CudaBackend::ImportIpcMemory(const std::string& handle,
                                                       int32_t device_id, uint64_t bytes) {
  if (device_id != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat("device_id ", device_id, " is not attnd's GPU (",
                                                   options_.device, ")"));
  }
  RETURN_IF_ERROR(Health());
  cudaIpcMemHandle_t h;
  static_assert(sizeof(h) == 64);
  std::memcpy(&h, handle.data(), sizeof(h));
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  void* ptr = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc_handle could not be opened (", cudaGetErrorString(e),
        "): it must come from cudaIpcGetMemHandle in another process on this host, of memory "
        "still allocated"));
  }
  // The allocation's extent, from the driver (through the runtime, so that attnd does not link
  // libcuda): bytes must lie inside it, else a kernel could read past it.
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  size_t extent = 0;
  CUdeviceptr base = 0;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess ||
      reinterpret_cast<GetRange>(fn)(&base, &extent, reinterpret_cast<CUdeviceptr>(ptr)) !=
          CUDA_SUCCESS) {
    cudaIpcCloseMemHandle(ptr);
    return absl::InternalError("cannot find the extent of the imported GPU memory");
  }
  const uint64_t usable = extent - (reinterpret_cast<CUdeviceptr>(ptr) - base);
  if (bytes > usable) {
    cudaIpcCloseMemHandle(ptr);
    return absl::InvalidArgumentError(absl::StrCat("bytes ", bytes, " exceeds the ", usable,
                                                   " bytes of the shared GPU allocation"));
  }
  GpuImport out;
  out.data = static_cast<char*>(ptr);
  out.bytes = bytes;
  out.release = [ptr, device = options_.device] {
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(ptr);
  };
  return out;
}

absl::StatusOr<GpuImport> CudaBackend::ImportVmmMemory(int fd, int32_t device_id,
                                                       uint64_t bytes) {
  if (device_id != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat("device_id ", device_id, " is not attnd's GPU (",
                                                   options_.device, ")"));
  }
  RETURN_IF_ERROR(Health());
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  return ImportVmmAllocation(fd, options_.device, bytes);
}

absl::StatusOr<std::function<void()>> CudaBackend::RegisterHostMemory(char* data,
                                                                      uint64_t bytes) {
  RETURN_IF_ERROR(Health());
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  if (cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable); e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::ResourceExhaustedError(absl::StrCat(
        "cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  return std::function<void()>([data, device = options_.device] {
    cudaSetDevice(device);
    cudaHostUnregister(data);
  });
}

}  // namespace attn
