#include "observability/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cmath>
#include <exception>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace attn {
namespace {

// base * factor^i for i in [0, n).
prometheus::Histogram::BucketBoundaries Exponential(double base, double factor, int n) {
  prometheus::Histogram::BucketBoundaries b;
  double v = base;
  for (int i = 0; i < n; ++i, v *= factor) b.push_back(v);
  return b;
}

// 10 us .. ~42 s, doubling: suits a small decode step and a long prefill alike.
prometheus::Histogram::BucketBoundaries LatencyBuckets() { return Exponential(10e-6, 2.0, 23); }
// Parts of a step: from a microsecond (a lone step's enqueue) to about a second.
prometheus::Histogram::BucketBoundaries PhaseBuckets() { return Exponential(1e-6, 2.0, 21); }

}  // namespace

const char* RpcName(Rpc rpc) {
  switch (rpc) {
    case Rpc::kAttend: return "Attend";
    case Rpc::kAttendStream: return "AttendStream";
    case Rpc::kCreateSession: return "CreateSession";
    case Rpc::kStep: return "Step";
    case Rpc::kBatchStep: return "BatchStep";
    case Rpc::kCloseSession: return "CloseSession";
    case Rpc::kTruncateSession: return "TruncateSession";
    case Rpc::kForkSession: return "ForkSession";
    case Rpc::kGetServerInfo: return "GetServerInfo";
    case Rpc::kEcho: return "Echo";
    case Rpc::kImportSession: return "ImportSession";
    case Rpc::kCount: break;
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const Options& options) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->Build(options);
  if (!options.listen.empty()) {
    try {
      m->exposer_ = std::make_unique<prometheus::Exposer>(options.listen);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve metrics on ", options.listen, ": ", e.what()));
    }
    m->exposer_->RegisterCollectable(m->registry_);
    const auto ports = m->exposer_->GetListeningPorts();
    if (!ports.empty()) m->port_ = ports.front();
  }
  return m;
}

Metrics::~Metrics() = default;

Metrics::PoolGauges Metrics::BuildPool(const std::string& name, const std::string& help) {
  auto& fam = prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  return {&fam.Add({{"state", "used"}}), &fam.Add({{"state", "reserved"}}),
          &fam.Add({{"state", "limit"}})};
}

void Metrics::Build(const Options& o) {
  registry_ = std::make_shared<prometheus::Registry>();
  auto& r = *registry_;
  requests_family_ = &prometheus::BuildCounter()
                          .Name("attn_requests_total")
                          .Help("RPCs finished, by method and gRPC status code")
                          .Register(r);
  stream_items_family_ = &prometheus::BuildCounter()
                             .Name("attn_stream_items_total")
                             .Help("AttendStream items answered, by each item's gRPC status code")
                             .Register(r);
  auto& duration = prometheus::BuildHistogram()
                       .Name("attn_request_duration_seconds")
                       .Help("Server-side RPC latency, from arrival to response ready")
                       .Register(r);
  auto& received = prometheus::BuildCounter()
                       .Name("attn_received_bytes_total")
                       .Help("Request message bytes received")
                       .Register(r);
  auto& sent = prometheus::BuildCounter()
                   .Name("attn_sent_bytes_total")
                   .Help("Response message bytes sent")
                   .Register(r);
  for (int i = 0; i < static_cast<int>(Rpc::kCount); ++i) {
    const std::string name = RpcName(static_cast<Rpc>(i));
    rpcs_[i].duration = &duration.Add({{"rpc", name}}, LatencyBuckets());
    rpcs_[i].received = &received.Add({{"rpc", name}});
    rpcs_[i].sent = &sent.Add({{"rpc", name}});
  }
  auto hist = [&](const char* name, const char* help, prometheus::Histogram::BucketBoundaries b) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add({}, std::move(b));
  };
  queue_ = hist("attn_queue_duration_seconds", "Time a request waited in the batcher's queue",
                LatencyBuckets());
  compute_ = hist("attn_compute_duration_seconds", "Kernel time of one batch", LatencyBuckets());
  transfer_ = hist("attn_transfer_duration_seconds",
                   "Host-device copy time of one batch (GPU backend)", LatencyBuckets());
  batch_requests_ = hist("attn_batch_requests", "Requests packed into one batch",
                         Exponential(1, 2, 11));
  batch_tokens_ = hist("attn_batch_tokens", "Query tokens packed into one batch",
                       Exponential(16, 2, 17));
  bandwidth_ = hist("attn_kernel_memory_bandwidth_bytes_per_second",
                    "Achieved kernel memory bandwidth per launch (q, k, v read, o written)",
                    Exponential(1e9, 2, 14));
  flops_ = hist("attn_kernel_flops_per_second", "Achieved kernel FLOP/s per launch",
                Exponential(1e9, 2, 21));
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
  };
  pending_ = gauge("attn_pending_requests", "Requests queued or running");
  max_queue_size_ = gauge("attn_max_queue_size", "Configured bound of the request queue");
  device_pool_ = BuildPool("attn_device_pool_bytes", "Device memory pool bytes");
  pinned_pool_ = BuildPool("attn_pinned_pool_bytes", "Pinned host buffer pool bytes");
  auto& kv = prometheus::BuildGauge()
                 .Name("attn_kv_cache_pages")
                 .Help("Paged KV cache pages")
                 .Register(r);
  kv_used_ = &kv.Add({{"state", "used"}});
  kv_free_ = &kv.Add({{"state", "free"}});
  kv_usage_ = gauge("attn_kv_cache_usage_ratio",
                    "Used pages of the paged KV cache over its total pages (0 to 1)");
  sessions_ = gauge("attn_sessions", "Open KV-cache sessions");
  evictions_ttl_ = &prometheus::BuildCounter()
                        .Name("attn_session_evictions_total")
                        .Help("Sessions closed by the server, by reason (ttl: idle past "
                              "--session_ttl_s)")
                        .Register(r)
                        .Add({{"reason", "ttl"}});
  kv_fp8_saturations_ =
      &prometheus::BuildCounter()
           .Name("attn_kv_fp8_saturations_total")
           .Help("Elements of 16-bit k_new/v_new that saturated to +-448 when quantized into "
                 "an FP8 session cache (x / scale beyond the E4M3 range)")
           .Register(r)
           .Add({});
  handoffs_family_ = &prometheus::BuildCounter()
                          .Name("attn_session_handoffs_total")
                          .Help("Sessions a draining replica tried to move to a peer "
                                "(--handoff_peers), by result: moved, or why not")
                          .Register(r);
  handoff_bytes_ = &prometheus::BuildCounter()
                        .Name("attn_session_handoff_bytes_total")
                        .Help("KV bytes (keys and values) moved to peers on drain")
                        .Register(r)
                        .Add({});
  step_tokens_ = hist("attn_step_tokens_per_launch",
                      "New (query) tokens of the session steps computed in one launch",
                      Exponential(1, 2, 15));
  auto& phases = prometheus::BuildHistogram()
                     .Name("attn_step_phase_duration_seconds")
                     .Help("Host time of a session step's parts: per Step/BatchStep call, its "
                           "request decoded and its jobs made (decode), its answer encoded "
                           "(answer) and handed to gRPC (send: off gRPC's threads this writes "
                           "the answer to the socket); per launch, its planning and staging "
                           "(stage), its copies and kernels enqueued (enqueue), the wait for the "
                           "device (wait), its appends committed and callers told (finish, "
                           "which holds the answer and send of the calls it completes)")
                     .Register(r);
  const char* phase_names[] = {"decode", "stage", "enqueue", "wait", "finish", "answer",
                               "send"};
  static_assert(std::size(phase_names) == static_cast<size_t>(StepPhase::kCount));
  for (size_t i = 0; i < step_phases_.size(); ++i) {
    step_phases_[i] = &phases.Add({{"phase", phase_names[i]}}, PhaseBuckets());
  }
  decode_bandwidth_ = hist("attn_decode_bandwidth_bytes_per_second",
                           "K and V bytes read from the KV cache per decode launch over its "
                           "kernel time",
                           Exponential(1e9, 2, 14));
  auto& gpu = prometheus::BuildGauge()
                  .Name("attn_gpu_memory_bytes")
                  .Help("GPU memory as the driver reports it")
                  .Register(r);
  gpu_used_ = &gpu.Add({{"state", "used"}});
  gpu_free_ = &gpu.Add({{"state", "free"}});
  gpu_total_ = &gpu.Add({{"state", "total"}});
  auto& shm_regions = prometheus::BuildGauge()
                          .Name("attn_shared_memory_regions")
                          .Help("Shared-memory regions registered, by kind (host, cuda)")
                          .Register(r);
  shm_host_regions_ = &shm_regions.Add({{"kind", "host"}});
  shm_cuda_regions_ = &shm_regions.Add({{"kind", "cuda"}});
  auto& shm_bytes = prometheus::BuildGauge()
                        .Name("attn_shared_memory_region_bytes")
                        .Help("Bytes of the shared-memory regions registered, by kind (host, cuda)")
                        .Register(r);
  shm_host_bytes_ = &shm_bytes.Add({{"kind", "host"}});
  shm_cuda_bytes_ = &shm_bytes.Add({{"kind", "cuda"}});
  auto& shm_tensors = prometheus::BuildCounter()
                          .Name("attn_shared_memory_tensor_bytes_total")
                          .Help("Tensor bytes completed requests read from (read) or wrote into "
                                "(written) shared-memory regions instead of their messages")
                          .Register(r);
  shm_read_ = &shm_tensors.Add({{"direction", "read"}});
  shm_written_ = &shm_tensors.Add({{"direction", "written"}});
  shm_registered_bytes_ = &prometheus::BuildGauge()
                               .Name("attn_shared_memory_registered_bytes")
                               .Help("Bytes of host regions registered with the GPU (page-locked) "
                                     "for direct transfers, without staging")
                               .Register(r)
                               .Add({});
  auto& shm_fallbacks = prometheus::BuildCounter()
                            .Name("attn_shared_memory_registration_fallbacks_total")
                            .Help("Host regions left unregistered with the GPU, so served through "
                                  "staging, by reason (limit: --shm_max_registered_bytes; error: "
                                  "the driver refused)")
                            .Register(r);
  shm_fallback_limit_ = &shm_fallbacks.Add({{"reason", "limit"}});
  shm_fallback_error_ = &shm_fallbacks.Add({{"reason", "error"}});
  prometheus::BuildGauge()
      .Name("attn_build_info")
      .Help("attnd version, backend and device; always 1")
      .Register(r)
      .Add({{"version", o.version}, {"backend", o.backend}, {"device", o.device}})
      .Set(1);
}

void Metrics::ObserveRequest(Rpc rpc, absl::StatusCode code, double seconds,
                             int64_t received_bytes, int64_t sent_bytes) {
  PerRpc& p = rpcs_[static_cast<int>(rpc)];
  const int c = static_cast<int>(code);
  if (c >= 0 && c < kNumCodes) {
    prometheus::Counter* counter = p.requests[c].load(std::memory_order_acquire);
    if (counter == nullptr) {
      // Family::Add returns the same series for the same labels, so a race here is harmless.
      counter = &requests_family_->Add({{"rpc", RpcName(rpc)}, {"code", StatusCodeName(code)}});
      p.requests[c].store(counter, std::memory_order_release);
    }
    counter->Increment();
  }
  p.duration->Observe(seconds);
  if (received_bytes > 0) p.received->Increment(static_cast<double>(received_bytes));
  if (sent_bytes > 0) p.sent->Increment(static_cast<double>(sent_bytes));
}

void Metrics::ObserveStreamItem(absl::StatusCode code) {
  const int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) return;
  prometheus::Counter* counter = stream_items_[c].load(std::memory_order_acquire);
  if (counter == nullptr) {
    counter = &stream_items_family_->Add({{"code", StatusCodeName(code)}});
    stream_items_[c].store(counter, std::memory_order_release);
  }
  counter->Increment();
}

void Metrics::ObserveQueueSeconds(double seconds) { queue_->Observe(seconds); }

void Metrics::ObserveStepPhase(StepPhase phase, double seconds) {
  step_phases_[static_cast<size_t>(phase)]->Observe(seconds);
}

void Metrics::ObserveBatch(const BatchReport& report) {
  if (report.requests == 0) return;
  if (report.kv_fp8_saturations > 0) {
    kv_fp8_saturations_->Increment(static_cast<double>(report.kv_fp8_saturations));
  }
  if (report.step_launches > 0) {
    step_tokens_->Observe(static_cast<double>(report.tokens) / report.step_launches);
    ObserveStepPhase(StepPhase::kStage, report.stage_seconds);
    ObserveStepPhase(StepPhase::kEnqueue, report.enqueue_seconds);
    ObserveStepPhase(StepPhase::kWait, report.wait_seconds);
    ObserveStepPhase(StepPhase::kFinish, report.finish_seconds);
    if (report.decode && report.compute_seconds > 0 && report.kv_bytes_read > 0) {
      decode_bandwidth_->Observe(report.kv_bytes_read / report.compute_seconds);
    }
  }
  batch_requests_->Observe(report.requests);
  batch_tokens_->Observe(static_cast<double>(report.tokens));
  compute_->Observe(report.compute_seconds);
  if (report.transfer_seconds > 0) transfer_->Observe(report.transfer_seconds);
  if (report.compute_seconds > 0 && report.flops > 0) {
    flops_->Observe(report.flops / report.compute_seconds);
    bandwidth_->Observe(report.bytes / report.compute_seconds);
  }
}

void Metrics::SetPendingRequests(int64_t n) { pending_->Set(static_cast<double>(n)); }
void Metrics::SetMaxQueueSize(int64_t n) { max_queue_size_->Set(static_cast<double>(n)); }

void Metrics::SetDevicePool(const MemoryBytes& b) {
  device_pool_.used->Set(b.used);
  device_pool_.reserved->Set(b.reserved);
  device_pool_.limit->Set(b.limit);
}

void Metrics::SetPinnedPool(const MemoryBytes& b) {
  pinned_pool_.used->Set(b.used);
  pinned_pool_.reserved->Set(b.reserved);
  pinned_pool_.limit->Set(b.limit);
}

void Metrics::SetKvCachePages(int64_t used, int64_t free) {
  kv_used_->Set(used);
  kv_free_->Set(free);
  kv_usage_->Set(used + free > 0 ? static_cast<double>(used) / (used + free) : 0.0);
}

void Metrics::AddSessionEvictions(const char* reason, int64_t n) {
  if (std::string(reason) == "ttl") evictions_ttl_->Increment(static_cast<double>(n));
}

void Metrics::AddSessionHandoff(const std::string& result) {
  handoffs_family_->Add({{"result", result}}).Increment();
}

void Metrics::AddSessionHandoffBytes(int64_t bytes) {
  handoff_bytes_->Increment(static_cast<double>(bytes));
}

void Metrics::SetSessions(int64_t n) { sessions_->Set(static_cast<double>(n)); }

void Metrics::SetSharedMemoryRegions(const RegionTotals& t) {
  shm_host_regions_->Set(static_cast<double>(t.host_regions));
  shm_host_bytes_->Set(static_cast<double>(t.host_bytes));
  shm_cuda_regions_->Set(static_cast<double>(t.cuda_regions));
  shm_cuda_bytes_->Set(static_cast<double>(t.cuda_bytes));
}

void Metrics::AddSharedMemoryTensorBytes(int64_t read, int64_t written) {
  if (read > 0) shm_read_->Increment(static_cast<double>(read));
  if (written > 0) shm_written_->Increment(static_cast<double>(written));
}

void Metrics::AddSharedMemoryRegisteredBytes(int64_t delta) {
  if (delta >= 0) {
    shm_registered_bytes_->Increment(static_cast<double>(delta));
  } else {
    shm_registered_bytes_->Decrement(static_cast<double>(-delta));
  }
}

void Metrics::AddSharedMemoryRegistrationFallback(const char* reason) {
  (std::string(reason) == "limit" ? shm_fallback_limit_ : shm_fallback_error_)->Increment();
}

void Metrics::SetGpuMemory(int64_t used, int64_t free, int64_t total) {
  gpu_used_->Set(used);
  gpu_free_->Set(free);
  gpu_total_->Set(total);
}

}  // namespace attn
