// Hand-off on drain: moves each open session of this replica to a peer (--handoff_peers) with
// the peers' ImportSession (attention.proto), one fork family at a time (a session alone, or
// sessions that share pages: one stream, each shared page sent once), one page in flight (the
// streaming write returns once gRPC's flow control takes the page). A family is frozen for its
// move (Session::Freeze) and marked moved only once the peer answered OK; any failure (the peer
// full, refusing, gone, a checksum) leaves it whole here, and the next peer is tried. A peer that
// refuses a family's second header (one that predates fork families) gets its sessions one per
// stream.
//
// Who may move: each transfer carries the session owner's bearer token (this replica's token
// file has it), so the peer gives the session to the same identity; without tokens, none.
//
// Ownership: borrows the session manager, authenticator and metrics, which must outlive it;
// owns its channels to the peers.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/v1/attention.grpc.pb.h"
#include "sessions/session.h"
#include "sessions/step_device.h"

namespace attn {

class Authenticator;
class Metrics;
class SessionManager;

class SessionHandoff {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    // host:port, or dns:///name:port for every address the name resolves to at the drain (a
    // headless Service; this replica among them refuses, as it drains); tried in turn.
    std::vector<std::string> peers;
    std::shared_ptr<grpc::ChannelCredentials> credentials;  // insecure when null
    std::string tls_server_name;  // overrides the name checked in the peers' certificates
    int64_t max_message_bytes = 256ll << 20;
    KvRegion kv_region;
    // The step device whose copies reach kv_region (null: host memory, memcpy). Must outlive
    // MoveAll.
    const StepDevice* kv_device = nullptr;
  };
  static absl::StatusOr<std::unique_ptr<SessionHandoff>> Create(Options options,
                                                                SessionManager* sessions,
                                                                const Authenticator* authenticator,
                                                                Metrics* metrics);

  struct Summary {
    int64_t moved = 0;
    int64_t not_moved = 0;
    int64_t bytes = 0;
  };
  // Moves every open session it can before deadline (the caller has stopped new sessions,
  // SessionManager::StopCreating). Logs and counts (attn_session_handoffs_total) each session
  // not moved, with why.
  Summary MoveAll(Clock::time_point deadline);
  // Ends MoveAll after the session in flight (moved or left whole) and returns once it has.
  void Stop();

 private:
  SessionHandoff(Options options, SessionManager* sessions, const Authenticator* authenticator,
                 Metrics* metrics);
  // options_.peers with dns:/// names resolved to their addresses now.
  std::vector<std::string> ResolvePeers() const;
  void Connect(const std::vector<std::string>& peers);  // stubs_, one per address
  // The sessions' new ids on peer p (in their order), sent in one stream, or why not; nothing
  // changes here.
  absl::StatusOr<std::vector<std::string>> SendTo(
      size_t p, const std::vector<std::shared_ptr<Session>>& sessions, Clock::time_point deadline,
      int64_t* bytes);
  // Moves one frozen, settled family to the first peer that takes it: each session's new id and
  // address ("" where none did), *last the last failure.
  struct Moved {
    std::string address, new_id;
  };
  std::vector<Moved> MoveFamily(const std::vector<std::shared_ptr<Session>>& family,
                                const std::vector<std::string>& peers, Clock::time_point deadline,
                                size_t* turn, int64_t* bytes, absl::Status* last);
  // The moved or not-moved outcome of one session, logged and counted.
  void Record(const std::string& id, const std::string& result, const std::string& why);

  const Options options_;
  SessionManager* const sessions_;
  const Authenticator* const authenticator_;
  Metrics* const metrics_;
  std::vector<std::unique_ptr<v1::Attention::Stub>> stubs_;  // one per peer; MoveAll's
  std::atomic<bool> stop_{false};
  std::mutex running_mu_;  // held by MoveAll
};

// The result label of attn_session_handoffs_total for a failed move's status.
const char* HandoffResultOf(const absl::Status& st);

}  // namespace attn
