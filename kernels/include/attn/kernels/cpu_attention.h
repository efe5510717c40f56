// CPU backend of attention forward: tiled, online softmax, fp32 accumulation, multithreaded
// over (sequence, head, query tile). The no-GPU fallback of the server.
#pragma once

#include <cstddef>

#include "attn/kernels/attention.h"
#include "attn/kernels/cpu_thread_pool.h"

namespace attn::kernels::cpu {

// Largest head dim this backend runs.
constexpr int kMaxHeadDim = 512;

// OK when this backend can run args (head dims 1..kMaxHeadDim, every dtype, FP8 K/V with any q
// dtype, contiguous or paged K/V). Reads cu_seqlens, FP8 scales (ValidateKvScales) and, for paged
// args, the page table (ValidatePageTable): host memory here, like every pointer of args.
Status CanImplement(const AttentionArgs& args);

// Bytes of scratch Run needs for args when run on a pool of num_workers workers.
size_t WorkspaceBytes(const AttentionArgs& args, int num_workers);

// Computes args.o (and args.lse when set). workspace holds WorkspaceBytes(args, workers) bytes,
// where workers is pool->NumWorkers() (1 when pool is null: runs on the calling thread).
Status Run(const AttentionArgs& args, void* workspace, CpuThreadPool* pool);

}  // namespace attn::kernels::cpu
