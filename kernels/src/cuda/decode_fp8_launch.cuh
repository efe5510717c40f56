// Launcher template of the FP8 K/V decode kernel (decode_fp8_kernel.cuh) and the combine kernel;
// explicitly instantiated once per (q dtype, head dim) in instantiations/decode_fp8_*.cu.
#pragma once

#include <cuda_runtime.h>

#include "decode_fp8_kernel.cuh"
#include "decode_launch.cuh"
#include "decode_params.h"

namespace attn::kernels::cuda {

namespace decode {
template <typename Tr, bool kPaged, bool kMerges>
struct DecodeFp8KernelOf {
  static constexpr auto kFn = &DecodeFp8Kernel<Tr, kPaged, kMerges>;
};
}  // namespace decode

template <typename T, int D>
cudaError_t RunDecodeFp8(const DecodeParams& p, bool paged, cudaStream_t stream) {
  if (p.batch == 0 || p.m_blocks == 0 || p.num_kv_heads == 0) return cudaSuccess;
  if (p.k_descale == nullptr || p.v_descale == nullptr) return cudaErrorInvalidValue;
  return decode::LaunchSplitAndMerge<decode::DecodeFp8Traits<D, T>, decode::DecodeFp8KernelOf>(
      p, paged, stream);
}

}  // namespace attn::kernels::cuda
