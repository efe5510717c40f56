// CUDA backend of attention forward, fp16 and bf16, contiguous or paged K/V (PagedKv in
// attention.h). Run picks one of two kernel families on its own:
//  - decode (max_seqlen_q <= 16 queries per sequence): a split-KV ("flash-decoding") kernel. One
//    CTA computes all the query heads of one KV head (GQA packed as rows of mma.sync m16n8k16
//    tiles), so each K/V byte is read once per group; the keys of each sequence are split over
//    enough CTAs to fill the GPU in whole waves, and a combine kernel merges the splits by their
//    LSE. The split count is chosen on the host from batch, heads, max_seqlen_q/k and the SM
//    count; the fp32 partials live in the caller's workspace (WorkspaceBytes).
//  - forward (everything else): one fused FlashAttention-2-class kernel (mma.sync m16n8k16,
//    ldmatrix, cp.async pipeline), reading K/V through the page table when paged (chunked prefill
//    over a cached prefix).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "attn/kernels/attention.h"

namespace attn::kernels::cuda {

// True when this build carries CUDA kernels (the library was compiled with nvcc).
bool Compiled();

// OK when a kernel of this build can run args: dtype fp16/bf16, a compiled head dim, sizes in
// range (paged: num_pages * page_size < 2^31). Does not read cu_seqlens or page tables (device
// memory); callers validate them on the host first (ValidateCuSeqlens, ValidatePageTable).
Status CanImplement(const AttentionArgs& args);

// Device scratch Run needs for args, in bytes: the split-KV partials of the decode kernel
// (splits * total_q * num_heads * (head_dim + 1) floats), 0 when no split is made. Depends on the
// current device (its SM count); pass Run a buffer of at least this size, 256-byte aligned.
size_t WorkspaceBytes(const AttentionArgs& args);

// True when Run sends args to the decode kernel (max_seqlen_q <= 16), false for the forward kernel.
bool UsesDecodeKernel(const AttentionArgs& args);

// Enqueues the computation on stream. All pointers in args and workspace are device pointers.
// Never allocates, never synchronizes and never reads device memory from the host; returns the
// launch error, if any (cudaErrorInvalidValue when CanImplement fails or a needed workspace is
// null).
cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream);

// Head dims compiled into this build, ascending; count written to *n.
const int* CompiledHeadDims(int* n);

}  // namespace attn::kernels::cuda
