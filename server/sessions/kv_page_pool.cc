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
    : options_(options),
      free_(options.num_pages),
      refcount_(options.num_pages, 0),
      free_pages_(options.num_pages) {
  // Popped from the back: page 0 first, unless shuffled.
  std::iota(free_.rbegin(), free_.rend(), 0);
  if (options.shuffle_seed != 0) {
    std::mt19937_64 rng(options.shuffle_seed);
    std::shuffle(free_.begin(), free_.end(), rng);
    run_cursor_ = static_cast<int64_t>(rng() % static_cast<uint64_t>(options.num_pages));
  }
}

int64_t KvPagePool::FindFreeRunLocked(int32_t span) {
  const int64_t runs = options_.num_pages / span;
  if (runs == 0) return -1;
  const int64_t start = (run_cursor_ / span) % runs;
  for (int64_t i = 0; i < runs; ++i) {
    const int64_t run = (start + i) % runs;
    const int32_t* rc = refcount_.data() + run * span;
    if (std::all_of(rc, rc + span, [](int32_t c) { return c == 0; })) {
      run_cursor_ = (run + 1) * span;
      return run;
    }
  }
  return -1;
}

void KvPagePool::CompactFreeLocked() {
  std::erase_if(free_, [this](int32_t p) { return refcount_[p] != 0; });
  // A page freed twice while stale may be listed twice: keep one entry of each.
  std::vector<uint8_t> seen(refcount_.size(), 0);
  std::erase_if(free_, [&seen](int32_t p) { return std::exchange(seen[p], 1) != 0; });
}

absl::Status KvPagePool::Allocate(int64_t n, std::vector<int32_t>* runs, int32_t span) {
  if (n <= 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  const auto exhausted = [&](int64_t free_runs_found) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: this step needs ", n * span, " more page", n * span == 1 ? "" : "s",
        span > 1 ? absl::StrCat(" (", n, " runs of ", span, " adjacent pages, ",
                                free_runs_found, " such runs free)")
                 : std::string(),
        " and ", free_pages_, " of ", options_.num_pages, " pages (", options_.page_bytes,
        " bytes of keys and as many of values each) are free; close or truncate sessions, or "
        "start attnd with a larger --kv_cache_bytes"));
  };
  if (n * span > free_pages_) return exhausted(0);
  const size_t first = runs->size();
  if (span == 1) {
    for (int64_t i = 0; i < n; ++i) {
      int32_t page;
      do {  // stale entries (taken as parts of runs) are skipped
        page = free_.back();
        free_.pop_back();
      } while (refcount_[page] != 0);
      refcount_[page] = 1;
      runs->push_back(page);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t run = FindFreeRunLocked(span);
      if (run < 0) {
        // Not enough aligned runs: give back those taken so far.
        for (size_t j = first; j < runs->size(); ++j) {
          for (int32_t p = 0; p < span; ++p) {
            const int32_t page = (*runs)[j] * span + p;
            refcount_[page] = 0;
            free_.push_back(page);
          }
        }
        free_pages_ += static_cast<int64_t>(runs->size() - first) * span;
        runs->resize(first);
        return exhausted(i);
      }
      for (int32_t p = 0; p < span; ++p) refcount_[run * span + p] = 1;
      runs->push_back(static_cast<int32_t>(run));
    }
    if (free_.size() > 2 * refcount_.size()) CompactFreeLocked();
  }
  free_pages_ -= n * span;
  return absl::OkStatus();
}

void KvPagePool::Ref(std::span<const int32_t> runs, int32_t span) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t r : runs) {
    for (int32_t p = 0; p < span; ++p) ++refcount_[int64_t{r} * span + p];
  }
}

int64_t KvPagePool::Unref(std::span<const int32_t> runs, int32_t span) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t freed = 0;
  for (int32_t r : runs) {
    for (int32_t p = 0; p < span; ++p) {
      const int32_t page = r * span + p;
      if (--refcount_[page] == 0) {
        free_.push_back(page);
        ++freed;
      }
    }
  }
  free_pages_ += freed;
  if (free_.size() > 2 * refcount_.size()) CompactFreeLocked();
  return freed;
}

int32_t KvPagePool::RefCount(int32_t run, int32_t span) const {
  std::lock_guard<std::mutex> lock(mu_);
  return refcount_[int64_t{run} * span];
}

int64_t KvPagePool::FreePages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_pages_;
}

}  // namespace attn
