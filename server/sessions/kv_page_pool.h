// The page bookkeeping of the paged KV cache: which pages of the region are free, and how many
// page tables refer to each used page. It knows nothing of where the bytes live (the step
// device's KV region, host or device memory) nor of sessions. Thread-safe.
//
// Pages are handed out one at a time, or in runs of `span` consecutive pages that start at a
// multiple of span: a session whose KV row does not divide a page keeps its tokens in such runs
// (SessionManager::PageLayoutFor), which then act as one page of span * page_bytes.
//
// Ownership: a page (or run) handed out by Allocate holds one reference, owned by the caller; Ref
// adds one (a fork sharing the page), Unref drops one, and the page is free again when none is
// left. Runs are referred to by their index in units of span (the first page / span).
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

  // Appends n free runs of span pages to *runs (as run indices), each with one reference, or
  // takes none and returns RESOURCE_EXHAUSTED naming the numbers when fewer are free.
  absl::Status Allocate(int64_t n, std::vector<int32_t>* runs, int32_t span = 1);
  // One more reference to each run (which must be in use).
  void Ref(std::span<const int32_t> runs, int32_t span = 1);
  // One reference less on each run; returns how many pages became free.
  int64_t Unref(std::span<const int32_t> runs, int32_t span = 1);

  int32_t RefCount(int32_t run, int32_t span = 1) const;
  int64_t num_pages() const { return options_.num_pages; }
  int64_t page_bytes() const { return options_.page_bytes; }
  int64_t FreePages() const;

 private:
  explicit KvPagePool(const Options& options);
  // The first run of span free pages at or after the scan cursor, or -1 (mu_ held).
  int64_t FindFreeRunLocked(int32_t span);
  // Drops stale entries (pages taken as parts of runs) from the free stack (mu_ held).
  void CompactFreeLocked();

  const Options options_;
  mutable std::mutex mu_;
  // A stack of free pages (the most recently freed is reused first). Pages taken as parts of
  // runs stay in it until popped or compacted away: an entry is free only if its refcount is 0.
  std::vector<int32_t> free_;
  std::vector<int32_t> refcount_;  // per page; 0 when free
  int64_t free_pages_ = 0;
  int64_t run_cursor_ = 0;  // where the next search for a run starts (a page index)
};

}  // namespace attn
