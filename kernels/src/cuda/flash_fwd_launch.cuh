// Launcher templates for the flash forward kernel (contiguous and paged K/V); explicitly
// instantiated once per (dtype, head dim) in instantiations/flash_fwd_*.cu.
#pragma once

#include <cuda_runtime.h>

#include "flash_fwd_kernel.cuh"
#include "flash_params.h"
#include "flash_traits.cuh"
#include "func_attributes.cuh"

namespace attn::kernels::cuda {

// Tile traits per (head dim, dtype, paged). Paged d=64 keeps two K/V stages instead of three: the
// page table's 2 KB (4 slots x 128 rows) on top of 3 stages (112 KB) would leave one block per SM.
template <int D, typename T, bool kPaged>
struct FwdTraits {
  using type = FlashTraits<D, T>;
};
template <typename T>
struct FwdTraits<64, T, true> {
  using type = FlashTraitsBase<64, 128, 128, 4, false, 2, T>;
};

template <typename T, int D, bool kPaged>
cudaError_t LaunchFlashFwd(const FlashParams& params, cudaStream_t stream) {
  using Tr = typename FwdTraits<D, T, kPaged>::type;
  constexpr auto kernel = &FlashFwdKernel<Tr, kPaged>;
  // Paged with a K/V ring: 4 slots of kBlockN page numbers after the ring (see the kernel).
  constexpr int kSmem =
      Tr::kSmemBytes + (kPaged && Tr::kKVStages >= 2 ? 4 * Tr::kBlockN * int(sizeof(int32_t)) : 0);
  // The kernel reads global memory through cp.async.cg only (L1 bypassed): give shared memory the
  // whole carveout so that two blocks per SM fit at 112 KB each (d=64, 3 stages). Measured on
  // H200: +2.2% (d=64) and +1.4% (d=128) median over leaving the choice to the driver.
  if (const cudaError_t err = SetSharedMemoryOnce<kernel>(kSmem, true); err != cudaSuccess) {
    return err;
  }
  const dim3 grid((params.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, params.num_heads,
                  params.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  kernel<<<grid, Tr::kNThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t RunFlashFwd(const FlashParams& params, cudaStream_t stream) {
  return LaunchFlashFwd<T, D, false>(params, stream);
}

template <typename T, int D>
cudaError_t RunFlashFwdPaged(const FlashParams& params, cudaStream_t stream) {
  return LaunchFlashFwd<T, D, true>(params, stream);
}

}  // namespace attn::kernels::cuda
