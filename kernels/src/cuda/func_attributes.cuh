// A kernel's shared-memory attributes, set once per device instead of before every launch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace attn::kernels::cuda {

// Sets kKernel's dynamic shared memory limit (when above the 48 KB default) and, with
// max_carveout, its preferred carveout to all shared memory, once per device. The attributes stay
// with the function in the device's context, and each cudaFuncSetAttribute is a driver call on the
// launch path: two of the dozen calls of a lone decode step's launch. Devices past the 64th are
// set every time. A device reset (cudaDeviceReset) clears the attributes but not this record:
// a process that resets a device must not launch on it after.
template <auto kKernel>
cudaError_t SetSharedMemoryOnce(int dynamic_smem, bool max_carveout) {
  static std::atomic<uint64_t> done{0};
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  if (dynamic_smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem);
    if (err != cudaSuccess) return err;
  }
  if (max_carveout) {
    const cudaError_t err = cudaFuncSetAttribute(
        kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
  }
  done.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace attn::kernels::cuda
