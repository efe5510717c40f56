// Device memory for transient tensors: CUDA's stream-ordered allocator (a cudaMemPool_t of our
// own with a release threshold, so freed memory stays reserved for reuse) plus a hard bound on
// bytes in use. Exhaustion is RESOURCE_EXHAUSTED for the one request, never a crash. The bound is
// exact for bytes in use; bytes reserved can pass it for a moment, when one stream allocates
// while memory freed on another is not yet reusable, and fall back under it at the next sync.
// The paged KV cache of sessions is meant to sit beside it, carved from the same bound.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "memory/memory_bytes.h"

namespace attn {

class DevicePool {
 public:
  static absl::StatusOr<std::unique_ptr<DevicePool>> Create(int device, size_t limit_bytes);
  ~DevicePool();

  // Stream-ordered allocation on stream; the memory may be used by work on stream from now on.
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream);
  // Stream-ordered free: the memory returns to the pool once stream's earlier work is done.
  void Free(void* ptr, size_t bytes, cudaStream_t stream);

  MemoryBytes Bytes() const;
  size_t limit() const { return limit_; }

 private:
  DevicePool(cudaMemPool_t pool, size_t limit) : pool_(pool), limit_(limit) {}

  cudaMemPool_t pool_;
  const size_t limit_;
  std::atomic<size_t> used_{0};
};

}  // namespace attn
