// The session RPCs of AttentionService: CreateSession, Step, BatchStep, TruncateSession,
// ForkSession, CloseSession. The bookkeeping ones answer at once (no blocking: a lock of the
// session manager at most); steps are validated, queued behind the earlier steps of their
// (session, layer), batched and computed, and Finish is called from their completion.
#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "engine/batcher.h"
#include "observability/metrics.h"
#include "rpc/attention_service.h"
#include "rpc/attend_response_encoder.h"
#include "rpc/call_timing.h"
#include "rpc/step_request_decoder.h"
#include "rpc/step_validation.h"
#include "sessions/session_manager.h"
#include "sessions/step_work.h"

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
    p.max_tokens = request->max_tokens();
    ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                     sessions_->CreateSession(p, SessionOwner(client)));
    response->set_session_id(s->id());
    response->set_page_tokens(s->shape().page_tokens);
    response->set_ttl_seconds(
        std::chrono::duration_cast<std::chrono::seconds>(sessions_->options().ttl).count());
    response->set_replica_id(sessions_->options().replica_id);
    response->set_max_tokens(s->shape().max_tokens);
    return absl::OkStatus();
  }();
  FinishUnary(reactor, Rpc::kCreateSession, start, st, Bytes(*request),
              st.ok() ? Bytes(*response) : 0);
  return reactor;
}

absl::StatusOr<std::unique_ptr<AttendJob>> AttentionService::MakeStepJob(
    grpc::CallbackServerContext* ctx, const std::string& client, const v1::StepRequest& request,
    v1::StepResponse* response, Clock::time_point arrival,
    std::function<void(absl::Status)> on_done, const WireStepData& wire) {
  ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                   sessions_->Find(request.session_id(), SessionOwner(client)));
  const StepRegions regions{client, options_.regions, backend_->HasGpu()};
  ASSIGN_OR_RETURN(std::unique_ptr<AttendJob> job,
                   ValidateStepRequest(request, session, options_.limits, regions, response, wire));
  job->arrival = arrival;
  job->deadline = SteadyDeadline(ctx);
  job->is_cancelled = [ctx] { return ctx->IsCancelled(); };
  AttendJob* raw = job.get();
  // The job holds its layer from the moment it starts until here; the next step of the layer
  // may start (on this thread) before the caller hears.
  job->done = [this, raw, arrival, response, on_done = std::move(on_done)](absl::Status st) {
    raw->step->session->ReleaseLayer(raw->step->layer);
    sessions_->UpdateMetricsSometimes();
    if (st.ok()) {
      FillTiming(*raw, arrival, response->mutable_timing());
    } else {
      response->Clear();
    }
    on_done(std::move(st));
  };
  return job;
}

void AttentionService::StartSteps(std::vector<std::unique_ptr<AttendJob>> jobs) {
  if (jobs.empty()) return;
  const std::vector<absl::Status> status = batcher_->SubmitAll(jobs);
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!status[i].ok()) jobs[i]->done(status[i]);  // refused: still ours, done not yet run
  }
}

void AttentionService::EnqueueSteps(std::vector<std::unique_ptr<AttendJob>> jobs) {
  std::vector<std::unique_ptr<AttendJob>> now;
  for (auto& job : jobs) {
    StepWork& w = *job->step;
    auto parked = std::make_shared<std::unique_ptr<AttendJob>>(std::move(job));
    const bool free = w.session->AcquireLayer(w.layer, [this, parked] {
      std::vector<std::unique_ptr<AttendJob>> one;
      one.push_back(std::move(*parked));
      StartSteps(std::move(one));
    });
    if (free) now.push_back(std::move(*parked));
  }
  StartSteps(std::move(now));
}

namespace {

// One Step or BatchStep call on the wire path, from its decoding until its answer is encoded:
// each step's decoded request (which its job borrows), its response without o.data and
// lse.data, the buffers its outputs are written into, and (BatchStep) its status. Shared by the
// handler and the steps' completions; the last completion encodes the answer.
struct WireStepCall {
  struct Output {
    v1::StepResponse response;
    OutputBytes o, lse;
    absl::Status status;
  };
  std::vector<DecodedStepRequest> requests;
  std::vector<Output> outputs;

  // Sizes outputs for the decoded requests (their addresses stay put from here on).
  void SizeOutputs() { outputs.resize(requests.size()); }
  WireStepData Wire(size_t i) {
    return {&requests[i].data, &outputs[i].o, &outputs[i].lse};
  }
};

// The received message's bytes as pieces of its slices, which *slices holds; request is left
// empty (gRPC owns it until the call ends and destroys it emptied). The pieces are needed only
// until the handler returns: every step's tensors are copied out as it is validated.
absl::Status TakeReceived(const grpc::ByteBuffer* request, std::vector<grpc::Slice>* slices,
                          std::vector<std::string_view>* pieces) {
  auto* taken = const_cast<grpc::ByteBuffer*>(request);
  absl::Status st = FromGrpcStatus(taken->Dump(slices));
  taken->Clear();
  RETURN_IF_ERROR(st);
  pieces->reserve(slices->size());
  for (const grpc::Slice& s : *slices) {
    pieces->emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::Step(grpc::CallbackServerContext* ctx,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  const auto arrival = Clock::now();
  OnCallArrived(arrival);
  const int64_t received = static_cast<int64_t>(request->Length());
  if (sessions_ == nullptr) return Unimplemented(ctx, Rpc::kStep, received);
  auto* reactor = ctx->DefaultReactor();
  auto call = std::make_shared<WireStepCall>();
  auto finish = [this, reactor, arrival, received, response, call](const absl::Status& st) {
    int64_t sent = 0;
    if (st.ok()) {
      WireStepCall::Output& out = call->outputs.front();
      *response = EncodeStepResponse(out.response, std::move(out.o), std::move(out.lse));
      sent = static_cast<int64_t>(response->Length());
    }
    FinishUnary(reactor, Rpc::kStep, arrival, st, received, sent);
  };
  absl::Status st = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string client, Identify(ctx));
    if (draining_.load()) return absl::UnavailableError(kShuttingDown);
    std::vector<grpc::Slice> slices;
    std::vector<std::string_view> pieces;
    RETURN_IF_ERROR(TakeReceived(request, &slices, &pieces));
    RETURN_IF_ERROR(DecodeStepRequest(pieces, &call->requests.emplace_back()));
    call->SizeOutputs();
    ASSIGN_OR_RETURN(std::shared_ptr<PendingLimiter::Slot> slot, pending_.Acquire(client));
    ASSIGN_OR_RETURN(std::unique_ptr<AttendJob> job,
                     MakeStepJob(ctx, client, call->requests.front().header,
                                 &call->outputs.front().response, arrival,
                                 [slot, finish](absl::Status s) {
                                   slot->Release();
                                   finish(s);
                                 },
                                 call->Wire(0)));
    std::vector<std::unique_ptr<AttendJob>> jobs;
    jobs.push_back(std::move(job));
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
    if (draining_.load()) return absl::UnavailableError(kShuttingDown);
    auto call = std::make_shared<WireStepCall>();
    std::vector<grpc::Slice> slices;
    std::vector<std::string_view> pieces;
    RETURN_IF_ERROR(TakeReceived(request, &slices, &pieces));
    RETURN_IF_ERROR(DecodeBatchStepRequest(pieces, &call->requests));
    call->SizeOutputs();
    ASSIGN_OR_RETURN(std::shared_ptr<PendingLimiter::Slot> slot, pending_.Acquire(client));
    const size_t n = call->requests.size();
    auto batch = std::make_shared<BatchStepCall>();
    batch->slot = slot;
    batch->finish = [this, reactor, arrival, received, response, call] {
      std::vector<EncodedStepResult> results(call->outputs.size());
      for (size_t i = 0; i < results.size(); ++i) {
        WireStepCall::Output& out = call->outputs[i];
        results[i].status_code = static_cast<int32_t>(out.status.code());
        if (!out.status.ok()) {
          results[i].status_message = std::string(out.status.message());
          continue;
        }
        results[i].response = &out.response;
        results[i].o = std::move(out.o);
        results[i].lse = std::move(out.lse);
      }
      *response = EncodeBatchStepResponse(results);
      FinishUnary(reactor, Rpc::kBatchStep, arrival, absl::OkStatus(), received,
                  static_cast<int64_t>(response->Length()));
    };
    batch->remaining = static_cast<int64_t>(n) + 1;  // + 1 until every item is queued
    std::vector<std::unique_ptr<AttendJob>> jobs;
    for (size_t i = 0; i < n; ++i) {
      WireStepCall::Output* out = &call->outputs[i];
      auto job = MakeStepJob(ctx, client, call->requests[i].header, &out->response, arrival,
                             [batch, out](absl::Status s) {
                               out->status = std::move(s);
                               batch->ItemDone();
                             },
                             call->Wire(i));
      if (job.ok()) {
        jobs.push_back(std::move(*job));
      } else {
        out->status = job.status();
        batch->ItemDone();
      }
    }
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
  FinishUnary(reactor, Rpc::kCloseSession, start, st, Bytes(*request),
              st.ok() ? Bytes(*response) : 0);
  return reactor;
}

}  // namespace attn
