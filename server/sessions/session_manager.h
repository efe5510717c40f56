// The sessions of one attnd: creation (with the limits), lookup by id for the other session RPCs
// (replica, owner, closed or expired ids), fork, truncate, close, and expiry of idle sessions by
// a thread of its own. Session ids are "<replica_id>.<32 random hex digits>".
//
// Ownership: the manager owns the open sessions (the steps in flight share them); the page pool
// and metrics are borrowed and must outlive it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session.h"

namespace attn {

class Metrics;

// A page holds --kv_page_tokens tokens of this many bytes of keys (8 KV heads x head_dim 128 x
// 2 bytes) and as many of values; sessions with another KV row get page_bytes / row tokens per
// page (CreateSessionResponse.page_tokens), or, where the row does not divide a page, pages of
// several adjacent pool pages (PageLayoutFor).
constexpr int64_t kReferenceKvRowBytes = 2048;

// Most pool pages one page of a session's table may span.
constexpr int32_t kMaxPageSpan = 64;

// How a session's KV row fits the pool's pages: a page of its tables is `span` adjacent pool
// pages (the fewest whose bytes are a whole number of rows) holding `tokens` rows.
struct PageLayout {
  int32_t tokens = 0;
  int32_t span = 1;
};

class SessionManager {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    std::string replica_id;            // [A-Za-z0-9_-]{1,64}
    int64_t max_sessions = 1024;
    int64_t max_session_tokens = 1 << 20;  // per layer
    std::chrono::milliseconds ttl = std::chrono::minutes(10);
    // How often idle sessions are looked for; 0: ttl / 4, at most 1 s.
    std::chrono::milliseconds sweep_interval{0};
    // Ids of closed and expired sessions remembered, so that NOT_FOUND can say which.
    size_t remembered_ids = 4096;
    std::vector<int32_t> head_dims;  // accepted head dims
  };
  struct CreateParams {
    int32_t num_layers = 0;
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;
    kernels::DType dtype = kernels::DType::kBFloat16;
    int64_t max_tokens = 0;  // 0: the server's limit
    // An FP8 cache (kernels::DType::kFloat8E4M3) and its per-KV-head scales; unset: dtype.
    std::optional<kernels::DType> cache_dtype;
    std::vector<float> k_scales, v_scales;
  };

  static absl::StatusOr<std::unique_ptr<SessionManager>> Create(const Options& options,
                                                                KvPagePool* pool,
                                                                Metrics* metrics);
  ~SessionManager();  // stops the expiry thread; open sessions are closed

  // A new session of owner; INVALID_ARGUMENT for a parameter out of range (naming it),
  // RESOURCE_EXHAUSTED at --max_sessions.
  absl::StatusOr<std::shared_ptr<Session>> CreateSession(const CreateParams& params,
                                                         const std::string& owner);
  // The open session id of owner (owner "" matches any when tokens are off): NOT_FOUND for an
  // unknown, closed or expired id (saying which) or one of another owner, FAILED_PRECONDITION
  // for an id of another replica. Resets the session's idle clock.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id, const std::string& owner);
  absl::StatusOr<std::shared_ptr<Session>> Fork(const std::string& id, const std::string& owner);
  // Returns the pages freed.
  absl::StatusOr<int64_t> Close(const std::string& id, const std::string& owner);
  absl::StatusOr<Session::TruncateResult> Truncate(const std::string& id,
                                                   const std::string& owner, int64_t tokens);

  // Hand-off on drain (session_transfer.h moves the bytes). StopCreating: CreateSession gets
  // UNAVAILABLE and ForkSession the moving status from now on, so that the set of open sessions
  // only shrinks. OpenSessionIds: the sessions open now. BeginMove freezes one (Session::Freeze;
  // export it once Settled); then EndMove with the peer's address and new id (the session is closed here,
  // its pages given back, and calls on its id get SessionMovedError from then on), or with an
  // empty new_id (the move failed: the session goes on here).
  // OpenSessionFamilies: the same, grouped into fork families (sessions that share pages, directly
  // or through others), each sorted by id; once StopCreating ran
  // no fork adds sharing, so a family found then only ever splits.
  void StopCreating();
  std::vector<std::string> OpenSessionIds() const;
  std::vector<std::vector<std::string>> OpenSessionFamilies() const;
  absl::StatusOr<std::shared_ptr<Session>> BeginMove(const std::string& id);
  void EndMove(const std::shared_ptr<Session>& session, const std::string& address,
               const std::string& new_id);
  // Checks an incoming session's shape against this replica's limits and page layout
  // (INVALID_ARGUMENT naming the field), UNAVAILABLE once StopCreating ran, RESOURCE_EXHAUSTED at
  // --max_sessions (counting `before` sessions of the same stream not yet added); then each
  // `finish` makes a session of the stream with its new id (SessionImporter::Finish), and they
  // become open here together, or none does.
  // source_ids: each session's id on the replica it came from (may be empty): a call on that id
  // here, by the session's owner, gets SessionMovedError naming the new id and an empty address
  // (this replica), for as long as ids are remembered, so that a caller whose source replica has
  // gone can find its session by asking the other replicas.
  absl::Status CheckImport(const SessionShape& shape, int64_t before = 0) const;
  absl::StatusOr<std::vector<std::shared_ptr<Session>>> AddImported(
      const std::vector<std::function<absl::StatusOr<std::unique_ptr<Session>>(std::string id)>>&
          finish,
      const std::vector<std::string>& source_ids = {});

  // Closes the sessions idle for longer than the TTL (none with a step in progress) as of now;
  // returns how many. The expiry thread calls it; tests may too.
  int64_t ExpireIdle(Clock::time_point now);

  int64_t OpenSessions() const;
  const Options& options() const { return options_; }
  KvPagePool& pool() const { return *pool_; }
  // The page layout of sessions of this row size (keys of one token of one layer); tokens 0 when
  // no run of at most kMaxPageSpan pool pages holds whole rows.
  PageLayout PageLayoutFor(int64_t row_bytes) const;
  int32_t PageTokensFor(int64_t row_bytes) const { return PageLayoutFor(row_bytes).tokens; }
  // Sets the session and page gauges from the current state.
  void UpdateMetrics();
  // The same at most every 50 ms (steps call it as they end; the expiry thread every sweep).
  void UpdateMetricsSometimes();

 private:
  SessionManager(const Options& options, KvPagePool* pool, Metrics* metrics);
  std::string NewIdLocked();
  // OK when n more sessions may open here: not draining, within --max_sessions (mu_ held).
  absl::Status RoomForMoreLocked(int64_t n) const;
  absl::Status CheckCreateParams(const CreateParams& p) const;
  using SessionMap = std::unordered_map<std::string, std::shared_ptr<Session>>;
  // The session `owner` may use, or why not (mu_ held).
  absl::StatusOr<SessionMap::iterator> FindOwnedLocked(const std::string& id,
                                                       const std::string& owner);
  absl::Status NotOpen(const std::string& id) const;  // mu_ held
  absl::Status Draining() const;
  void RememberLocked(const std::string& id, const char* how);
  void ExpiryLoop();

  const Options options_;
  KvPagePool* const pool_;
  Metrics* const metrics_;

  mutable std::mutex mu_;
  SessionMap sessions_;
  std::unordered_map<std::string, const char*> gone_;  // id -> "closed" / "expired"
  // Moved sessions: id -> (address, new id); remembered for as long as closed ones.
  std::unordered_map<std::string, std::pair<std::string, std::string>> moved_;
  // Imported sessions: id on their source replica -> id here; the oldest forgotten first.
  std::unordered_map<std::string, std::string> imported_from_;
  std::deque<std::string> imported_order_;
  bool stop_creating_ = false;
  std::deque<std::string> gone_order_;
  std::mt19937_64 rng_;
  std::atomic<Clock::rep> metrics_updated_{0};
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread expiry_;
};

// "<replica>" of a "<replica>.<rest>" id, or "" when id has no '.'.
std::string ReplicaOfSessionId(const std::string& id);

}  // namespace attn
