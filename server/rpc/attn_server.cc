#include "rpc/attn_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <random>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/attention_service.h"
#include "rpc/auth.h"
#include "engine/batcher.h"
#include "backends/cpu_backend.h"
#include "backends/cpu_step_device.h"
#include "observability/metrics.h"
#include "common/status_util.h"
#include "common/tsan_annotations.h"
#include "engine/run_alone.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session_manager.h"
#include "sessions/step_pipeline.h"
#include "rpc/session_handoff.h"
#include "rpc/session_warmup.h"
#include "transport/region_registry.h"
#include "rpc/region_service.h"
#include "transport/region_socket.h"
#include "version.h"
#ifdef ATTN_HAVE_CUDA
#include "backends/cuda_backend.h"
#endif

namespace attn {
namespace {

constexpr char kServiceName[] = "attn.v1.Attention";

void Log(const std::string& msg) { std::cerr << "attnd: " << msg << std::endl; }

// "r" and 8 random hex digits: the replica id when --replica_id is not given.
std::string RandomReplicaId() {
  std::random_device rd;
  return absl::StrFormat("r%08x", rd());
}

}  // namespace

absl::StatusOr<Backends> CreateBackends(const ServerOptions& options) {
  const std::string& want = options.backend;
  if (want != "auto" && want != "cpu" && want != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cpu or cuda, got '", want, "'"));
  }
  if (options.fp8_attention != "auto" && options.fp8_attention != "convert" &&
      options.fp8_attention != "tensor_cores") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fp8_attention must be auto, convert or tensor_cores, got '", options.fp8_attention, "'"));
  }
  const int64_t page_bytes = options.kv_page_tokens * kReferenceKvRowBytes;
  if (want != "cpu") {
#ifdef ATTN_HAVE_CUDA
    CudaBackend::Options cuda_options;
    cuda_options.streams = options.streams;
    cuda_options.device_pool_bytes = options.device_pool_bytes;
    cuda_options.pinned_pool_bytes = options.pinned_pool_bytes;
    cuda_options.fp8_attend_tensor_cores = options.fp8_attention != "convert";
    cuda_options.fp8_step_tensor_cores = options.fp8_attention == "tensor_cores";
    auto cuda = CudaBackend::Create(cuda_options);
    if (cuda.ok()) {
      Backends b;
      CudaStepDevice::Options so;
      so.lanes = options.step_lanes > 0 ? options.step_lanes : options.streams;
      so.kv_cache_bytes = options.kv_cache_bytes;
      so.kv_page_bytes = page_bytes;
      so.append_in_kernel = options.step_append_in_kernel;
      so.output_to_host = options.step_output_to_host;
      so.fused_combine = options.step_fused_combine;
      auto steps = (*cuda)->CreateStepDevice(so);
      if (steps.ok()) {
        b.steps = std::move(*steps);
      } else if (absl::IsFailedPrecondition(steps.status())) {
        Log(absl::StrCat(steps.status().message(), "; sessions are off"));
      } else {
        return steps.status();
      }
      b.backend = std::move(*cuda);
      return b;
    }
    if (want == "cuda") return cuda.status();
    Log(absl::StrCat("no usable GPU (", cuda.status().message(), "); using the CPU backend"));
#else
    if (want == "cuda") {
      return absl::FailedPreconditionError(
          "--backend=cuda, but this attnd was built without CUDA kernels");
    }
    Log("built without CUDA kernels; using the CPU backend");
#endif
  }
  CpuBackend::Options cpu_options;
  cpu_options.threads = options.threads;
  ASSIGN_OR_RETURN(auto cpu, CpuBackend::Create(cpu_options));
  CpuStepDevice::Options so;
  if (options.kv_cache_bytes > 0) so.kv_cache_bytes = options.kv_cache_bytes;
  so.kv_page_bytes = page_bytes;
  Backends b;
  ASSIGN_OR_RETURN(b.steps, CpuStepDevice::Create(so, cpu->thread_pool()));
  b.backend = std::move(cpu);
  return b;
}

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Create(const ServerOptions& options) {
  if (options.max_message_bytes < 1024 || options.max_message_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError("--max_message_bytes must be in [1024, 2^31 - 1]");
  }
  if (options.drain_quiet_ms < 0) {
    return absl::InvalidArgumentError("--drain_quiet_ms must be >= 0");
  }
  if (options.batch_step_chunk < 0) {
    return absl::InvalidArgumentError("--batch_step_chunk must be >= 0 (0: a whole BatchStep at once)");
  }
  if (options.step_idle_poll_us < 0 || options.step_idle_poll_us > 1'000'000) {
    return absl::InvalidArgumentError("--step_idle_poll_us must be in [0, 1000000]");
  }
  if (options.step_lanes < 0 || options.step_lanes > 64) {
    return absl::InvalidArgumentError("--step_lanes must be in [0, 64] (0: as many as --streams)");
  }
  if (options.max_pending_per_client < 0) {
    return absl::InvalidArgumentError("--max_pending_per_client must be >= 0 (0: unlimited)");
  }
  std::unique_ptr<AttnServer> s(new AttnServer());
  s->options_ = options;
  // Credentials and tokens first: a bad file fails start-up before any backend work.
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   MakeServerCredentials(options));
  if (!options.auth_token_file.empty()) {
    ASSIGN_OR_RETURN(s->authenticator_, Authenticator::FromFile(options.auth_token_file));
  }
  ASSIGN_OR_RETURN(Backends backends, CreateBackends(options));
  s->backend_ = std::move(backends.backend);
  s->step_device_ = std::move(backends.steps);
  const BackendInfo& info = s->backend_->Info();
  Log(absl::StrCat("backend ", info.name, " on ", info.device_name));

  Metrics::Options mo;
  mo.listen = options.metrics_listen;
  mo.version = kVersion;
  mo.backend = info.name;
  mo.device = info.device_name;
  ASSIGN_OR_RETURN(s->metrics_, Metrics::Create(mo));
  s->metrics_->SetMaxQueueSize(options.max_queue_size);

  RETURN_IF_ERROR(s->CreateSessions(info));

  Batcher::Options bo;
  bo.max_step_delay_us = options.max_step_delay_us;
  bo.max_small_step_launches = options.max_small_step_launches;
  bo.small_step_cap_min_steps = options.small_step_cap_min_steps;
  bo.max_batch_tokens = options.max_batch_tokens;
  bo.max_queue_delay_us = options.max_queue_delay_us;
  bo.gather_when_idle = options.gather_when_idle;
  bo.max_queue_size = options.max_queue_size;
  bo.max_inflight_bytes = options.max_inflight_bytes;
  ASSIGN_OR_RETURN(s->batcher_, Batcher::Create(bo, s->backend_.get(), s->step_pipeline_.get(),
                                                s->metrics_.get()));

  AttentionService::Options so;
  so.limits.max_tensor_elements = options.max_tensor_elements;
  so.limits.max_response_bytes = options.max_message_bytes;
  so.limits.head_dims = info.head_dims;
  so.limits.fp8 = info.fp8;
  so.advertised_limits.set_max_message_bytes(options.max_message_bytes);
  so.advertised_limits.set_max_batch_tokens(options.max_batch_tokens);
  so.advertised_limits.set_max_queue_size(options.max_queue_size);
  so.advertised_limits.set_max_sessions(options.max_sessions);
  so.advertised_limits.set_max_session_tokens(options.max_session_tokens);
  so.advertised_limits.set_max_tensor_elements(options.max_tensor_elements);
  so.version = kVersion;
  so.authenticator = s->authenticator_.get();
  so.max_pending_per_client = options.max_pending_per_client;
  so.attend_wire_path = options.attend_wire_path;
  if (s->step_device_ != nullptr) {
    so.kv_region = s->step_device_->kv_region();
    so.kv_device = s->step_device_.get();
  }
  so.handoff_on_drain = !options.handoff_peers.empty() && s->sessions_ != nullptr;
  so.batch_step_chunk = options.batch_step_chunk;
  RETURN_IF_ERROR(s->StartSharedMemory());
  so.regions = s->regions_.get();
  s->service_ = std::make_unique<AttentionService>(so, s->batcher_.get(), s->backend_.get(),
                                                   s->metrics_.get(), s->sessions_.get());
  // Every method of the proto must be one of AttentionCallbackBase's: one left out would be a
  // synchronous stub that aborts when called.
  if (s->service_->has_synchronous_methods()) {
    return absl::InternalError("an attn.v1.Attention method has no callback handler "
                               "(AttentionCallbackBase in rpc/attention_service.h)");
  }

  RETURN_IF_ERROR(s->CreateHandoff());

  // Warm before the port opens: gRPC's health service reports SERVING from the moment it
  // starts, so any later warm-up would leave a window in which probes see SERVING too early.
  RETURN_IF_ERROR(s->WarmUp());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->region_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (options.tcp_read_chunk_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, options.tcp_read_chunk_bytes);
    builder.AddChannelArgument(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, options.tcp_read_chunk_bytes);
    builder.AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE,
                               std::min(options.tcp_read_chunk_bytes, (1 << 30) / 8) * 8);
  }
  // Clients may keep idle connections alive with pings every 10 s or more (the client library
  // pings every 30 s): gRPC's default policy would close a connection pinged more often than
  // every 5 minutes without data. attnd pings an idle client every 60 s, so that connections of
  // vanished clients go within a minute and a half.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  for (const auto& [name, value] : options.grpc_args) builder.AddChannelArgument(name, value);
  HandOffToGrpc(s->service_.get());  // its handlers run on gRPC's threads from now on
  HandOffToGrpc(s->region_service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  auto* health = s->server_->GetHealthCheckService();
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(true);
  s->monitor_ = std::thread([server = s.get()] { server->MonitorBackendLoop(); });
  Log(absl::StrCat(
      "security: ",
      options.tls_cert.empty()        ? "plaintext"
      : options.tls_client_ca.empty() ? "TLS"
                                      : "mTLS (client certificates required)",
      s->authenticator_ ? absl::StrCat(", bearer tokens (", s->authenticator_->size(), ")")
                        : std::string(", no bearer tokens"),
      ", max_pending_per_client ", options.max_pending_per_client));
  Log(absl::StrCat("serving attn.v1 on port ", s->port_,
                   s->metrics_->port() ? absl::StrCat(", metrics on port ", s->metrics_->port())
                                       : std::string(", metrics not served")));
  return s;
}

// The region registry and socket when shared memory is allowed; the SharedMemory service always
// (it answers FAILED_PRECONDITION when shared memory is off, so that clients learn why).
absl::Status AttnServer::StartSharedMemory() {
  std::string path;
  if (options_.allow_shared_memory) {
    if (options_.shm_max_regions_per_client < 1 || options_.shm_max_bytes_per_client < 1) {
      return absl::InvalidArgumentError(
          "--shm_max_regions_per_client and --shm_max_bytes_per_client must be >= 1");
    }
    RegionRegistry::Options ro;
    ro.max_regions_per_client = options_.shm_max_regions_per_client;
    ro.max_bytes_per_client = options_.shm_max_bytes_per_client;
    if (backend_->HasGpu()) {
      // GPU regions: imported once here, at registration, and used by every request after.
      ro.import_gpu = [backend = backend_.get()](const v1::RegisterRegionRequest& r, int vmm_fd)
          -> absl::StatusOr<std::unique_ptr<SharedRegion>> {
        ASSIGN_OR_RETURN(GpuImport g,
                         vmm_fd >= 0
                             ? backend->ImportVmmMemory(vmm_fd, r.device_id(), r.bytes())
                             : backend->ImportIpcMemory(r.cuda_ipc_handle(), r.device_id(),
                                                        r.bytes()));
        return SharedRegion::Gpu(g.data, g.bytes, std::move(g.release));
      };
      // Host regions: page-locked once here too, so that requests copy straight between them
      // and the GPU.
      ro.register_host = [backend = backend_.get()](char* data, uint64_t bytes) {
        return backend->RegisterHostMemory(data, bytes);
      };
    }
    if (options_.shm_max_registered_bytes < 0) {
      return absl::InvalidArgumentError("--shm_max_registered_bytes must be >= 0");
    }
    ro.max_registered_host_bytes = options_.shm_max_registered_bytes;
    regions_ = std::make_unique<RegionRegistry>(ro, metrics_.get());
    path = options_.shm_socket;
    if (path.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      path = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/attnd-", ::getpid(),
                          ".regions.sock");
    }
    ASSIGN_OR_RETURN(region_socket_, RegionSocket::Listen(path, regions_.get()));
    Log(absl::StrCat("shared memory allowed: region socket ", path, ", at most ",
                     ro.max_regions_per_client, " regions and ", ro.max_bytes_per_client,
                     " bytes per client"));
  }
  region_service_ = std::make_unique<RegionService>(regions_.get(), authenticator_.get(), path);
  return absl::OkStatus();
}

// The page pool over the backend's KV region and the session manager.
absl::Status AttnServer::CreateSessions(const BackendInfo& info) {
  if (options_.kv_page_tokens < 1 || options_.kv_page_tokens > (1 << 20)) {
    return absl::InvalidArgumentError("--kv_page_tokens must be in [1, 2^20]");
  }
  if (step_device_ == nullptr) {
    Log("no KV cache region: session RPCs answer UNIMPLEMENTED");
    return absl::OkStatus();
  }
  const KvRegion region = step_device_->kv_region();
  KvPagePool::Options po;
  po.num_pages = region.num_pages;
  po.page_bytes = region.page_bytes;
  po.shuffle_seed = options_.kv_shuffle_seed;
  ASSIGN_OR_RETURN(kv_pool_, KvPagePool::Create(po));
  SessionManager::Options mo;
  mo.replica_id = options_.replica_id.empty() ? RandomReplicaId() : options_.replica_id;
  mo.max_sessions = options_.max_sessions;
  mo.max_session_tokens = options_.max_session_tokens;
  if (!(options_.session_ttl_s > 0) || options_.session_ttl_s > 1e7) {
    return absl::InvalidArgumentError("--session_ttl_s must be in (0, 1e7]");
  }
  mo.ttl = std::chrono::milliseconds(static_cast<int64_t>(options_.session_ttl_s * 1000 + 0.5));
  if (mo.ttl.count() < 1) mo.ttl = std::chrono::milliseconds(1);
  mo.head_dims = info.head_dims;
  ASSIGN_OR_RETURN(sessions_, SessionManager::Create(mo, kv_pool_.get(), metrics_.get()));
  StepPipeline::Options pipeline;
  pipeline.completion_threads = std::clamp<int>(std::thread::hardware_concurrency() / 2, 2, 8);
  // A GPU launch is done in tens of microseconds: a lane looks for the next one a little before
  // it sleeps (the CPU backend's lane computes on every core and sleeps at once).
  if (backend_->HasGpu()) pipeline.idle_poll = std::chrono::microseconds(options_.step_idle_poll_us);
  pipeline.poll_when_busy = options_.step_poll_when_busy;
  ASSIGN_OR_RETURN(step_pipeline_, StepPipeline::Create(pipeline, step_device_.get()));
  Log(absl::StrCat("replica ", mo.replica_id, ": KV cache of ", region.num_pages, " pages (",
                   2 * region.num_pages * region.page_bytes, " bytes, ",
                   options_.kv_page_tokens, " tokens of a 2 KiB row per page), max_sessions ",
                   mo.max_sessions, ", session TTL ", options_.session_ttl_s, " s"));
  return absl::OkStatus();
}

// Runs one small request through the backend so that the first caller does not pay for
// module loading and allocation; attnd listens only once it has succeeded.
absl::Status AttnServer::WarmUp() {
  v1::AttendRequest request;
  const int d = backend_->Info().head_dims.front();
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::DTYPE_BFLOAT16);
    t->add_shape(16);
    t->add_shape(1);
    t->add_shape(d);
    t->mutable_data()->assign(16 * d * 2, '\x3c');  // bf16 0x3c3c ~ 0.0115
  }
  RequestLimits limits;
  limits.head_dims = backend_->Info().head_dims;
  ASSIGN_OR_RETURN(std::unique_ptr<AttendJob> job, ValidateAttendRequest(request, limits));
  job->arrival = Clock::now();
  RETURN_IF_ERROR(backend_->Prepare(*job));
  const absl::Status st = RunAlone(*backend_, std::move(job));
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat("backend warm-up failed: ", st.message()));
  return sessions_ ? WarmUpSessionSteps(*step_pipeline_, *sessions_) : absl::OkStatus();
}

int AttnServer::metrics_port() const { return metrics_->port(); }

int64_t AttnServer::SharedMemoryRegions() const {
  return regions_ ? regions_->RegionCount() : 0;
}

int64_t AttnServer::PendingPerClientTotal() const { return service_->PendingPerClientTotal(); }

// Every 500 ms: the pool and GPU memory gauges, and health NOT_SERVING once the backend says it
// cannot compute any more, so that probes (and Kubernetes' liveness probe) see it.
void AttnServer::MonitorBackendLoop() {
  bool reported_lost = false;
  std::unique_lock<std::mutex> lock(monitor_mu_);
  do {
    const BackendMemory m = backend_->Memory();
    metrics_->SetDevicePool(m.device_pool);
    metrics_->SetPinnedPool(m.pinned_pool);
    metrics_->SetGpuMemory(m.gpu_used, m.gpu_free, m.gpu_total);
    if (const absl::Status health = backend_->Health(); !health.ok() && !reported_lost) {
      reported_lost = true;
      Log(absl::StrCat("health NOT_SERVING: ", health.message()));
      auto* service = server_->GetHealthCheckService();
      service->SetServingStatus(kServiceName, false);
      service->SetServingStatus(false);
    }
  } while (!monitor_cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return stopping_; }));
}

// The hand-off of sessions to peers on drain (--handoff_peers).
absl::Status AttnServer::CreateHandoff() {
  if (options_.handoff_peers.empty()) return absl::OkStatus();
  if (sessions_ == nullptr) {
    Log("--handoff_peers given but this attnd has no sessions: nothing to hand off");
    return absl::OkStatus();
  }
  SessionHandoff::Options ho;
  ho.peers = options_.handoff_peers;
  ho.tls_server_name = options_.handoff_tls_server_name;
  ho.max_message_bytes = options_.max_message_bytes;
  ho.kv_region = step_device_->kv_region();
  ho.kv_device = step_device_.get();
  if (!options_.tls_cert.empty()) {
    grpc::SslCredentialsOptions ssl;
    if (!options_.tls_client_ca.empty()) {
      ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadSecretFile("--tls_client_ca", options_.tls_client_ca));
    }
    ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadSecretFile("--tls_cert", options_.tls_cert));
    ASSIGN_OR_RETURN(ssl.pem_private_key, ReadSecretFile("--tls_key", options_.tls_key));
    ho.credentials = grpc::SslCredentials(ssl);
  }
  ASSIGN_OR_RETURN(handoff_, SessionHandoff::Create(std::move(ho), sessions_.get(),
                                                    authenticator_.get(), metrics_.get()));
  return absl::OkStatus();
}

// Sessions move to the peers; the listener stays open meanwhile (and through the lame-duck
// phase after), so that calls on moved sessions learn where they went.
void AttnServer::HandOffSessions() {
  sessions_->StopCreating();
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::milliseconds(static_cast<int64_t>(options_.drain_timeout_s * 1000));
  const SessionHandoff::Summary s = handoff_->MoveAll(deadline);
  // Steps that found a session before it moved end (refused) before its pages are counted.
  for (int i = 0; i < 200 && batcher_->Pending() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  Log(absl::StrFormat("hand-off: %d sessions moved (%d bytes in %.3f s), %d not moved; KV "
                      "pages in use after hand-off: %d",
                      s.moved, s.bytes, seconds, s.not_moved,
                      kv_pool_->num_pages() - kv_pool_->FreePages()));
}

void AttnServer::StopHandoff() {
  if (handoff_) handoff_->Stop();
}

void AttnServer::Drain() {
  service_->StartDraining();
  batcher_->StartDraining();  // queued requests go now: no batch partner is coming
  server_->GetHealthCheckService()->Shutdown();
  // Logged once it holds (tests wait for this line).
  Log("draining: health NOT_SERVING, new calls UNAVAILABLE, finishing accepted requests");
  if (handoff_) {
    HandOffSessions();
    service_->RestartQuietPeriod();
  }
  WaitUntilQuiet();
  service_->EndOpenStreams();
  batcher_->Drain();
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(options_.drain_timeout_s * 1000));
  server_->Shutdown(deadline);
  Log("drained");
}

// The lame-duck part of the drain. gRPC's Shutdown cancels (CANCELLED, which clients do not
// retry) every call that reaches it from then on, also one whose message is still arriving;
// refusing calls with UNAVAILABLE until they stop coming keeps that window empty for clients
// that move on. The quiet period runs from the last arrival or answer: a client answered during
// the drain sends its next call right after, and that call must still find the listener open.
void AttnServer::WaitUntilQuiet() {
  const auto quiet = std::chrono::milliseconds(options_.drain_quiet_ms);
  const auto until = Clock::now() + std::chrono::milliseconds(
                                        static_cast<int64_t>(options_.drain_grace_s * 1000));
  while (Clock::now() < until) {
    if (batcher_->Pending() == 0 && service_->QuietSince(Clock::now() - quiet)) {
      Log(absl::StrCat("drain: no call for ", options_.drain_quiet_ms,
                       " ms and nothing queued or running; closing the listener"));
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Log("drain grace over with calls still arriving");
}

void AttnServer::Wait() { server_->Wait(); }

AttnServer::~AttnServer() {
  // Queued jobs finish first: a reactor that never finishes would keep Shutdown waiting.
  if (service_) {
    service_->StartDraining();
    service_->EndOpenStreams();
  }
  if (batcher_) batcher_->Drain();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  if (service_) {
    service_->AfterHandlers();
    service_->WaitForStreamsDone();
  }
  {
    std::lock_guard<std::mutex> lock(monitor_mu_);
    stopping_ = true;
  }
  monitor_cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  // The batcher drains and stops before the backend and metrics it uses go away.
  batcher_.reset();
}

}  // namespace attn
