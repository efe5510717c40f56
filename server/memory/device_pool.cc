#include "memory/device_pool.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace attn {

absl::StatusOr<std::unique_ptr<DevicePool>> DevicePool::Create(int device, size_t limit_bytes) {
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool;
  cudaError_t err = cudaMemPoolCreate(&pool, &props);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemPoolCreate: ", cudaGetErrorString(err)));
  }
  // Keep what was freed (up to the bound) instead of returning it to the driver at each sync.
  uint64_t threshold = limit_bytes;
  err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  if (err != cudaSuccess) {
    cudaMemPoolDestroy(pool);
    return absl::InternalError(absl::StrCat("cudaMemPoolSetAttribute: ", cudaGetErrorString(err)));
  }
  return std::unique_ptr<DevicePool>(new DevicePool(pool, limit_bytes));
}

DevicePool::~DevicePool() { cudaMemPoolDestroy(pool_); }

absl::StatusOr<void*> DevicePool::Allocate(size_t bytes, cudaStream_t stream) {
  size_t used = used_.load();
  do {
    if (used + bytes > limit_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device memory pool exhausted: ", bytes, " bytes asked for, ", used, " of ",
                       limit_, " in use (--device_pool_bytes)"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes));
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocFromPoolAsync(&ptr, bytes, pool_, stream);
  if (err != cudaSuccess) {
    used_ -= bytes;
    cudaGetLastError();  // an out-of-memory error is not sticky; clear it
    if (err == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the GPU is out of memory for ", bytes, " more bytes"));
    }
    return absl::InternalError(absl::StrCat("cudaMallocFromPoolAsync: ", cudaGetErrorString(err)));
  }
  return ptr;
}

void DevicePool::Free(void* ptr, size_t bytes, cudaStream_t stream) {
  if (ptr == nullptr) return;
  cudaFreeAsync(ptr, stream);
  used_ -= bytes;
}

MemoryBytes DevicePool::Bytes() const {
  uint64_t reserved = 0;
  cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved);
  return {static_cast<int64_t>(used_.load()), static_cast<int64_t>(reserved),
          static_cast<int64_t>(limit_)};
}

}  // namespace attn
