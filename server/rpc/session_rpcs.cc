// The session RPCs of AttentionService: CreateSession, Step, BatchStep, TruncateSession,
// ForkSession, CloseSession. The bookkeeping ones answer at once (no blocking: a lock of the
// session manager at most); steps are validated, queued behind the earlier steps of their
// (session, layer), batched and computed, and Finish is called from their completion.
#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "rpc/grpc_status.h"
#include "engine/batcher.h"
#include "observability/metrics.h"
#include "rpc/attention_service.h"
#include "rpc/call_timing.h"
#include "rpc/response_encoder.h"
#include "rpc/step_request_decoder.h"
#include "rpc/step_validation.h"
#include "sessions/session_manager.h"
#include "sessions/session_moves.h"
#include "sessions/step_job.h"

namespace attn {
namespace {

constexpr char kShuttingDown[] = "attnd is shutting down; retry on another replica";
constexpr char kNoSessions[] =
    "KV-cache sessions are not available: this attnd's backend has no KV cache region";

int64_t Bytes(const google::protobuf::Message& m) { return static_cast<int64_t>(m.ByteSizeLong()); }

}  // namespace

grpc::ServerUnaryReactor* AttentionService::Unimplemented(grpc::CallbackServerContext* ctx,
                                                          Rpc rpc, int64_t received) {
  const auto start = Clock::now();
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<std::string> client = Identify(ctx);
  FinishUnary(reactor, rpc, start,
              client.ok() ? absl::UnimplementedError(kNoSessions) : client.status(), received, 0);
  return reactor;
}

void AttentionService::FillSessionInfo(v1::GetServerInfoResponse* response) const {
  if (sessions_ == nullptr) return;
  const KvPagePool& pool = sessions_->pool();
  const auto& o = sessions_->options();
  response->set_replica_id(o.replica_id);
  v1::KvCacheInfo* info = response->mutable_kv_cache();
  info->set_capacity_bytes(2 * pool.num_pages() * pool.page_bytes());
  info->set_page_tokens(sessions_->PageTokensFor(kReferenceKvRowBytes));
  info->set_total_pages(pool.num_pages());
  info->set_free_pages(pool.FreePages());
  info->set_sessions(sessions_->OpenSessions());
  info->set_session_ttl_seconds(std::chrono::duration_cast<std::chrono::seconds>(o.ttl).count());
}

void AttentionService::AddMovedTo(grpc::CallbackServerContext* ctx, const absl::Status& st) {
  const std::string to = MovedToOf(st);
  if (!to.empty()) ctx->AddTrailingMetadata(kMovedToKey, to);
}

grpc::ServerUnaryReactor* AttentionService::CreateSession(grpc::CallbackServerContext* ctx,
                                                          const v1::CreateSessionRequest* request,
                                                          v1::CreateSessionResponse* response) {
  const auto start = Clock::now();
  OnCallArrived(start);
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kCreateSession, Bytes(*request));
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    SessionManager::CreateParams p;
    p.num_layers = request->num_layers();
    p.num_kv_heads = request->num_kv_heads();
    p.head_dim = request->head_dim();
    ASSIGN_OR_RETURN(p.dtype, SessionDType(request->dtype()));
    RETURN_IF_ERROR(SessionCacheParams(*request, options_.limits.fp8, &p));
    p.max_tokens = request->max_tokens();
    ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                     sessions_->CreateSession(p, SessionOwner(client)));
    response->set_session_id(s->id());
    response->set_page_tokens(s->shape().page_tokens);
    response->set_ttl_seconds(
        std::chrono::duration_cast<std::chrono::seconds>(sessions_->options().ttl).count());
    response->set_replica_id(sessions_->options().replica_id);
    response->set_max_tokens(s->shape().max_tokens);
    response->set_cache_dtype(ToWireDType(s->shape().CacheDType()));
    return absl::OkStatus();
  }();
  FinishUnary(reactor, Rpc::kCreateSession, start, st, Bytes(*request),
              st.ok() ? Bytes(*response) : 0);
  return reactor;
}

// One Step or BatchStep call from its decoding until its answer is encoded: the received slices
// (which the steps' tensors are copied out of when their launch is staged), each step's decoded
// request, and per step its answer: the response without o.data and lse.data, the outputs they
// are sent from, its status. Shared by the handler and the steps' jobs (input_hold); the last
// step to complete encodes the answer.
struct WireStepCall {
  // The requests' headers and the responses' (declared first: freed last).
  google::protobuf::Arena arena{StepCallArenaOptions()};
  std::vector<grpc::Slice> slices;
  std::vector<std::string_view> pieces;
  std::vector<DecodedStepRequest> requests;
  struct Output {
    v1::StepResponse* response = nullptr;  // on the call's arena
    OutputBytes o, lse;
    absl::Status status;
  };
  std::vector<Output> outputs;

  void MakeOutputs(size_t n) {
    outputs.resize(n);
    for (Output& out : outputs) {
      out.response = google::protobuf::Arena::CreateMessage<v1::StepResponse>(&arena);
    }
  }

  // Takes received's slices (references, not copies; gRPC destroys the emptied buffer when the
  // call ends). The pieces point into slices, which are not touched again: they stay valid as
  // long as this call.
  absl::Status Take(const grpc::ByteBuffer* received) {
    auto* taken = const_cast<grpc::ByteBuffer*>(received);
    absl::Status st = FromGrpcStatus(taken->Dump(&slices));
    taken->Clear();
    RETURN_IF_ERROR(st);
    pieces.reserve(slices.size());
    for (const grpc::Slice& s : slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return absl::OkStatus();
  }
};

AttentionService::StepCallScope AttentionService::MakeStepCallScope(
    grpc::CallbackServerContext* ctx, const std::string& client, Clock::time_point arrival) const {
  return StepCallScope{ctx, SessionOwner(client),
                       StepRegions{client, options_.regions, backend_->HasGpu()}, arrival,
                       SteadyDeadline(ctx)};
}

absl::StatusOr<std::unique_ptr<StepJob>> AttentionService::MakeStepJob(
    const StepCallScope& scope, std::shared_ptr<WireStepCall> call, size_t item,
    std::function<void(absl::Status)> on_done) {
  DecodedStepRequest& request = call->requests[item];
  WireStepCall::Output* out = &call->outputs[item];
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                   sessions_->Find(request.header().session_id(), scope.owner));
  ASSIGN_OR_RETURN(std::unique_ptr<StepJob> job,
                   ValidateStepRequest(request.header(), std::move(session), options_.limits,
                                       scope.regions, &request.data));
  PrepareStepResponse(*job, request.header(), out->response);
  const Clock::time_point arrival = scope.arrival;
  job->arrival = arrival;
  job->deadline = scope.deadline;
  job->is_cancelled = [ctx = scope.ctx] { return ctx->IsCancelled(); };
  StepJob* raw = job.get();
  // The job holds its layer from the moment it starts until here; the next step of the layer
  // may start (on this thread) before the caller hears.
  job->done = [this, raw, arrival, out, on_done = std::move(on_done)](absl::Status st) {
    raw->session->ReleaseLayer(raw->layer);
    sessions_->UpdateMetricsSometimes();
    if (st.ok()) {
      out->response->set_cached_tokens(raw->cached_tokens);
      FillTiming(*raw, arrival, out->response->mutable_timing());
      out->o = std::move(raw->o);
      out->lse = std::move(raw->lse);
    } else {
      out->response->Clear();
    }
    on_done(std::move(st));
  };
  job->input_hold = std::move(call);
  job->ready = Clock::now();
  return job;
}

void AttentionService::StartSteps(std::vector<std::unique_ptr<StepJob>> steps) {
  if (steps.empty()) return;
  std::vector<std::unique_ptr<Job>> jobs(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) jobs[i] = std::move(steps[i]);
  const std::vector<absl::Status> status = batcher_->SubmitAll(jobs);
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!status[i].ok()) jobs[i]->done(status[i]);  // refused: still ours, done not yet run
  }
}

void AttentionService::EnqueueSteps(std::vector<std::unique_ptr<StepJob>> jobs) {
  std::vector<std::unique_ptr<StepJob>> now;
  for (auto& job : jobs) {
    StepJob* raw = job.get();
    auto parked = std::make_shared<std::unique_ptr<StepJob>>(std::move(job));
    const bool free = raw->session->AcquireLayer(raw->layer, [this, parked] {
      std::vector<std::unique_ptr<StepJob>> one;
      one.push_back(std::move(*parked));
      StartSteps(std::move(one));
    });
    if (free) now.push_back(std::move(*parked));
  }
  StartSteps(std::move(now));
}

grpc::ServerUnaryReactor* AttentionService::Step(grpc::CallbackServerContext* ctx,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  const auto arrival = Clock::now();
  OnCallArrived(arrival);
  const int64_t received = static_cast<int64_t>(request->Length());
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kStep, received);
  auto* reactor = ctx->DefaultReactor();
  auto call = std::make_shared<WireStepCall>();
  // Runs once: on the step's completion, or here when it never got that far.
  auto finish = [this, ctx, reactor, arrival, received, response,
                 raw = call.get()](const absl::Status& st) {
    AddMovedTo(ctx, st);
    int64_t sent = 0;
    if (st.ok()) {
      const auto encode_start = Clock::now();
      WireStepCall::Output& out = raw->outputs.front();
      *response = EncodeStepResponse(*out.response, std::move(out.o), std::move(out.lse));
      sent = static_cast<int64_t>(response->Length());
      ObserveStepPhase(StepPhase::kAnswer, encode_start);
    }
    const auto send_start = Clock::now();
    FinishUnary(reactor, Rpc::kStep, arrival, st, received, sent);
    if (st.ok()) ObserveStepPhase(StepPhase::kSend, send_start);
  };
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    if (RefuseSteps()) return absl::UnavailableError(kShuttingDown);
    RETURN_IF_ERROR(call->Take(request));
    RETURN_IF_ERROR(DecodeStepRequest(call->pieces, &call->requests.emplace_back(&call->arena)));
    call->MakeOutputs(1);
    ASSIGN_OR_RETURN(std::shared_ptr<PendingLimiter::Slot> slot, pending_.Acquire(client));
    ASSIGN_OR_RETURN(std::unique_ptr<StepJob> job,
                     MakeStepJob(MakeStepCallScope(ctx, client, arrival), call, 0,
                                 [slot, finish](absl::Status s) {
                                   slot->Release();
                                   finish(s);
                                 }));
    std::vector<std::unique_ptr<StepJob>> jobs;
    jobs.push_back(std::move(job));
    ObserveStepPhase(StepPhase::kDecode, arrival);
    EnqueueSteps(std::move(jobs));
    return absl::OkStatus();
  }();
  if (!st.ok()) finish(st);
  HandlerReturns();
  return reactor;
}

namespace {

// One BatchStep call while its items are computed: finishes the call when the last one is done.
struct BatchStepCall {
  std::atomic<int64_t> remaining{0};
  std::shared_ptr<PendingLimiter::Slot> slot;
  std::function<void()> finish;
  void ItemDone() {
    if (remaining.fetch_sub(1) == 1) {
      slot->Release();
      finish();
    }
  }
};

}  // namespace

grpc::ServerUnaryReactor* AttentionService::BatchStep(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  const auto arrival = Clock::now();
  OnCallArrived(arrival);
  const int64_t received = static_cast<int64_t>(request->Length());
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kBatchStep, received);
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    if (RefuseSteps()) return absl::UnavailableError(kShuttingDown);
    auto call = std::make_shared<WireStepCall>();
    RETURN_IF_ERROR(call->Take(request));
    RETURN_IF_ERROR(DecodeBatchStepRequest(call->pieces, &call->requests, &call->arena));
    call->MakeOutputs(call->requests.size());
    ASSIGN_OR_RETURN(std::shared_ptr<PendingLimiter::Slot> slot, pending_.Acquire(client));
    const size_t n = call->requests.size();
    auto batch = std::make_shared<BatchStepCall>();
    batch->slot = slot;
    batch->finish = [this, reactor, arrival, received, response, raw = call.get()] {
      const auto encode_start = Clock::now();
      std::vector<EncodedStepResult> results(raw->outputs.size());
      for (size_t i = 0; i < results.size(); ++i) {
        WireStepCall::Output& out = raw->outputs[i];
        results[i].status_code = static_cast<int32_t>(out.status.code());
        if (!out.status.ok()) {
          results[i].status_message = std::string(out.status.message());
          continue;
        }
        results[i].response = out.response;
        results[i].o = std::move(out.o);
        results[i].lse = std::move(out.lse);
      }
      *response = EncodeBatchStepResponse(results);
      ObserveStepPhase(StepPhase::kAnswer, encode_start);
      const auto send_start = Clock::now();
      FinishUnary(reactor, Rpc::kBatchStep, arrival, absl::OkStatus(), received,
                  static_cast<int64_t>(response->Length()));
      ObserveStepPhase(StepPhase::kSend, send_start);
    };
    batch->remaining = static_cast<int64_t>(n) + 1;  // + 1 until every item is queued
    std::vector<std::unique_ptr<StepJob>> jobs;
    // In chunks of options_.batch_step_chunk (0: all at once): see Options.
    const size_t chunk = options_.batch_step_chunk > 0 ? size_t(options_.batch_step_chunk) : n;
    jobs.reserve(std::min(n, chunk));
    const StepCallScope scope = MakeStepCallScope(ctx, client, arrival);
    for (size_t i = 0; i < n; ++i) {
      WireStepCall::Output* out = &call->outputs[i];
      // The jobs hold the call (input_hold) until they are gone, the handler until it returns:
      // it lives until the answer is encoded, whoever completes the last item.
      auto job = MakeStepJob(scope, call, i,
                             [batch, out](absl::Status s) {
                               out->status = std::move(s);
                               batch->ItemDone();
                             });
      if (job.ok()) {
        jobs.push_back(std::move(*job));
      } else {
        out->status = job.status();
        batch->ItemDone();
      }
      if (jobs.size() == chunk && i + 1 < n) {
        EnqueueSteps(std::move(jobs));
        jobs.clear();
      }
    }
    ObserveStepPhase(StepPhase::kDecode, arrival);
    EnqueueSteps(std::move(jobs));
    batch->ItemDone();
    return absl::OkStatus();
  }();
  if (!st.ok()) FinishUnary(reactor, Rpc::kBatchStep, arrival, st, received, 0);
  HandlerReturns();
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::TruncateSession(
    grpc::CallbackServerContext* ctx, const v1::TruncateSessionRequest* request,
    v1::TruncateSessionResponse* response) {
  const auto start = Clock::now();
  OnCallArrived(start);
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kTruncateSession, Bytes(*request));
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    ASSIGN_OR_RETURN(Session::TruncateResult r,
                     sessions_->Truncate(request->session_id(), SessionOwner(client),
                                         request->tokens()));
    response->mutable_cached_tokens()->Assign(r.cached_tokens.begin(), r.cached_tokens.end());
    response->set_freed_pages(r.freed_pages);
    return absl::OkStatus();
  }();
  AddMovedTo(ctx, st);
  FinishUnary(reactor, Rpc::kTruncateSession, start, st, Bytes(*request),
              st.ok() ? Bytes(*response) : 0);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::ForkSession(grpc::CallbackServerContext* ctx,
                                                        const v1::ForkSessionRequest* request,
                                                        v1::ForkSessionResponse* response) {
  const auto start = Clock::now();
  OnCallArrived(start);
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kForkSession, Bytes(*request));
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                     sessions_->Fork(request->session_id(), SessionOwner(client)));
    response->set_session_id(s->id());
    response->set_replica_id(sessions_->options().replica_id);
    return absl::OkStatus();
  }();
  AddMovedTo(ctx, st);
  FinishUnary(reactor, Rpc::kForkSession, start, st, Bytes(*request),
              st.ok() ? Bytes(*response) : 0);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::CloseSession(grpc::CallbackServerContext* ctx,
                                                         const v1::CloseSessionRequest* request,
                                                         v1::CloseSessionResponse* response) {
  const auto start = Clock::now();
  OnCallArrived(start);
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kCloseSession, Bytes(*request));
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    ASSIGN_OR_RETURN(int64_t freed, sessions_->Close(request->session_id(), SessionOwner(client)));
    response->set_freed_pages(freed);
    return absl::OkStatus();
  }();
  AddMovedTo(ctx, st);
  FinishUnary(reactor, Rpc::kCloseSession, start, st, Bytes(*request),
              st.ok() ? Bytes(*response) : 0);
  return reactor;
}

}  // namespace attn
