// KV-cache sessions (attn.v1 CreateSession, Step, BatchStep, TruncateSession, ForkSession,
// CloseSession) with plain tensors, over one attnd or many replicas.
//
// Two layers:
//  - free functions on one Client (one endpoint): CreateSession(client, spec), Step(client, in),
//    ... They send the call to that endpoint whatever the session id says.
//  - SessionClient: many endpoints (a list of targets, and/or a DNS name that resolves to many
//    addresses, such as a Kubernetes headless Service). It creates each session on the replica
//    with the most free KV pages and sends every call on a session to the replica that holds it,
//    found from the session id's prefix ("<replica_id>.<random>", see attention.proto), so a
//    session id made by another process routes too when its replica is one of the endpoints.
//
// Sessions that move: a replica that drains with --handoff_peers moves its sessions to a peer,
// and then answers calls on a moved id with FAILED_PRECONDITION naming the new address and id
// ("attnd-moved-to", attention.proto ImportSession). SessionClient follows by itself: it sends
// the call again to that address with the new id and remembers the mapping, so that callers keep
// using the id they were given; calls refused while the session is being moved (UNAVAILABLE,
// "attnd-session-moving": nothing was applied) are sent again shortly, within the call's
// timeout. CurrentSessionId tells the id a session goes by now.
//
// Errors are absl::Status with the server's code and message; errors made here (no replica for
// a session id, no endpoint reachable) say so and name the session and the endpoints.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/client/client.h"

namespace attn::client {
namespace internal {
struct Endpoint;
}  // namespace internal

// The shape of a session's cache; see CreateSessionRequest.
struct SessionSpec {
  int32_t num_layers = 1;
  int32_t num_kv_heads = 1;
  int32_t head_dim = 128;
  DType dtype = DType::kBFloat16;  // kFloat16 or kBFloat16
  int64_t max_tokens = 0;          // 0: the server's limit
  // An FP8 cache: DType::kFloat8E4M3 with num_kv_heads scales each for keys and values (the
  // server quantizes each step's k_new/v_new with them: E4M3(x / scale), saturating). Unset: the
  // cache holds dtype.
  std::optional<DType> cache_dtype;
  std::vector<float> k_scales, v_scales;
};

// A session as CreateSession or ForkSession returned it. page_tokens, ttl_seconds and max_tokens
// are 0 for a fork (ForkSessionResponse does not carry them; they are the parent's).
struct SessionInfo {
  std::string session_id;
  std::string replica_id;
  int32_t page_tokens = 0;
  int64_t ttl_seconds = 0;
  int64_t max_tokens = 0;
  // The cache's element type (kFloat8E4M3 for an FP8 cache); unset for a fork.
  std::optional<DType> cache_dtype;
  // The address the session's calls go to ("ipv4:10.0.0.5:50051", or the target as given).
  std::string endpoint;
};

struct StepOptions {
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  bool return_lse = false;
  // Sliding window over the whole cache (as AttendOptions); both -1: none.
  int32_t window_left = -1;
  int32_t window_right = -1;
};

// One step of one layer: q [tokens, num_heads, head_dim], k_new and v_new
// [tokens, num_kv_heads, head_dim], all in the session's dtype (tokens: those it appends).
struct StepInput {
  std::string session_id;
  int32_t layer = 0;
  Tensor q, k_new, v_new;
  StepOptions options;
  // FP8 k_new/v_new (E4M3 codes, for a session with an FP8 cache): the session's k_scales and
  // v_scales, which the server checks they were quantized with.
  std::vector<float> k_new_scales, v_new_scales;
};

struct StepResult {
  Tensor o;                   // [tokens, num_heads, head_dim], dtype of q
  std::optional<Tensor> lse;  // float32 [num_heads, tokens], when asked for
  int64_t cached_tokens = 0;  // tokens in the layer's cache after the step
  v1::ServerTiming timing;
};

struct TruncateResult {
  std::vector<int64_t> cached_tokens;  // per layer, after truncation
  int64_t freed_pages = 0;
};

// Deadline of the session calls that take none of their own.
inline constexpr std::chrono::milliseconds kDefaultSessionTimeout{60000};

// --- messages, for callers that drive the stubs themselves -------------------------------------
v1::CreateSessionRequest BuildCreateSessionRequest(const SessionSpec& spec);
v1::StepRequest BuildStepRequest(const StepInput& in);
absl::StatusOr<StepResult> ParseStepResponse(const v1::StepResponse& response);
// A BatchStep item's outcome: its own status, or its result.
absl::StatusOr<StepResult> ParseStepResult(const v1::StepResult& item);

// --- one endpoint -------------------------------------------------------------------------------
absl::StatusOr<SessionInfo> CreateSession(Client& client, const SessionSpec& spec,
                                          std::chrono::milliseconds timeout = kDefaultSessionTimeout);
absl::StatusOr<StepResult> Step(Client& client, const StepInput& in,
                                std::chrono::milliseconds timeout = kDefaultSessionTimeout);
// The outer status is the RPC's; each item then has its own. Items whose tensors pass half of
// the client's max_message_bytes go in several calls, in order; then a call that fails fails its
// own items (each gets its status) and the outer status is OK.
absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> BatchStep(
    Client& client, const std::vector<StepInput>& items,
    std::chrono::milliseconds timeout = kDefaultSessionTimeout);
absl::StatusOr<TruncateResult> TruncateSession(Client& client, const std::string& session_id,
                                               int64_t tokens,
                                               std::chrono::milliseconds timeout = kDefaultSessionTimeout);
absl::StatusOr<SessionInfo> ForkSession(Client& client, const std::string& session_id,
                                        std::chrono::milliseconds timeout = kDefaultSessionTimeout);
// The KV pages the close freed.
absl::StatusOr<int64_t> CloseSession(Client& client, const std::string& session_id,
                                     std::chrono::milliseconds timeout = kDefaultSessionTimeout);

// --- endpoints ----------------------------------------------------------------------------------
// The addresses a gRPC target stands for, one channel target each:
//   "host:port", "dns:///host:port"  -> every address the name resolves to now
//                                       ("ipv4:10.0.0.5:50051", "ipv6:[fd00::5]:50051")
//   "ipv4:a:p,b:p", "ipv6:[a]:p,..." -> each address of the list
//   "unix:/path", other schemes      -> the target itself
// INVALID_ARGUMENT for a target without a port, UNAVAILABLE when a name does not resolve.
absl::StatusOr<std::vector<std::string>> ResolveTarget(const std::string& target);

struct SessionClientOptions {
  // Connection settings of every endpoint; client.target is the first target.
  ClientOptions client;
  // More targets (each resolved as client.target is); an empty client.target may then be left
  // empty.
  std::vector<std::string> more_targets;
  // Deadline of the GetServerInfo calls that find the replicas and their free pages.
  std::chrono::milliseconds info_timeout{3000};
  // The targets are resolved again (new pods picked up, gone ones dropped) before a CreateSession
  // when the last resolution is older than this; also at once when a session id names a replica
  // not known, at most once per min_refresh_interval.
  std::chrono::milliseconds refresh_interval{30000};
  std::chrono::milliseconds min_refresh_interval{1000};
};

// A replica as last seen: its id, its address, and what its GetServerInfo said.
struct ReplicaInfo {
  std::string replica_id;
  std::string endpoint;
  int64_t free_pages = 0;
  int64_t total_pages = 0;
  int64_t sessions = 0;
};

// Thread-safe: calls on any sessions may come from many threads.
class SessionClient {
 public:
  // Resolves the targets and asks every address for its replica id. Fails (UNAVAILABLE, with each
  // endpoint's error) only when no endpoint answers.
  static absl::StatusOr<std::unique_ptr<SessionClient>> Create(const SessionClientOptions& options);

  // On the replica with the most free KV pages now (asked at this moment; ties go round in turn).
  // A replica that answers RESOURCE_EXHAUSTED (max sessions) or UNAVAILABLE is passed over for
  // the next one; the error of the last one tried comes back when none accepts.
  absl::StatusOr<SessionInfo> CreateSession(const SessionSpec& spec,
                                            std::chrono::milliseconds timeout = kDefaultSessionTimeout);
  absl::StatusOr<StepResult> Step(const StepInput& in,
                                  std::chrono::milliseconds timeout = kDefaultSessionTimeout);
  // Items of several replicas go out as one BatchStep per replica, in parallel; results come back
  // in the order of items. An item whose replica is unknown gets NOT_FOUND, the items of a
  // replica whose call failed get that call's status. The outer status fails only when no item
  // reached a server (then it is the first call's error, or the routing error).
  absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> BatchStep(
      const std::vector<StepInput>& items, std::chrono::milliseconds timeout = kDefaultSessionTimeout);
  absl::StatusOr<TruncateResult> TruncateSession(const std::string& session_id, int64_t tokens,
                                                 std::chrono::milliseconds timeout = kDefaultSessionTimeout);
  absl::StatusOr<SessionInfo> ForkSession(const std::string& session_id,
                                          std::chrono::milliseconds timeout = kDefaultSessionTimeout);
  absl::StatusOr<int64_t> CloseSession(const std::string& session_id,
                                       std::chrono::milliseconds timeout = kDefaultSessionTimeout);

  // The id session_id goes by now: itself, or the id it was given where it moved to.
  std::string CurrentSessionId(const std::string& session_id) const;

  // The client of the replica that holds session_id (NOT_FOUND when none of the endpoints is
  // that replica, after resolving the targets again). For driving the stubs directly.
  absl::StatusOr<std::shared_ptr<Client>> ClientFor(const std::string& session_id);
  // The client of a replica by its id (nullptr when unknown): to send a call to a chosen replica.
  std::shared_ptr<Client> ClientForReplica(const std::string& replica_id) const;
  // The replicas as last resolved and asked, in the order of their endpoints.
  std::vector<ReplicaInfo> Replicas() const;
  // Resolves the targets again and asks each address for its replica id. Clients of addresses
  // already known are kept (their connections too).
  absl::Status Refresh();

 private:
  struct Replica {
    ReplicaInfo info;
    std::shared_ptr<Client> client;
  };
  // A replica as a place for a new session.
  struct Candidate {
    std::shared_ptr<Replica> replica;
    std::string name;  // "<replica_id> at <endpoint>", for messages
    bool answered;     // its GetServerInfo did
    int64_t free_pages, sessions;
    size_t rank;  // its turn among equals (round-robin over creates)
  };
  // The replicas in the order a CreateSession tries them: those that answer, most free pages
  // first, then fewest sessions, then in turn.
  std::vector<Candidate> RankForCreate();
  explicit SessionClient(SessionClientOptions options);
  // A client of one address with this client's settings.
  absl::StatusOr<std::shared_ptr<Client>> ClientOf(const internal::Endpoint& e) const;
  // The replica whose id, followed by '.', starts session_id (the longest such id).
  std::shared_ptr<Replica> FindReplica(const std::string& session_id) const;
  absl::StatusOr<std::shared_ptr<Replica>> Route(const std::string& session_id);
  // Refresh() when the last one is older than `age`.
  void RefreshIfOlder(std::chrono::milliseconds age);
  absl::Status NoReplicaError(const std::string& session_id) const;
  // When st says that session id moved: remembers where (and the replica there, a client of
  // its address made if needed) and returns true.
  bool LearnMove(const std::string& id, const absl::Status& st);
  // The session's replica cannot be reached (or is no longer known): asks the other replicas
  // (the targets resolved again) whether one took it in a hand-off (the session's old id there
  // answers with its new one) and learns the move; false when none did.
  bool FindMoved(const std::string& id, const std::shared_ptr<Replica>& unreached,
                 std::chrono::steady_clock::time_point deadline);
  // Runs call(current id, client of its replica) on the session, following a move (twice at
  // most; also one found by asking the other replicas when its replica cannot be reached) and
  // sending again a call refused while the session moves, until timeout.
  template <typename Result, typename Call>
  absl::StatusOr<Result> OnSession(const std::string& session_id, std::chrono::milliseconds timeout,
                                   const Call& call);

  const SessionClientOptions options_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Replica>> replicas_;      // guarded by mu_
  std::chrono::steady_clock::time_point refreshed_at_;  // guarded by mu_
  uint64_t create_turn_ = 0;                            // guarded by mu_
  std::map<std::string, std::string> moved_;           // old id -> new id; guarded by mu_
  // Replicas learned from moves that the targets did not name (kept across refreshes, which
  // only replace replicas_); guarded by mu_.
  std::vector<std::shared_ptr<Replica>> followed_;
  std::mutex refresh_mu_;  // one Refresh at a time (held without mu_ while it calls out)
};

}  // namespace attn::client
