// The page bookkeeping of the paged KV cache: which pages of the region are free, and how many
// page tables refer to each used page. It knows nothing of where the bytes live (the backend's
// KV region, host or device memory) nor of sessions. Thread-safe.
//
// Ownership: a page handed out by Allocate holds one reference, owned by the caller; Ref adds one
// (a fork sharing the page), Unref drops one, and the page is free again when none is left.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attn {

class KvPagePool {
 public:
  struct Options {
    int64_t num_pages = 0;
    // Bytes of one page of keys (a page of values is as large), for the messages.
    int64_t page_bytes = 0;
    // Non-zero: the free list starts in an order shuffled with this seed instead of page order,
    // so that consecutive allocations are not adjacent (tests of non-contiguous page tables).
    uint64_t shuffle_seed = 0;
  };
  static absl::StatusOr<std::unique_ptr<KvPagePool>> Create(const Options& options);

  // Appends n free pages to *pages, each with one reference, or takes none and returns
  // RESOURCE_EXHAUSTED naming the numbers when fewer than n are free.
  absl::Status Allocate(int64_t n, std::vector<int32_t>* pages);
  // One more reference to each page (which must be in use).
  void Ref(std::span<const int32_t> pages);
  // One reference less on each page; returns how many pages became free.
  int64_t Unref(std::span<const int32_t> pages);

  int32_t RefCount(int32_t page) const;
  int64_t num_pages() const { return options_.num_pages; }
  int64_t page_bytes() const { return options_.page_bytes; }
  int64_t FreePages() const;

 private:
  explicit KvPagePool(const Options& options);

  const Options options_;
  mutable std::mutex mu_;
  std::vector<int32_t> free_;      // a stack: the most recently freed page is reused first
  std::vector<int32_t> refcount_;  // per page; 0 when free
};

}  // namespace attn
