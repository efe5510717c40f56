// One KV-cache session: its shape, owner and, per layer, a page table over the KV page pool
// (pages in token order, the last one possibly partial) and the count of tokens cached.
//
// Ownership: the session owns one reference on every page of its tables (KvPagePool); a fork
// takes its own references on the pages it shares. A step in progress owns the pages it took
// (PendingAppend) until CommitAppend moves them into the table or AbortAppend gives them back.
// The SessionManager owns the Session (shared with the steps in flight, which hold a
// shared_ptr); closing releases the pages of every layer with no step running, and a running
// step's layer releases its pages when that step ends.
//
// Ordering: the steps of one layer run one at a time, in the order AcquireLayer was called
// (a FIFO per (session, layer)); a step begins (BeginAppend) only once it holds the layer.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/kernels/attention.h"
#include "sessions/kv_page_pool.h"

namespace attn {

struct SessionShape {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  kernels::DType dtype = kernels::DType::kBFloat16;
  int64_t max_tokens = 0;   // per layer
  // A page of the session's tables: page_span adjacent pages of the pool (1 when the row divides
  // a pool page), holding page_tokens token rows.
  int32_t page_tokens = 0;
  int32_t page_span = 1;
  // The cache's element type when it is not dtype: kernels::DType::kFloat8E4M3, whose codes are
  // worth E4M3(code) * k_scales[g] (keys of KV head g; values with v_scales), fixed at creation.
  std::optional<kernels::DType> cache_dtype;
  std::vector<float> k_scales, v_scales;  // FP8 cache: num_kv_heads each
  kernels::DType CacheDType() const { return cache_dtype.value_or(dtype); }
  bool Fp8Cache() const { return CacheDType() == kernels::DType::kFloat8E4M3; }
  // Bytes of one token's keys (or values) in one layer, as cached.
  int64_t RowBytes() const {
    return int64_t{num_kv_heads} * head_dim * kernels::DTypeSize(CacheDType());
  }
};

// Rows of the KV region in the session's row size, as page * page_tokens + offset (pages of its
// tables).
struct RowCopy {
  int64_t src_row = 0;
  int64_t dst_row = 0;
};

// A step's append between BeginAppend and CommitAppend/AbortAppend: the layer's table after the
// step is its table before (Session::LayerPages), with the last page replaced when the step copies
// a shared partial page (copy on write), then the pages taken.
struct PendingAppend {
  int32_t layer = 0;
  int64_t tokens_before = 0;  // cached in the layer before the step
  int64_t tokens_after = 0;   // and after it
  std::vector<int32_t> taken;  // pages taken from the pool for this step (owned), in table order
  // Copy on write of the shared partial last page: the page that replaces it (the first of
  // taken) and the rows to copy; replaced is the shared page given up on commit.
  std::optional<int32_t> replaced;
  std::vector<RowCopy> copies;
  int64_t appended() const { return tokens_after - tokens_before; }
  // Pages of the table after the step.
  int64_t TablePages(int32_t page_tokens) const {
    return (tokens_after + page_tokens - 1) / page_tokens;
  }
};

class Session {
 public:
  using Clock = std::chrono::steady_clock;

  Session(std::string id, std::string owner, SessionShape shape, KvPagePool* pool);
  ~Session();  // gives back every page still held
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  const std::string& owner() const { return owner_; }
  const SessionShape& shape() const { return shape_; }

  // A new session with this one's shape and owner that shares its pages as they are now.
  std::unique_ptr<Session> Fork(std::string id) const;

  // Each layer's page table and token count as they are now, each page with one more reference
  // owned by the caller (so that a close while the pages are read frees none of them): for moving
  // the session to another replica. NOT_FOUND once closed; FAILED_PRECONDITION while a layer has
  // a step in progress or waiting.
  struct LayerState {
    std::vector<int32_t> pages;
    int64_t tokens = 0;
  };
  absl::StatusOr<std::vector<LayerState>> RefLayerStates() const;
  // Gives a new session (no step yet, no page) these tables; it takes over the one reference the
  // caller owns on each page.
  void AdoptLayers(std::vector<LayerState> layers);

  // Holds the session still while it is moved to another replica: from Freeze on, steps that
  // have not begun (BeginAppend), truncate and close get UNAVAILABLE ("attnd-session-moving",
  // nothing applied) until Thaw (the move failed); a session closed while frozen has moved and
  // stays frozen, so that its late steps are sent again too. Steps that had begun end as usual:
  // the tables are still once Settled (RefLayerStates refuses a frozen session before that).
  // NOT_FOUND once closed.
  absl::Status Freeze();
  void Thaw();
  bool frozen() const;
  bool Settled() const;  // no step between BeginAppend and CommitAppend/AbortAppend

  // The per-layer FIFO. True: no step of the layer is in progress and the caller's step holds
  // the layer now. False: `start` runs (on the thread that ends the previous step) once every
  // earlier step of the layer has ended; it then holds the layer.
  bool AcquireLayer(int32_t layer, std::function<void()> start);
  // Ends the caller's hold on the layer and starts the next waiting step, if any. Call with no
  // lock of the caller's held.
  void ReleaseLayer(int32_t layer);

  // Takes the pages a step appending `tokens` needs (a copy for a shared partial last page, then
  // new pages), all or nothing. NOT_FOUND once the session is closed; RESOURCE_EXHAUSTED over the
  // session's token limit or when the pool is short of pages. The caller holds the layer.
  absl::StatusOr<PendingAppend> BeginAppend(int32_t layer, int64_t tokens);
  // The layer's page table after the pending append p, for the caller that holds the layer
  // (nobody else changes the table then): written to dst, which has room for
  // p.TablePages(shape().page_tokens) entries, or returned.
  void WriteTableAfter(const PendingAppend& p, int32_t* dst) const;
  std::vector<int32_t> TableAfter(const PendingAppend& p) const;
  void CommitAppend(PendingAppend pending);
  void AbortAppend(PendingAppend pending);

  // Drops the last `tokens` of every layer; INVALID_ARGUMENT (changing nothing) when a layer
  // holds fewer, FAILED_PRECONDITION while a layer has a step in progress.
  struct TruncateResult {
    std::vector<int64_t> cached_tokens;
    int64_t freed_pages = 0;
  };
  absl::StatusOr<TruncateResult> Truncate(int64_t tokens);

  // Marks the session closed and gives back the pages of the layers with no step in progress
  // (the others when their step ends). Returns the pages that became free now.
  int64_t Close();
  bool closed() const;

  int64_t CachedTokens(int32_t layer) const;
  int64_t PagesHeld() const;  // pool pages the tables hold references to
  // The pages (runs) of every layer's table as they are now, unreferenced: which sessions share
  // pages (SessionManager::OpenSessionFamilies).
  std::vector<int32_t> TablePages() const;
  void Touch(Clock::time_point now);
  Clock::time_point last_used() const;
  // True when some layer has a step in progress or waiting.
  bool Busy() const;

 private:
  struct Layer {
    std::vector<int32_t> pages;
    int64_t tokens = 0;
    bool busy = false;
    std::deque<std::function<void()>> waiting;
  };
  int64_t ReleaseLayerPagesLocked(Layer& layer);

  const std::string id_;
  const std::string owner_;
  const SessionShape shape_;
  KvPagePool* const pool_;
  mutable std::mutex mu_;
  std::vector<Layer> layers_;
  bool closed_ = false;
  bool frozen_ = false;
  int64_t appending_ = 0;  // steps between BeginAppend and CommitAppend/AbortAppend
  Clock::time_point last_used_;
};

}  // namespace attn
