#include "sessions/kv_page_pool.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"

namespace attn {

absl::StatusOr<std::unique_ptr<KvPagePool>> KvPagePool::Create(const Options& options) {
  if (options.num_pages < 1 || options.num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the KV cache must have 1 to 2^31 - 1 pages, got ", options.num_pages,
                     " (--kv_cache_bytes too small for one page of keys and values?)"));
  }
  if (options.page_bytes < 1) return absl::InvalidArgumentError("KV page_bytes must be >= 1");
  return std::unique_ptr<KvPagePool>(new KvPagePool(options));
}

KvPagePool::KvPagePool(const Options& options)
    : options_(options), free_(options.num_pages), refcount_(options.num_pages, 0) {
  // Popped from the back: page 0 first, unless shuffled.
  std::iota(free_.rbegin(), free_.rend(), 0);
  if (options.shuffle_seed != 0) {
    std::mt19937_64 rng(options.shuffle_seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
}

absl::Status KvPagePool::Allocate(int64_t n, std::vector<int32_t>* pages) {
  if (n <= 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  if (n > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: this step needs ", n, " more page", n == 1 ? "" : "s", " and ",
        free_.size(), " of ", options_.num_pages, " pages (", options_.page_bytes,
        " bytes of keys and as many of values each) are free; close or truncate sessions, or "
        "start attnd with a larger --kv_cache_bytes"));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t page = free_.back();
    free_.pop_back();
    refcount_[page] = 1;
    pages->push_back(page);
  }
  return absl::OkStatus();
}

void KvPagePool::Ref(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t p : pages) ++refcount_[p];
}

int64_t KvPagePool::Unref(std::span<const int32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t freed = 0;
  for (int32_t p : pages) {
    if (--refcount_[p] == 0) {
      free_.push_back(p);
      ++freed;
    }
  }
  return freed;
}

int32_t KvPagePool::RefCount(int32_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  return refcount_[page];
}

int64_t KvPagePool::FreePages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_.size());
}

}  // namespace attn
