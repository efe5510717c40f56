#include "rpc/attention_service.h"

#include <deque>
#include <mutex>
#include <vector>

#include <grpcpp/impl/codegen/proto_utils.h>

#include "absl/strings/str_cat.h"
#include "engine/batcher.h"
#include "rpc/attend_request_decoder.h"
#include "rpc/response_encoder.h"
#include "rpc/call_timing.h"
#include "rpc/echo_wire.h"
#include "observability/metrics.h"
#include "common/status_util.h"
#include "rpc/grpc_status.h"
#include "common/tsan_annotations.h"
#include "transport/tensor_source.h"

namespace attn {
namespace {

constexpr char kShuttingDown[] = "attnd is shutting down; retry on another replica";

// One unary Attend through protobuf messages (Options::attend_wire_path false).
struct ProtoAttendCall {
  v1::AttendRequest request;
  v1::AttendResponse response;
};

}  // namespace

// One Attend on the wire path, from its bytes' arrival until its answer is encoded: the received
// slices (which the decoded pieces borrow, until the backend has staged them), the decoded
// request, the response's header fields and the job's outputs (until Encode hands them to the
// answer's slices). A unary call's is owned by its handler until its job
// is queued, then by the job's completion, which deletes it; an AttendStream item's by the item.
struct WireAttendCall {
  std::vector<grpc::Slice> slices;
  std::vector<std::string_view> pieces;
  DecodedAttendRequest request;
  v1::AttendResponse response;  // without o.data and lse.data
  OutputBytes o, lse;

  // Takes received's slices (references, not copies; received is left empty) and decodes them.
  absl::Status Decode(grpc::ByteBuffer* received) {
    absl::Status st = FromGrpcStatus(received->Dump(&slices));
    received->Clear();
    RETURN_IF_ERROR(st);
    pieces.reserve(slices.size());
    for (const grpc::Slice& s : slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return DecodeAttendRequest(pieces, &request);
  }
  // The answer: the response's header with o and lse spliced in (on success), or without them.
  grpc::ByteBuffer Encode(bool ok) {
    if (!ok) {
      response.clear_o();
      response.clear_lse();
      return EncodeAttendResponse(response, OutputBytes(), OutputBytes());
    }
    return EncodeAttendResponse(response, std::move(o), std::move(lse));
  }
};

AttentionService::AttentionService(Options options, Batcher* batcher, Backend* backend,
                                   Metrics* metrics, SessionManager* sessions)
    : options_(std::move(options)),
      batcher_(batcher),
      backend_(backend),
      metrics_(metrics),
      sessions_(sessions),
      pending_(options_.max_pending_per_client) {}

absl::StatusOr<std::string> AttentionService::Identify(
    const grpc::CallbackServerContext* ctx) const {
  if (options_.authenticator != nullptr) return options_.authenticator->Authenticate(*ctx);
  return PeerHost(ctx->peer());
}

void AttentionService::FinishUnary(grpc::ServerUnaryReactor* reactor, Rpc rpc,
                                   Clock::time_point start, const absl::Status& st,
                                   int64_t received, int64_t sent) {
  const grpc::Status gst = ToGrpcStatus(st);
  OnCallAnswered();
  if (metrics_) {
    metrics_->ObserveRequest(rpc, st.code(), Seconds(Clock::now() - start), received,
                             st.ok() ? sent : 0);
  }
  reactor->Finish(gst);
}

absl::Status AttentionService::SubmitAttend(grpc::CallbackServerContext* ctx,
                                            const std::string& client,
                                            const v1::AttendRequest* request,
                                            v1::AttendResponse* response,
                                            Clock::time_point arrival,
                                            std::function<void(absl::Status)> on_done) {
  if (draining_.load()) return absl::UnavailableError(kShuttingDown);
  ASSIGN_OR_RETURN(std::unique_ptr<AttendJob> job,
                   ValidateAttendRequest(*request, options_.limits));
  // The protobuf path answers in a message: the outputs are copied into its data fields.
  AttendJob* raw = job.get();
  auto fill = [raw, response, on_done = std::move(on_done)](absl::Status st) {
    if (st.ok()) {
      if (!raw->o.empty()) response->mutable_o()->set_data(raw->o.data, raw->o.size);
      if (!raw->lse.empty()) response->mutable_lse()->set_data(raw->lse.data, raw->lse.size);
    }
    on_done(std::move(st));
  };
  return SubmitJob(ctx, client, std::move(job), *request, response, arrival, nullptr,
                   std::move(fill));
}

absl::Status AttentionService::SubmitWireAttend(grpc::CallbackServerContext* ctx,
                                                const std::string& client, WireAttendCall* call,
                                                Clock::time_point arrival,
                                                std::function<void(absl::Status)> on_done) {
  if (draining_.load()) return absl::UnavailableError(kShuttingDown);
  const v1::AttendRequest& header = call->request.header;
  const WireTensors& data = call->request.data;
  ASSIGN_OR_RETURN(std::unique_ptr<AttendJob> job,
                   ValidateAttendRequest(header, options_.limits,
                                         {data.q.size, data.k.size, data.v.size}));
  const auto stage = [this, call](AttendJob& job) -> absl::Status {
    RETURN_IF_ERROR(backend_->StageWireInputs(job, call->request.data));
    // The tensors are staged: the received bytes can go.
    for (WireBytes* w : {&call->request.data.q, &call->request.data.k, &call->request.data.v}) {
      w->pieces.clear();
      w->size = 0;
    }
    call->pieces.clear();
    call->slices.clear();
    return absl::OkStatus();
  };
  // The outputs go to the answer as they are, sent from where the backend put them.
  AttendJob* raw = job.get();
  auto keep = [raw, call, on_done = std::move(on_done)](absl::Status st) {
    if (st.ok()) {
      call->o = std::move(raw->o);
      call->lse = std::move(raw->lse);
    }
    on_done(std::move(st));
  };
  return SubmitJob(ctx, client, std::move(job), header, &call->response, arrival, stage,
                   std::move(keep));
}

absl::Status AttentionService::SubmitJob(grpc::CallbackServerContext* ctx,
                                         const std::string& client,
                                         std::unique_ptr<AttendJob> job,
                                         const v1::AttendRequest& request,
                                         v1::AttendResponse* response, Clock::time_point arrival,
                                         const std::function<absl::Status(AttendJob&)>& stage,
                                         std::function<void(absl::Status)> on_done) {
  RETURN_IF_ERROR(ResolveAttendTensors(request, client, options_.regions, job.get()));
  job->arrival = arrival;
  job->deadline = SteadyDeadline(ctx);
  job->is_cancelled = [ctx] { return ctx->IsCancelled(); };
  // Held until done runs (or, should the job be dropped without it, until it is destroyed);
  // Release is idempotent, so the count goes back exactly once on every path.
  ASSIGN_OR_RETURN(std::shared_ptr<PendingLimiter::Slot> slot, pending_.Acquire(client));
  // On an error from here on, slot is released as it goes out of scope.
  if (stage) RETURN_IF_ERROR(stage(*job));
  job->bytes = AttendJobBytes(*job, request);
  PrepareAttendResponse(*job, request, response);
  RETURN_IF_ERROR(backend_->Prepare(*job));
  AttendJob* raw = job.get();
  job->done = [raw, arrival, response, slot, on_done = std::move(on_done)](absl::Status st) {
    slot->Release();
    if (st.ok()) {
      FillTiming(*raw, arrival, response->mutable_timing());
    } else {
      response->clear_o();
      response->clear_lse();
    }
    on_done(std::move(st));
  };
  job->ready = Clock::now();
  absl::Status st = batcher_->Submit(job);
  if (!st.ok()) slot->Release();  // not taken: done will not run
  return st;
}

grpc::ServerUnaryReactor* AttentionService::Attend(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  const auto arrival = Clock::now();
  OnCallArrived(arrival);
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<std::string> client = Identify(ctx);
  if (!client.ok()) {
    FinishUnary(reactor, Rpc::kAttend, arrival, client.status(),
                static_cast<int64_t>(request->Length()), 0);
    return reactor;
  }
  // gRPC owns request until the call ends; its bytes are taken here so that they can be freed
  // as soon as they have been staged, not only once the answer has been sent. gRPC destroys the
  // emptied buffer as usual.
  grpc::ByteBuffer* taken = const_cast<grpc::ByteBuffer*>(request);
  if (options_.attend_wire_path) {
    AttendWire(ctx, reactor, *client, arrival, taken, response);
  } else {
    AttendProto(ctx, reactor, *client, arrival, taken, response);
  }
  HandlerReturns();
  return reactor;
}

void AttentionService::AttendWire(grpc::CallbackServerContext* ctx,
                                  grpc::ServerUnaryReactor* reactor, const std::string& client,
                                  Clock::time_point arrival, grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) {
  const int64_t received = static_cast<int64_t>(request->Length());
  auto call = std::make_unique<WireAttendCall>();
  absl::Status st = call->Decode(request);
  if (st.ok()) {
    WireAttendCall* raw = call.get();
    st = SubmitWireAttend(ctx, client, raw, arrival,
                          [this, reactor, arrival, received, raw, response](absl::Status s) {
                            std::unique_ptr<WireAttendCall> done_call(raw);
                            int64_t sent = 0;
                            if (s.ok()) {
                              *response = done_call->Encode(true);
                              sent = static_cast<int64_t>(response->Length());
                            }
                            done_call.reset();
                            FinishUnary(reactor, Rpc::kAttend, arrival, s, received, sent);
                          });
    // Queued: the completion owns the call now (and may have deleted it already).
    if (st.ok()) call.release();
  }
  if (!st.ok()) FinishUnary(reactor, Rpc::kAttend, arrival, st, received, 0);
}

void AttentionService::AttendProto(grpc::CallbackServerContext* ctx,
                                   grpc::ServerUnaryReactor* reactor, const std::string& client,
                                   Clock::time_point arrival, grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) {
  const int64_t received = static_cast<int64_t>(request->Length());
  auto call = std::make_unique<ProtoAttendCall>();
  absl::Status st = FromGrpcStatus(
      grpc::SerializationTraits<v1::AttendRequest>::Deserialize(request, &call->request));
  if (st.ok()) {
    ProtoAttendCall* raw = call.get();
    st = SubmitAttend(ctx, client, &raw->request, &raw->response, arrival,
                      [this, reactor, arrival, received, raw, response](absl::Status s) {
                        std::unique_ptr<ProtoAttendCall> done_call(raw);
                        int64_t sent = 0;
                        bool own_buffer = false;
                        if (s.ok()) {
                          s = FromGrpcStatus(grpc::SerializationTraits<v1::AttendResponse>::Serialize(
                              done_call->response, response, &own_buffer));
                          sent = static_cast<int64_t>(response->Length());
                        }
                        done_call.reset();
                        FinishUnary(reactor, Rpc::kAttend, arrival, s, received, sent);
                      });
    if (st.ok()) call.release();
  }
  if (!st.ok()) FinishUnary(reactor, Rpc::kAttend, arrival, st, received, 0);
}

// One AttendStream call. Reads requests one at a time, keeps up to kMaxInFlight of them in the
// batcher, and writes responses as they complete (one write outstanding at a time). Owns the
// requests and responses of its items until each is written; deletes itself in OnDone, which
// gRPC calls only after Finish, which is called only once no item is in flight.
// Finish is called with mu_ released and is the last thing that touches this object: when it is
// called from a backend thread (Complete), OnDone may run and delete it before Finish returns.
// At the end of a drain (EndForDrain) it stops reading and finishes with UNAVAILABLE once its
// items in flight are answered.
class AttendStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  AttendStreamReactor(AttentionService* service, grpc::CallbackServerContext* ctx,
                      std::string client)
      : service_(service), ctx_(ctx), client_(std::move(client)), start_(Clock::now()) {
    if (service_->RegisterStream(this)) {  // the drain already ended open streams
      ending_ = finished_ = true;
      final_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, kShuttingDown);
      FinishCall();
      return;
    }
    StartNextRead();
  }

  // Called by the service under its streams mutex; true when the caller must call FinishCall
  // (after releasing that mutex).
  bool EndForDrain() {
    std::lock_guard<std::mutex> lock(mu_);
    ending_ = true;
    return ReadyToFinishLocked();
  }

  // The last thing to touch this object: OnDone may delete it before Finish returns.
  void FinishCall() {
    HandOffToGrpc(this);
    Finish(final_status_);
  }

  // gRPC calls OnDone only after a reaction has returned; the hand-off at each reaction's end
  // shows TSan that ordering.
  void OnReadDone(bool ok) override {
    TakeBackFromGrpc(this);
    HandleReadDone(ok);
    HandOffToGrpc(this);
  }

  void OnWriteDone(bool ok) override {
    TakeBackFromGrpc(this);
    HandleWriteDone(ok);
    HandOffToGrpc(this);
  }

  void OnDone() override {
    TakeBackFromGrpc(this);
    if (service_->metrics_) {
      const auto code = static_cast<absl::StatusCode>(final_status_.error_code());
      service_->metrics_->ObserveRequest(Rpc::kAttendStream, code, Seconds(Clock::now() - start_),
                                         received_, sent_);
    }
    // The last use of the service: once every stream is unregistered, the server may go away.
    service_->UnregisterStream(this);
    delete this;
  }

 private:
  static constexpr int kMaxInFlight = 64;
  // One item: the bytes read, then its request decoded and its answer until written.
  struct Item {
    grpc::ByteBuffer received;
    WireAttendCall call;
    grpc::ByteBuffer reply;
  };

  void HandleReadDone(bool ok) {
    std::unique_lock<std::mutex> lock(mu_);
    if (ending_) {  // a read that completed as the drain ended this stream: not taken
      if (ok) {
        reading_.reset();  // unanswered: the stream's status (UNAVAILABLE) says so
      } else {
        reads_done_ = true;
      }
      const bool finish = ReadyToFinishLocked();
      lock.unlock();
      if (finish) FinishCall();
      return;
    }
    if (!ok) {
      reads_done_ = true;
      const bool finish = ReadyToFinishLocked();
      lock.unlock();
      if (finish) FinishCall();
      return;
    }
    Item* item = reading_.release();
    ++in_flight_;
    lock.unlock();
    Submit(item);
    lock.lock();
    if (in_flight_ < kMaxInFlight && !reads_done_ && !ending_) {
      StartNextReadLocked();
    } else {
      read_paused_ = true;
    }
  }

  void HandleWriteDone(bool ok) {
    bool finish;
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      write_queue_.pop_front();
      if (!ok) write_failed_ = true;
      WriteNextLocked();
      finish = ReadyToFinishLocked();
    }
    if (finish) FinishCall();
  }

  void StartNextRead() {
    std::lock_guard<std::mutex> lock(mu_);
    StartNextReadLocked();
  }
  void StartNextReadLocked() {
    if (ending_) return;  // EndForDrain came first (possible while the constructor runs)
    read_paused_ = false;
    reading_ = std::make_unique<Item>();
    HandOffToGrpc(this);
    StartRead(&reading_->received);
  }

  void Submit(Item* item) {
    const auto arrival = Clock::now();
    service_->OnCallArrived(arrival);
    received_ += static_cast<int64_t>(item->received.Length());
    absl::Status st = item->call.Decode(&item->received);
    if (st.ok()) {
      st = service_->SubmitWireAttend(ctx_, client_, &item->call, arrival,
                                      [this, item](absl::Status s) { Complete(item, s); });
    }
    if (!st.ok()) Complete(item, st);
  }

  // Queues item's response for writing; any thread.
  void Complete(Item* item, const absl::Status& st) {
    v1::AttendResponse& response = item->call.response;
    response.set_request_id(item->call.request.header.request_id());
    response.set_status_code(static_cast<int32_t>(st.code()));
    if (!st.ok()) response.set_status_message(std::string(st.message()));
    item->reply = item->call.Encode(st.ok());
    if (service_->metrics_) {
      service_->metrics_->ObserveStreamItem(st.code());
    }
    service_->OnCallAnswered();
    bool finish;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      write_queue_.emplace_back(item);
      WriteNextLocked();
      if (read_paused_ && !reads_done_ && !ending_ && in_flight_ < kMaxInFlight) {
        StartNextReadLocked();
      }
      finish = ReadyToFinishLocked();
    }
    if (finish) FinishCall();  // may delete this
  }

  void WriteNextLocked() {
    if (writing_ || write_queue_.empty()) return;
    if (write_failed_) {  // the client is gone: drop what is left
      write_queue_.clear();
      return;
    }
    writing_ = true;
    sent_ += static_cast<int64_t>(write_queue_.front()->reply.Length());
    HandOffToGrpc(this);
    StartWrite(&write_queue_.front()->reply);
  }

  // True exactly once: when nothing is left to read (or the drain ended the stream), compute or
  // write. The caller then calls FinishCall after releasing mu_; nothing else can touch
  // final_status_ by then.
  bool ReadyToFinishLocked() {
    if (finished_ || !(reads_done_ || ending_) || in_flight_ > 0 || writing_ ||
        !write_queue_.empty()) {
      return false;
    }
    finished_ = true;
    if (ctx_->IsCancelled()) {
      final_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    } else if (!reads_done_) {  // ended by the drain while the client could still send
      final_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, kShuttingDown);
    } else {
      final_status_ = grpc::Status::OK;
    }
    return true;
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const std::string client_;
  const Clock::time_point start_;
  std::mutex mu_;
  std::unique_ptr<Item> reading_;
  std::deque<std::unique_ptr<Item>> write_queue_;
  int in_flight_ = 0;
  bool reads_done_ = false;
  bool read_paused_ = false;
  bool writing_ = false;
  bool write_failed_ = false;
  bool ending_ = false;  // the drain ended this stream: no more reads
  bool finished_ = false;
  grpc::Status final_status_;
  std::atomic<int64_t> received_{0};
  int64_t sent_ = 0;
};

// A stream refused as a whole (no valid bearer token): finished at once, nothing read.
class RejectedStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RejectedStreamReactor(AttentionService* service, const absl::Status& st)
      : service_(service), start_(Clock::now()), status_(ToGrpcStatus(st)) {
    service_->StreamOpened();
    HandOffToGrpc(this);
    Finish(status_);
  }
  void OnDone() override {
    TakeBackFromGrpc(this);
    if (service_->metrics_) {
      service_->metrics_->ObserveRequest(Rpc::kAttendStream,
                                         static_cast<absl::StatusCode>(status_.error_code()),
                                         Seconds(Clock::now() - start_), 0, 0);
    }
    service_->StreamClosed();  // the last use of the service
    delete this;
  }

 private:
  AttentionService* const service_;
  const Clock::time_point start_;
  const grpc::Status status_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::AttendStream(
    grpc::CallbackServerContext* ctx) {
  OnCallArrived(Clock::now());
  absl::StatusOr<std::string> client = Identify(ctx);
  if (!client.ok()) return new RejectedStreamReactor(this, client.status());
  if (draining_.load()) {
    return new RejectedStreamReactor(this, absl::UnavailableError(kShuttingDown));
  }
  return new AttendStreamReactor(this, ctx, std::move(*client));
}

bool AttentionService::RegisterStream(AttendStreamReactor* stream) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.insert(stream);
  ++open_streams_;
  return ending_streams_;
}

void AttentionService::UnregisterStream(AttendStreamReactor* stream) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.erase(stream);
  StreamClosedLocked();
}

void AttentionService::StreamOpened() {
  std::lock_guard<std::mutex> lock(streams_mu_);
  ++open_streams_;
}

void AttentionService::StreamClosed() {
  std::lock_guard<std::mutex> lock(streams_mu_);
  StreamClosedLocked();
}

void AttentionService::StreamClosedLocked() {
  // Notified under the lock: once WaitForStreamsDone sees zero, the service may be destroyed.
  if (--open_streams_ == 0) streams_done_.notify_all();
}

void AttentionService::WaitForStreamsDone() {
  std::unique_lock<std::mutex> lock(streams_mu_);
  streams_done_.wait(lock, [&] { return open_streams_ == 0; });
}

void AttentionService::EndOpenStreams() {
  // A stream this claims cannot be deleted before its FinishCall below: gRPC calls OnDone only
  // after Finish. FinishCall runs unlocked, since OnDone (which takes streams_mu_) may run inside.
  std::vector<AttendStreamReactor*> finish;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    ending_streams_ = true;
    for (AttendStreamReactor* stream : streams_) {
      if (stream->EndForDrain()) finish.push_back(stream);
    }
  }
  for (AttendStreamReactor* stream : finish) stream->FinishCall();
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::GetServerInfoResponse* response) {
  const auto start = Clock::now();
  OnCallArrived(start);
  if (absl::StatusOr<std::string> client = Identify(ctx); !client.ok()) {
    auto* reactor = ctx->DefaultReactor();
    FinishUnary(reactor, Rpc::kGetServerInfo, start, client.status(), 0, 0);
    return reactor;
  }
  const BackendInfo& info = backend_->Info();
  response->set_version(options_.version);
  response->set_backend(info.name);
  response->set_device_name(info.device_name);
  response->set_compute_units(info.compute_units);
  response->set_device_memory_bytes(info.device_memory_bytes);
  response->set_compute_capability(info.compute_capability);
  for (int32_t d : info.head_dims) response->add_head_dims(d);
  response->add_dtypes(v1::DTYPE_FLOAT16);
  response->add_dtypes(v1::DTYPE_BFLOAT16);
  response->add_dtypes(v1::DTYPE_FLOAT32);
  if (info.fp8.attend_kv) response->add_dtypes(v1::DTYPE_FLOAT8_E4M3);
  v1::Fp8Support* fp8 = response->mutable_fp8();
  fp8->set_attend_fp8_kv(info.fp8.attend_kv);
  fp8->set_attend_fp8_q(info.fp8.attend_q);
  fp8->set_session_fp8_cache(info.fp8.session_cache && sessions_ != nullptr);
  fp8->set_session_fp8_max_step_tokens(info.fp8.session_max_step_tokens);
  for (int32_t d : info.fp8.attend_tensor_core_head_dims) fp8->add_attend_tensor_core_head_dims(d);
  *response->mutable_limits() = options_.advertised_limits;
  response->set_build_info(info.build_info);
  FillSessionInfo(response);
  auto* reactor = ctx->DefaultReactor();
  FinishUnary(reactor, Rpc::kGetServerInfo, start, absl::OkStatus(), 0,
              static_cast<int64_t>(response->ByteSizeLong()));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::Echo(grpc::CallbackServerContext* ctx,
                                                 const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  const auto start = Clock::now();
  OnCallArrived(start);
  auto* reactor = ctx->DefaultReactor();
  const int64_t received = static_cast<int64_t>(request->Length());
  absl::Status st = Identify(ctx).status();
  if (st.ok()) {
    // As in Attend: gRPC owns request until the call ends, its bytes are taken here.
    grpc::ByteBuffer* taken = const_cast<grpc::ByteBuffer*>(request);
    st = options_.attend_wire_path ? EchoWire(taken, response) : EchoProto(taken, response);
  }
  FinishUnary(reactor, Rpc::kEcho, start, st, received,
              st.ok() ? static_cast<int64_t>(response->Length()) : 0);
  HandlerReturns();
  return reactor;
}

absl::Status AttentionService::EchoWire(grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  std::vector<grpc::Slice> slices;
  if (request->Valid()) RETURN_IF_ERROR(FromGrpcStatus(request->Dump(&slices)));
  request->Clear();
  std::vector<std::string_view> pieces;
  pieces.reserve(slices.size());
  for (const grpc::Slice& s : slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  DecodedEchoRequest decoded;
  RETURN_IF_ERROR(DecodeEchoRequest(pieces, &decoded));
  *response = EncodeEchoResponse(slices, decoded);
  return absl::OkStatus();
}

absl::Status AttentionService::EchoProto(grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::EchoRequest in;
  RETURN_IF_ERROR(
      FromGrpcStatus(grpc::SerializationTraits<v1::EchoRequest>::Deserialize(request, &in)));
  const std::string& payload = in.payload();
  const size_t back = in.response_bytes() > 0
                          ? std::min(payload.size(), static_cast<size_t>(in.response_bytes()))
                          : payload.size();
  v1::EchoResponse out;
  out.set_payload(payload.data(), back);
  bool own_buffer = false;
  return FromGrpcStatus(
      grpc::SerializationTraits<v1::EchoResponse>::Serialize(out, response, &own_buffer));
}

}  // namespace attn
