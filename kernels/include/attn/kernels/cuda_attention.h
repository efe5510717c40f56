// CUDA backend of attention forward: one fused FlashAttention-2-class kernel per launch
// (mma.sync m16n8k16, ldmatrix, cp.async pipeline), for fp16 and bf16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "attn/kernels/attention.h"

namespace attn::kernels::cuda {

// True when this build carries CUDA kernels (the library was compiled with nvcc).
bool Compiled();

// OK when a kernel of this build can run args: dtype fp16/bf16, a compiled head dim, sizes in
// range. Does not read cu_seqlens (device memory); callers validate them on the host first.
Status CanImplement(const AttentionArgs& args);

// Device scratch Run needs (0 for the current kernels; kept for the split-KV variants).
size_t WorkspaceBytes(const AttentionArgs& args);

// Enqueues the computation on stream. All pointers in args are device pointers. Never
// allocates and never synchronizes; returns the launch error, if any.
cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream);

// Head dims compiled into this build, ascending; count written to *n.
const int* CompiledHeadDims(int* n);

}  // namespace attn::kernels::cuda
