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

// The split kernel Kernel<Tr, paged, merges>::kFn of the launch p asks for: the splits merged by
// the last CTA of each group where p has splits and counters (DecodeParams::split_counters), else
// by the combine kernel after it (launched here too). The instantiations without the merge hold no
// code of it.
template <typename Tr, template <typename, bool, bool> class Kernel>
cudaError_t LaunchSplitAndMerge(const DecodeParams& p, bool paged, cudaStream_t stream) {
  using T = typename Tr::T;
  const bool merges = p.num_splits > 1 && p.split_counters != nullptr;
  cudaError_t err;
  if (merges) {
    err = paged ? LaunchSplit<Tr, Kernel<Tr, true, true>::kFn>(p, stream)
                : LaunchSplit<Tr, Kernel<Tr, false, true>::kFn>(p, stream);
  } else {
    err = paged ? LaunchSplit<Tr, Kernel<Tr, true, false>::kFn>(p, stream)
                : LaunchSplit<Tr, Kernel<Tr, false, false>::kFn>(p, stream);
  }
  if (err != cudaSuccess || p.num_splits == 1 || merges) return err;
  return LaunchCombine<T, Tr::kHeadDim>(p, stream);
}

template <typename Tr, bool kPaged, bool kMerges>
struct DecodeKernelOf {
  static constexpr auto kFn = &DecodeKernel<Tr, kPaged, kMerges>;
};
}  // namespace decode

template <typename T, int D>
cudaError_t RunDecode(const DecodeParams& p, bool paged, cudaStream_t stream) {
  if (p.batch == 0 || p.m_blocks == 0 || p.num_kv_heads == 0) return cudaSuccess;
  return decode::LaunchSplitAndMerge<decode::DecodeTraits<D, T>, decode::DecodeKernelOf>(p, paged,
                                                                                         stream);
}

}  // namespace attn::kernels::cuda
