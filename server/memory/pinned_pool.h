// A bounded pool of page-locked host buffers for staging H2D/D2H copies. Buffers come in
// power-of-two size classes and are kept for reuse once returned; a request that would take the
// pool past its limit first releases cached buffers, then fails with RESOURCE_EXHAUSTED.
// The raw allocator is injected (cudaHostAlloc in attnd, malloc in tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "memory/memory_bytes.h"

namespace attn {

class PinnedPool;

// A buffer on loan from a PinnedPool; returned to it on destruction. Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }          // bytes asked for
  size_t capacity() const { return capacity_; }  // bytes of the size class

 private:
  friend class PinnedPool;
  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

class PinnedPool {
 public:
  struct Allocator {
    std::function<void*(size_t)> allocate;  // returns nullptr on failure
    std::function<void(void*)> release;
  };
  static constexpr size_t kMinClassBytes = size_t{1} << 16;

  static absl::StatusOr<std::unique_ptr<PinnedPool>> Create(size_t limit_bytes,
                                                            Allocator allocator);
  ~PinnedPool();  // All buffers must have been returned.

  // A buffer of at least `bytes`. RESOURCE_EXHAUSTED when the limit does not allow it.
  absl::StatusOr<PinnedBuffer> Acquire(size_t bytes);

  MemoryBytes Bytes() const;

 private:
  friend class PinnedBuffer;
  PinnedPool(size_t limit, Allocator allocator) : limit_(limit), allocator_(std::move(allocator)) {}
  void Return(void* data, size_t capacity);
  static size_t ClassBytes(size_t bytes);
  // Frees cached buffers until `needed` more bytes fit under the limit; false if impossible.
  bool MakeRoomLocked(size_t needed);

  const size_t limit_;
  const Allocator allocator_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // by size class
  size_t reserved_ = 0;                        // allocated from the allocator
  size_t used_ = 0;                            // on loan
};

}  // namespace attn
