// Launcher template for the split-KV decode kernel and its combine kernel; explicitly instantiated
// once per (dtype, head dim) in instantiations/decode_*.cu.
#pragma once

#include <cuda_runtime.h>

#include "decode_kernel.cuh"
#include "decode_params.h"

namespace attn::kernels::cuda {

namespace decode {
template <typename Tr, bool kPaged>
cudaError_t LaunchSplit(const DecodeParams& p, cudaStream_t stream) {
  auto kernel = &DecodeKernel<Tr, kPaged>;
  constexpr int kSmem = Tr::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  // Loads go through cp.async.cg (L1 bypassed): all of the carveout to shared memory.
  {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(p.m_blocks * p.num_splits, p.num_kv_heads, p.batch);
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}
}  // namespace decode

template <typename T, int D>
cudaError_t RunDecode(const DecodeParams& p, bool paged, cudaStream_t stream) {
  using Tr = decode::DecodeTraits<D, T>;
  if (p.batch == 0 || p.m_blocks == 0 || p.num_kv_heads == 0) return cudaSuccess;
  cudaError_t err = paged ? decode::LaunchSplit<Tr, true>(p, stream)
                          : decode::LaunchSplit<Tr, false>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1) return err;

  constexpr int kRowsPerBlock = 4;  // one warp per (token, head) row
  const int64_t rows = int64_t(p.total_q) * p.num_heads;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  cfg.blockDim = dim3(32 * kRowsPerBlock);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, &decode::DecodeCombineKernel<T, D>, p);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace attn::kernels::cuda
