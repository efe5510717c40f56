// CPU backend of attention forward: tiled, online softmax, fp32 accumulation, multithreaded.
// It is the no-GPU fallback of the server.
#pragma once

#include <cstddef>

#include "attn/kernels/attention.h"

namespace attn::kernels::cpu {

struct RunOptions {
  // Worker threads for one call; 0 means std::thread::hardware_concurrency().
  int num_threads = 0;
};

// OK when this backend can run args (any head dim from 1 to 512, every dtype).
// Reads cu_seqlens, which must be host memory here.
Status CanImplement(const AttentionArgs& args);

// Bytes of scratch Run needs for args with the given thread count.
size_t WorkspaceBytes(const AttentionArgs& args, const RunOptions& options = {});

// Computes args.o (and args.lse when set). workspace must hold WorkspaceBytes(args, options)
// bytes, 64-byte aligned. Never allocates beyond its threads' stacks.
Status Run(const AttentionArgs& args, void* workspace, const RunOptions& options = {});

}  // namespace attn::kernels::cpu
