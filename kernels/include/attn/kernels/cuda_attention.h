// CUDA backend of attention forward, fp16 and bf16, contiguous or paged K/V (PagedKv in
// attention.h). Run picks one of two kernel families on its own:
//  - decode (max_seqlen_q <= 16 queries per sequence): a split-KV ("flash-decoding") kernel. One
//    CTA computes all the query heads of one KV head (GQA packed as rows of mma.sync m16n8k16
//    tiles), so each K/V byte is read once per group; the keys of each sequence are split over
//    enough CTAs to fill the GPU in whole waves, and a combine kernel merges the splits by their
//    LSE. The split count is chosen on the host from batch, heads, max_seqlen_q/k and the SM
//    count; the fp32 partials live in the caller's workspace (WorkspaceBytes).
//  - forward (everything else): one fused FlashAttention kernel in two generations:
//    generation 2 (sm_90a: wgmma, TMA, warp specialisation) on compute capability 9.0 devices where
//    CanImplementGen2 holds (contiguous K/V, head dims 64/128/256 compiled for 90a); generation 1
//    (FlashAttention-2 class: mma.sync m16n8k16, ldmatrix, cp.async pipeline) everywhere else,
//    reading K/V through the page table when paged (chunked prefill over a cached prefix).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attn/kernels/attention.h"

namespace attn::kernels::cuda {

// True when this build carries CUDA kernels (the library was compiled with nvcc).
bool Compiled();

// OK when a kernel of this build can run args: dtype fp16/bf16, a compiled head dim, sizes in
// range (paged: num_pages * page_size < 2^31). Does not read cu_seqlens or page tables (device
// memory); callers validate them on the host first (ValidateCuSeqlens, ValidatePageTable).
Status CanImplement(const AttentionArgs& args);

// Device scratch Run needs for args, in bytes: the split-KV partials of the decode kernel
// (splits * total_q * num_heads * (head_dim + 1) floats), 0 when no split is made; for the forward
// kernel 16 bytes (generation 2's tile counter: with none, causal problems keep a fixed, slower
// tile order). Depends on the current device (its SM count); pass Run a buffer of at least this
// size, 256-byte aligned, used by one launch at a time (launches on one stream may share it).
size_t WorkspaceBytes(const AttentionArgs& args);

// True when Run sends args to the decode kernel (max_seqlen_q <= 16), false for the forward kernel.
bool UsesDecodeKernel(const AttentionArgs& args);

// Enqueues the computation on stream. All pointers in args and workspace are device pointers.
// Never allocates, never synchronizes and never reads device memory from the host; returns the
// launch error, if any (cudaErrorInvalidValue when CanImplement fails or a needed workspace is
// null).
cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream);

// Which kernel Run uses. kAuto: the decode kernel for decode shapes, else generation 2 where
// CanImplementGen2 holds, else generation 1. kGen1 / kGen2 force that forward kernel for every
// shape (tests and benchmarks compare the two on the same arguments).
enum class FwdGeneration : uint8_t { kAuto = 0, kGen1 = 1, kGen2 = 2 };

// OK when the generation-2 forward kernel can run args on the current device: CanImplement
// holds, the device has compute capability 9.0, the build compiled the kernel for this head dim
// (ATTN_CUDA_ARCHS lists 90a), K/V are contiguous, and q, k, v are 16-byte aligned.
Status CanImplementGen2(const AttentionArgs& args);

// As Run above, with the kernel chosen by gen; cudaErrorInvalidValue when a forced generation
// cannot run args (CanImplementGen2 for kGen2).
cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream, FwdGeneration gen);

// Head dims compiled into this build, ascending; count written to *n.
const int* CompiledHeadDims(int* n);

}  // namespace attn::kernels::cuda
