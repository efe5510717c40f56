// Launcher template of the FP8 K/V decode kernel (decode_fp8_kernel.cuh) and the combine kernel;
// explicitly instantiated once per (q dtype, head dim) in instantiations/decode_fp8_*.cu.
#pragma once

#include <cuda_runtime.h>

#include "decode_fp8_kernel.cuh"
#include "decode_launch.cuh"
#include "decode_params.h"

namespace attn::kernels::cuda {

template <typename T, int D>
cudaError_t RunDecodeFp8(const DecodeParams& p, bool paged, cudaStream_t stream) {
  using Tr = decode::DecodeFp8Traits<D, T>;
  if (p.batch == 0 || p.m_blocks == 0 || p.num_kv_heads == 0) return cudaSuccess;
  if (p.k_descale == nullptr || p.v_descale == nullptr) return cudaErrorInvalidValue;
  const cudaError_t err =
      paged ? decode::LaunchSplit<Tr, &decode::DecodeFp8Kernel<Tr, true>>(p, stream)
            : decode::LaunchSplit<Tr, &decode::DecodeFp8Kernel<Tr, false>>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1 || p.split_counters != nullptr) return err;
  return decode::LaunchCombine<T, D>(p, stream);
}

}  // namespace attn::kernels::cuda
