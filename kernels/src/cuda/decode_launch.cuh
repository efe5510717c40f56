// Launcher templates of the split-KV decode kernels (16-bit and FP8 K/V) and their combine kernel;
// explicitly instantiated once per (dtype, head dim) in instantiations/decode_*.cu (RunDecode) and
// instantiations/decode_fp8_*.cu (RunDecodeFp8, decode_fp8_launch.cuh).
#pragma once

#include <cuda_runtime.h>

#include "decode_kernel.cuh"
#include "decode_params.h"
#include "func_attributes.cuh"

namespace attn::kernels::cuda {

namespace decode {
// The split kernel kKernel of traits Tr: grid (row blocks x splits, KV heads, sequences).
template <typename Tr, auto kKernel>
cudaError_t LaunchSplit(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kSmem = Tr::kSmemBytes;
  // Loads go through cp.async.cg (L1 bypassed): all of the carveout to shared memory.
  if (const cudaError_t err = SetSharedMemoryOnce<kKernel>(kSmem, true); err != cudaSuccess) {
    return err;
  }
  const dim3 grid(p.m_blocks * p.num_splits, p.num_kv_heads, p.batch);
  kKernel<<<grid, Tr::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// The combine of num_splits > 1 partials where the split kernel does not merge them itself
// (p.split_counters null): one CTA per (token, head) row, a programmatic dependent of the split
// kernel where p.pdl (the split kernel lets it launch early, GridDependency*).
template <typename T, int D>
cudaError_t LaunchCombine(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.total_q) * p.num_heads;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(rows));
  cfg.blockDim = dim3(32 * kCombineWarps);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, &DecodeCombineKernel<T, D>, p);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}
}  // namespace decode

template <typename T, int D>
cudaError_t RunDecode(const DecodeParams& p, bool paged, cudaStream_t stream) {
  using Tr = decode::DecodeTraits<D, T>;
  if (p.batch == 0 || p.m_blocks == 0 || p.num_kv_heads == 0) return cudaSuccess;
  const cudaError_t err = paged ? decode::LaunchSplit<Tr, &decode::DecodeKernel<Tr, true>>(p, stream)
                                : decode::LaunchSplit<Tr, &decode::DecodeKernel<Tr, false>>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1 || p.split_counters != nullptr) return err;
  return decode::LaunchCombine<T, D>(p, stream);
}

}  // namespace attn::kernels::cuda
