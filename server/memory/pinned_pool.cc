#include "memory/pinned_pool.h"

#include "absl/strings/str_cat.h"

namespace attn {

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (pool_) pool_->Return(data_, capacity_);
    pool_ = other.pool_;
    data_ = other.data_;
    size_ = other.size_;
    capacity_ = other.capacity_;
    other.pool_ = nullptr;
    other.data_ = nullptr;
    other.size_ = other.capacity_ = 0;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (pool_) pool_->Return(data_, capacity_);
}

absl::StatusOr<std::unique_ptr<PinnedPool>> PinnedPool::Create(size_t limit_bytes,
                                                               Allocator allocator) {
  if (!allocator.allocate || !allocator.release) {
    return absl::InvalidArgumentError("pinned pool allocator is incomplete");
  }
  return std::unique_ptr<PinnedPool>(new PinnedPool(limit_bytes, std::move(allocator)));
}

PinnedPool::~PinnedPool() {
  for (auto& [cls, list] : free_) {
    for (void* p : list) allocator_.release(p);
  }
}

size_t PinnedPool::ClassBytes(size_t bytes) {
  size_t c = kMinClassBytes;
  while (c < bytes) c <<= 1;
  return c;
}

bool PinnedPool::MakeRoomLocked(size_t needed) {
  if (needed > limit_) return false;
  for (auto it = free_.begin(); reserved_ + needed > limit_ && it != free_.end();) {
    while (!it->second.empty() && reserved_ + needed > limit_) {
      allocator_.release(it->second.back());
      it->second.pop_back();
      reserved_ -= it->first;
    }
    it = it->second.empty() ? free_.erase(it) : std::next(it);
  }
  return reserved_ + needed <= limit_;
}

absl::StatusOr<PinnedBuffer> PinnedPool::Acquire(size_t bytes) {
  const size_t cls = ClassBytes(std::max<size_t>(bytes, 1));
  PinnedBuffer buf;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = free_.find(cls);
  if (it != free_.end() && !it->second.empty()) {
    buf.data_ = it->second.back();
    it->second.pop_back();
  } else {
    if (!MakeRoomLocked(cls)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pinned staging memory exhausted: ", bytes, " bytes asked for, ", used_,
          " of ", limit_, " in use (--pinned_pool_bytes)"));
    }
    buf.data_ = allocator_.allocate(cls);
    if (buf.data_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("could not allocate ", cls, " bytes of pinned host memory"));
    }
    reserved_ += cls;
  }
  used_ += cls;
  buf.pool_ = this;
  buf.size_ = bytes;
  buf.capacity_ = cls;
  return buf;
}

void PinnedPool::Return(void* data, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= capacity;
  free_[capacity].push_back(data);
}

MemoryBytes PinnedPool::Bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {static_cast<int64_t>(used_), static_cast<int64_t>(reserved_),
          static_cast<int64_t>(limit_)};
}

}  // namespace attn
