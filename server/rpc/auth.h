// Security of attnd: TLS server credentials, bearer-token authentication and the per-client
// limit on pending requests. No gRPC interceptors: the service calls these at the start of each
// handler, so that grpc.health.v1 and reflection stay open.
#pragma once

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rpc/server_options.h"

namespace attn {

// Reads a whole file; NOT_FOUND/PERMISSION_DENIED-like errors name `what` (the flag) and path.
absl::StatusOr<std::string> ReadSecretFile(const std::string& what, const std::string& path);

// The gRPC credentials options asks for: insecure when tls_cert/tls_key are empty, TLS with
// them, and mTLS (client certificate required and verified) when tls_client_ca is set too.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerOptions& options);

// Accepted bearer tokens. Thread-safe (immutable after creation).
class Authenticator {
 public:
  // One token per line; blank lines and lines starting with '#' are ignored; surrounding
  // whitespace is trimmed. A file with no token is an error.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromTokens(std::vector<std::string> tokens);

  // Checks an "authorization" metadata value ("Bearer <token>"). Returns the caller's identity
  // ("token:<index in the file>", never the token itself) or UNAUTHENTICATED.
  absl::StatusOr<std::string> Check(std::string_view authorization) const;
  // Same, on the call's metadata (a missing header is UNAUTHENTICATED).
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& ctx) const;

  size_t size() const { return tokens_.size(); }
  // The token of an identity Check returned ("token:<i>"), for calls this replica makes on a
  // session owner's behalf (hand-off to a peer); NOT_FOUND for any other string.
  absl::StatusOr<std::string> TokenOf(const std::string& identity) const;

 private:
  explicit Authenticator(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {}
  std::vector<std::string> tokens_;
};

// "ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1", "ipv6:[::1]:5555" -> "ipv6:[::1]"; other forms
// (unix sockets) are returned unchanged.
std::string PeerHost(const std::string& peer);

// Counts pending requests per client identity and refuses one over the limit.
class PendingLimiter {
 public:
  // A slot held by one request; released at the latest when destroyed, and exactly once.
  class Slot {
   public:
    Slot(PendingLimiter* limiter, std::string key) : limiter_(limiter), key_(std::move(key)) {}
    ~Slot() { Release(); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    void Release() {
      if (limiter_ != nullptr && !released_.exchange(true)) limiter_->Release(key_);
    }

   private:
    PendingLimiter* const limiter_;
    const std::string key_;
    std::atomic<bool> released_{false};
  };

  explicit PendingLimiter(int64_t max_per_client) : max_(max_per_client) {}

  // A slot for key, or RESOURCE_EXHAUSTED when key already holds max_per_client (0: no limit;
  // a null-limiter slot is returned then so that callers need no special case).
  absl::StatusOr<std::shared_ptr<Slot>> Acquire(const std::string& key);

  int64_t Pending(const std::string& key) const;
  int64_t TotalPending() const;

 private:
  void Release(const std::string& key);

  const int64_t max_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, int64_t> pending_;
  int64_t total_ = 0;
};

}  // namespace attn
