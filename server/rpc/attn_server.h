// attnd assembled: backend, metrics, batcher, service, gRPC server with health and reflection.
// Owns all of them; tests create one in-process on port 0.
#pragma once

#include <grpcpp/server.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "rpc/server_options.h"

namespace attn {

class Backend;
struct BackendInfo;
class StepDevice;
class StepPipeline;
class Batcher;
class Metrics;
class AttentionService;
class Authenticator;
class KvPagePool;
class SessionManager;
class RegionRegistry;
class RegionSocket;
class RegionService;
class SessionHandoff;

class AttnServer {
 public:
  static absl::StatusOr<std::unique_ptr<AttnServer>> Create(const ServerOptions& options);
  ~AttnServer();

  int port() const { return port_; }
  int metrics_port() const;
  // Attend calls plus in-flight AttendStream items counted against --max_pending_per_client.
  int64_t PendingPerClientTotal() const;
  const Backend& backend() const { return *backend_; }
  // The step pipeline of sessions (null when the backend has no KV region).
  StepPipeline* step_pipeline() const { return step_pipeline_.get(); }
  // The sessions and their page pool (null when the backend has no KV region).
  SessionManager* sessions() const { return sessions_.get(); }
  KvPagePool* kv_pool() const { return kv_pool_.get(); }
  // Shared-memory regions registered now, over all clients (0 when shared memory is off).
  int64_t SharedMemoryRegions() const;

  // Health goes NOT_SERVING and new calls get UNAVAILABLE until the server is quiet (at most
  // drain_grace_s), queued and running requests finish, then the gRPC server shuts down (calls
  // still open after drain_timeout are cancelled).
  void Drain();
  // Blocks until the gRPC server has shut down.
  void Wait();
  // A second signal during the drain: the session hand-off stops after the session in flight
  // (moved, or left whole here); returns once it has. At once when there is no hand-off.
  void StopHandoff();

 private:
  AttnServer() = default;
  absl::Status WarmUp();
  absl::Status CreateSessions(const BackendInfo& info);
  absl::Status StartSharedMemory();
  absl::Status CreateHandoff();
  void HandOffSessions();
  void WaitUntilQuiet();
  void MonitorBackendLoop();

  ServerOptions options_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<StepDevice> step_device_;  // null: no sessions; uses backend_
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Authenticator> authenticator_;  // null: no bearer tokens
  std::unique_ptr<KvPagePool> kv_pool_;
  std::unique_ptr<SessionManager> sessions_;  // borrows kv_pool_ and metrics_
  std::unique_ptr<StepPipeline> step_pipeline_;  // borrows step_device_
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<SessionHandoff> handoff_;  // null: no --handoff_peers; borrows sessions_
  // Shared memory: null unless --allow_shared_memory (the service answers FAILED_PRECONDITION).
  std::unique_ptr<RegionRegistry> regions_;
  std::unique_ptr<RegionSocket> region_socket_;
  std::unique_ptr<RegionService> region_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::mutex monitor_mu_;
  std::condition_variable monitor_cv_;
  bool stopping_ = false;
  std::thread monitor_;
};

// The backend that options.backend names ("auto" prefers CUDA when a GPU is usable) and its step
// device (null when it has no room for a KV region: sessions are then off). The step device
// must be destroyed before the backend.
struct Backends {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<StepDevice> steps;
};
absl::StatusOr<Backends> CreateBackends(const ServerOptions& options);

}  // namespace attn
