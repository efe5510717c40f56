// Host copies into and out of pinned staging, with the element conversion fp32 requests need,
// split over a thread pool when large: one thread moves only 5-10 GB/s, so a 100 MB request
// would otherwise keep its caller busy for 10-20 ms.
#pragma once

#include <cstddef>
#include <span>

#include "attn/kernels/cpu_thread_pool.h"

namespace attn {

enum class ElementCast {
  kNone,         // plain bytes
  kFloatToHalf,  // fp32 in, fp16 out
  kFloatToBf16,
  kHalfToFloat,
  kBf16ToFloat,
};

struct HostCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t elements = 0;  // bytes for kNone
  ElementCast cast = ElementCast::kNone;
};

class HostCopier {
 public:
  // pool may be null (every copy on the calling thread). Copies of fewer than parallel_min_bytes
  // in all run on the calling thread; larger ones in pieces of about chunk_bytes, over the pool
  // when no other copy is using it, else on the calling thread.
  explicit HostCopier(kernels::cpu::CpuThreadPool* pool, size_t parallel_min_bytes = 4 << 20,
                      size_t chunk_bytes = 1 << 20)
      : pool_(pool), parallel_min_bytes_(parallel_min_bytes), chunk_bytes_(chunk_bytes) {}

  void Run(std::span<const HostCopy> copies) const;

 private:
  kernels::cpu::CpuThreadPool* pool_;
  size_t parallel_min_bytes_;
  size_t chunk_bytes_;
};

}  // namespace attn
