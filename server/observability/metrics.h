// Prometheus metrics of attnd. The only file pair that includes prometheus-cpp. Families are
// built once at start-up; label values are bound once (lazily for rpc x code).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "memory/memory_bytes.h"
#include "observability/batch_report.h"

namespace prometheus {
class Registry;
class Exposer;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace attn {

enum class Rpc : int {
  kAttend = 0,
  kAttendStream,
  kCreateSession,
  kStep,
  kBatchStep,
  kCloseSession,
  kTruncateSession,
  kForkSession,
  kGetServerInfo,
  kEcho,
  kImportSession,
  kCount,
};
const char* RpcName(Rpc rpc);

// Parts of a session step's way through attnd (docs/STEP_PATH.md), for
// attn_step_phase_duration_seconds{phase}: per call, its request decoded and its jobs made
// (decode), its answer encoded (answer) and handed to gRPC (send); per launch, on its lane, the
// parts of BatchReport.
enum class StepPhase { kDecode, kStage, kEnqueue, kWait, kFinish, kAnswer, kSend, kCount };

class Metrics {
 public:
  struct Options {
    std::string listen;  // host:port for /metrics; empty: not served (still recorded)
    std::string version;
    std::string backend;
    std::string device;
  };
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const Options& options);
  ~Metrics();

  // The port /metrics is served on (useful with port 0), or 0.
  int port() const { return port_; }

  void ObserveRequest(Rpc rpc, absl::StatusCode code, double seconds, int64_t received_bytes,
                      int64_t sent_bytes);
  // attn_stream_items_total{code}: one AttendStream item answered with its own status (the
  // stream itself is counted once in attn_requests_total{rpc="AttendStream"} when it ends).
  void ObserveStreamItem(absl::StatusCode code);
  void ObserveQueueSeconds(double seconds);
  void ObserveBatch(const BatchReport& report);
  void ObserveStepPhase(StepPhase phase, double seconds);
  void SetPendingRequests(int64_t n);
  void SetMaxQueueSize(int64_t n);
  void SetDevicePool(const MemoryBytes& bytes);
  void SetPinnedPool(const MemoryBytes& bytes);
  // attn_kv_cache_pages{state} and attn_kv_cache_usage_ratio (used / total).
  void SetKvCachePages(int64_t used, int64_t free);
  void SetSessions(int64_t n);
  // attn_session_evictions_total{reason}; reason is "ttl" (idle past --session_ttl_s).
  void AddSessionEvictions(const char* reason, int64_t n);
  // attn_session_handoffs_total{result}: sessions a draining replica tried to move to a peer,
  // by outcome ("moved", or why not: "refused", "peer_full", "peer_unavailable", "busy",
  // "checksum", "timeout", "error").
  void AddSessionHandoff(const std::string& result);
  // attn_session_handoff_bytes_total: KV bytes moved to peers.
  void AddSessionHandoffBytes(int64_t bytes);
  void SetGpuMemory(int64_t used, int64_t free, int64_t total);
  // attn_shared_memory_regions{kind} and attn_shared_memory_region_bytes{kind}: the regions
  // registered now and their sizes, kind "host" or "cuda".
  struct RegionTotals {
    int64_t host_regions = 0, host_bytes = 0, cuda_regions = 0, cuda_bytes = 0;
  };
  void SetSharedMemoryRegions(const RegionTotals& totals);
  // attn_shared_memory_tensor_bytes_total{direction}: tensor bytes a completed request read from
  // ("read") or wrote into ("written") regions instead of carrying them in its messages.
  void AddSharedMemoryTensorBytes(int64_t read, int64_t written);
  // attn_shared_memory_registered_bytes: host-region bytes registered with the GPU for direct
  // transfers (page-locked); delta < 0 when a registration is undone.
  void AddSharedMemoryRegisteredBytes(int64_t delta);
  // attn_shared_memory_registration_fallbacks_total{reason}: host regions left unregistered, so
  // served through staging; reason "limit" (--shm_max_registered_bytes) or "error" (the driver
  // refused).
  void AddSharedMemoryRegistrationFallback(const char* reason);

 private:
  static constexpr int kNumCodes = 17;
  struct PerRpc {
    prometheus::Histogram* duration = nullptr;
    prometheus::Counter* received = nullptr;
    prometheus::Counter* sent = nullptr;
    std::array<std::atomic<prometheus::Counter*>, kNumCodes> requests{};
  };
  struct PoolGauges {
    prometheus::Gauge* used = nullptr;
    prometheus::Gauge* reserved = nullptr;
    prometheus::Gauge* limit = nullptr;
  };

  Metrics() = default;
  void Build(const Options& options);
  PoolGauges BuildPool(const std::string& name, const std::string& help);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;

  prometheus::Family<prometheus::Counter>* requests_family_ = nullptr;
  std::array<PerRpc, static_cast<int>(Rpc::kCount)> rpcs_;
  prometheus::Family<prometheus::Counter>* stream_items_family_ = nullptr;
  std::array<std::atomic<prometheus::Counter*>, kNumCodes> stream_items_{};
  prometheus::Histogram* queue_ = nullptr;
  prometheus::Histogram* compute_ = nullptr;
  prometheus::Histogram* transfer_ = nullptr;
  prometheus::Histogram* batch_requests_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Histogram* bandwidth_ = nullptr;
  prometheus::Histogram* flops_ = nullptr;
  prometheus::Gauge* pending_ = nullptr;
  prometheus::Gauge* max_queue_size_ = nullptr;
  PoolGauges device_pool_;
  PoolGauges pinned_pool_;
  prometheus::Gauge* kv_used_ = nullptr;
  prometheus::Gauge* kv_free_ = nullptr;
  prometheus::Gauge* kv_usage_ = nullptr;
  prometheus::Counter* evictions_ttl_ = nullptr;
  prometheus::Counter* kv_fp8_saturations_ = nullptr;
  prometheus::Family<prometheus::Counter>* handoffs_family_ = nullptr;
  prometheus::Counter* handoff_bytes_ = nullptr;
  prometheus::Histogram* step_tokens_ = nullptr;
  std::array<prometheus::Histogram*, static_cast<size_t>(StepPhase::kCount)> step_phases_{};
  prometheus::Histogram* decode_bandwidth_ = nullptr;
  prometheus::Gauge* sessions_ = nullptr;
  prometheus::Gauge* gpu_used_ = nullptr;
  prometheus::Gauge* gpu_free_ = nullptr;
  prometheus::Gauge* gpu_total_ = nullptr;
  prometheus::Gauge* shm_host_regions_ = nullptr;
  prometheus::Gauge* shm_cuda_regions_ = nullptr;
  prometheus::Gauge* shm_host_bytes_ = nullptr;
  prometheus::Gauge* shm_cuda_bytes_ = nullptr;
  prometheus::Counter* shm_read_ = nullptr;
  prometheus::Counter* shm_written_ = nullptr;
  prometheus::Gauge* shm_registered_bytes_ = nullptr;
  prometheus::Counter* shm_fallback_limit_ = nullptr;
  prometheus::Counter* shm_fallback_error_ = nullptr;
};

}  // namespace attn
