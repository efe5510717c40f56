// The attn.v1.Attention service on gRPC's callback API. Reactors validate, then hand work to
// the batcher and return; Finish is called from the job's completion, never blocking here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <unordered_set>

#include "rpc/attend_validation.h"
#include "rpc/auth.h"
#include "rpc/step_validation.h"
#include "attn/v1/attention.grpc.pb.h"
#include "engine/backend.h"
#include "observability/metrics.h"
#include "common/tsan_annotations.h"
#include "sessions/step_device.h"

namespace attn {

class Batcher;
class Metrics;
class SessionManager;
class AttendStreamReactor;
class RegionRegistry;
struct WireAttendCall;
struct WireStepCall;
struct StepJob;

// attn.v1.Attention's callback service with Attend, AttendStream, Step, BatchStep and Echo raw: the generated templates,
// composed here since the generated CallbackService has typed versions of both (a method added to
// the proto must be added here too).
using AttentionCallbackBase = v1::Attention::WithRawCallbackMethod_Attend<
    v1::Attention::WithRawCallbackMethod_AttendStream<
    v1::Attention::WithCallbackMethod_CreateSession<
    v1::Attention::WithRawCallbackMethod_Step<
    v1::Attention::WithRawCallbackMethod_BatchStep<
    v1::Attention::WithCallbackMethod_TruncateSession<
    v1::Attention::WithCallbackMethod_ForkSession<
    v1::Attention::WithCallbackMethod_CloseSession<
    v1::Attention::WithCallbackMethod_GetServerInfo<
    v1::Attention::WithRawCallbackMethod_Echo<
    v1::Attention::WithCallbackMethod_ImportSession<v1::Attention::Service>>>>>>>>>>>;

// Attend and AttendStream are raw methods (grpc::ByteBuffer in and out): their tensors go from
// gRPC's received slices into the backend's staging with one copy, and their outputs back out as
// slices of the memory the backend brought them back into (attend_request_decoder.h,
// response_encoder.h). Echo is raw too: its answer is the request's own slices (echo_wire.h), so
// that it measures the transport alone. Step and BatchStep are raw too: each step's tensors stay
// in the received slices (step_request_decoder.h) until the step pipeline copies them, once,
// into its launch's staging, and each output is sent from the launch's output staging
// (docs/STEP_PATH.md). The bytes on the wire are protobuf's, as for every other method.
class AttentionService final : public AttentionCallbackBase {
 public:
  struct Options {
    RequestLimits limits;
    v1::ServerLimits advertised_limits;
    std::string version;
    // Bearer tokens every attn.v1 call must carry (checked before anything else); null: none.
    // Must outlive the service.
    const Authenticator* authenticator = nullptr;
    // Most pending Attend calls plus in-flight AttendStream items per client identity (its
    // token when tokens are on, else its peer host); 0: unlimited.
    int64_t max_pending_per_client = 0;
    // Shared-memory regions requests may name (Tensor.region, o_region); null: shared memory
    // is off. Must outlive the service.
    const RegionRegistry* regions = nullptr;
    // false: unary Attend parses and serializes whole messages with protobuf, as the generated
    // method would (two host copies of the tensors each way), and so does Echo (a copy into the
    // request's string, one into the response's, one into fresh slices); for measuring the wire
    // path.
    bool attend_wire_path = true;
    // The KV region sessions are imported into (ImportSession) and the step device whose copies
    // reach it (null: the region is host memory, copied with memcpy). Must outlive the service.
    KvRegion kv_region;
    const StepDevice* kv_device = nullptr;
    // Hand-off on drain (--handoff_peers): while draining, session steps are still taken until
    // their session moves (it then answers where it went) instead of UNAVAILABLE at once.
    bool handoff_on_drain = false;
    // A BatchStep's steps go to the batcher in chunks of this many as their jobs are made (an
    // idle lane stages the first chunk's launch while the handler makes the next chunk's jobs;
    // chunks that meet busy lanes are gathered again); 0: all at once.
    int64_t batch_step_chunk = 32;
  };
  // batcher, backend, metrics and sessions must outlive the service; sessions may be null (the
  // session RPCs then answer UNIMPLEMENTED).
  AttentionService(Options options, Batcher* batcher, Backend* backend, Metrics* metrics,
                   SessionManager* sessions = nullptr);

  // New calls (and new AttendStream items) get UNAVAILABLE from now on; calls already accepted
  // complete.
  void StartDraining() { draining_.store(true); }
  // Steps are refused (UNAVAILABLE) while draining, unless their sessions are handed off: they
  // then go on until their session moves.
  bool RefuseSteps() const { return draining_.load() && !options_.handoff_on_drain; }
  // True when no call (nor AttendStream item) has arrived or been answered after t. An answer
  // counts: its client's next call is about to come and must find the listener still open.
  bool QuietSince(Clock::time_point t) const {
    return last_activity_ns_.load() <= t.time_since_epoch().count();
  }
  // Restarts the quiet period of QuietSince, as an answer does: once sessions have moved, their
  // callers get a whole --drain_quiet_ms to hear where, however long the move took.
  void RestartQuietPeriod() { OnCallAnswered(); }
  // The end of a drain's lame-duck phase: every open AttendStream finishes with UNAVAILABLE once
  // its items in flight are answered (a stream left open would otherwise be cancelled by gRPC's
  // Shutdown when drain_timeout runs out); streams opened later are refused the same way.
  void EndOpenStreams();
  // Returns once every AttendStream has run its OnDone (after the gRPC server's Wait): the
  // service, the batcher and the metrics the streams use may then be destroyed.
  void WaitForStreamsDone();
  // Handlers that reach the batcher or the sessions end with HandlerReturns; the server's
  // teardown, once the gRPC server's Wait has returned (after every handler), calls
  // AfterHandlers. They mark that ordering, which gRPC keeps, for TSan (tsan_annotations.h).
  void HandlerReturns() { HandOffToGrpc(this); }
  void AfterHandlers() { TakeBackFromGrpc(this); }
  // Requests currently counted against max_pending_per_client, over all clients.
  int64_t PendingPerClientTotal() const { return pending_.TotalPending(); }

  // request's bytes are taken (it is left empty) before the call's answer is sent.
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const v1::CreateSessionRequest* request,
                                          v1::CreateSessionResponse* response) override;
  // Step and BatchStep take request's bytes (it is left empty) before the call is answered.
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* BatchStep(grpc::CallbackServerContext* ctx,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* ctx,
                                            const v1::TruncateSessionRequest* request,
                                            v1::TruncateSessionResponse* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* ctx,
                                        const v1::ForkSessionRequest* request,
                                        v1::ForkSessionResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  // session_import.cc.
  grpc::ServerReadReactor<v1::SessionTransferChunk>* ImportSession(
      grpc::CallbackServerContext* ctx, v1::ImportSessionResponse* response) override;

 private:
  // Finishes a unary call and records it.
  void FinishUnary(grpc::ServerUnaryReactor* reactor, Rpc rpc, Clock::time_point start,
                   const absl::Status& st, int64_t received, int64_t sent);
  grpc::ServerUnaryReactor* Unimplemented(grpc::CallbackServerContext* ctx, Rpc rpc,
                                          int64_t received);
  // attn_step_phase_duration_seconds{phase}: the time from `since` to now.
  void ObserveStepPhase(StepPhase phase, Clock::time_point since) {
    if (metrics_) metrics_->ObserveStepPhase(phase, Seconds(Clock::now() - since));
  }
  // The caller's identity for the per-client limit ("token:<i>" or its peer host), or
  // UNAUTHENTICATED when tokens are on and the call has no valid one.
  absl::StatusOr<std::string> Identify(const grpc::CallbackServerContext* ctx) const;
  // Validates request and queues it, counted against client's pending limit; on success
  // `on_done` runs once the response is filled (the count is released just before).
  absl::Status SubmitAttend(grpc::CallbackServerContext* ctx, const std::string& client,
                            const v1::AttendRequest* request,
                            v1::AttendResponse* response, Clock::time_point arrival,
                            std::function<void(absl::Status)> on_done);
  // The same for a request decoded from the wire (call: attention_service.cc's WireAttendCall,
  // which must live until on_done has run): its tensors are staged by the backend, its outputs
  // written into the call's buffers.
  absl::Status SubmitWireAttend(grpc::CallbackServerContext* ctx, const std::string& client,
                                WireAttendCall* call, Clock::time_point arrival,
                                std::function<void(absl::Status)> on_done);
  // What both share once the job is validated: region resolution, the pending count, `stage`
  // (null, or the wire path's copy of the inputs), the backend's Prepare, the batcher.
  absl::Status SubmitJob(grpc::CallbackServerContext* ctx, const std::string& client,
                         std::unique_ptr<AttendJob> job, const v1::AttendRequest& request,
                         v1::AttendResponse* response, Clock::time_point arrival,
                         const std::function<absl::Status(AttendJob&)>& stage,
                         std::function<void(absl::Status)> on_done);
  // Attend on the wire path, and (Options::attend_wire_path false) through protobuf messages.
  // Both take request's bytes, leaving it empty, and finish the call.
  void AttendWire(grpc::CallbackServerContext* ctx, grpc::ServerUnaryReactor* reactor,
                  const std::string& client, Clock::time_point arrival,
                  grpc::ByteBuffer* request, grpc::ByteBuffer* response);
  void AttendProto(grpc::CallbackServerContext* ctx, grpc::ServerUnaryReactor* reactor,
                   const std::string& client, Clock::time_point arrival,
                   grpc::ByteBuffer* request, grpc::ByteBuffer* response);
  // Echo's answer to request (whose bytes are taken) on the wire path, and through protobuf
  // messages.
  static absl::Status EchoWire(grpc::ByteBuffer* request, grpc::ByteBuffer* response);
  static absl::Status EchoProto(grpc::ByteBuffer* request, grpc::ByteBuffer* response);

  // Session RPCs (session_rpcs.cc). The owner of the caller's sessions: its identity when
  // tokens are on, else "" (everyone).
  std::string SessionOwner(const std::string& client) const {
    return options_.authenticator != nullptr ? client : std::string();
  }
  // What every step of one Step or BatchStep call shares, worked out once per call.
  struct StepCallScope {
    grpc::CallbackServerContext* ctx;
    std::string owner;           // SessionOwner of the caller
    StepRegions regions;         // where its steps' region slices are looked up
    Clock::time_point arrival;
    Clock::time_point deadline;  // the call's, on the steady clock
  };
  StepCallScope MakeStepCallScope(grpc::CallbackServerContext* ctx, const std::string& client,
                                  Clock::time_point arrival) const;
  // Looks up (as the scope's owner's) and validates item `item` of call and makes its job, whose
  // done fills the item's answer and runs on_done after giving the layer back (the job holds the
  // layer once started, see StartSteps).
  absl::StatusOr<std::unique_ptr<StepJob>> MakeStepJob(const StepCallScope& scope,
                                                       std::shared_ptr<WireStepCall> call,
                                                       size_t item,
                                                       std::function<void(absl::Status)> on_done);
  // Queues each job after the earlier steps of its (session, layer): those whose layer is free
  // go to the batcher together (one launch where their keys agree), the others when their turn
  // comes.
  void EnqueueSteps(std::vector<std::unique_ptr<StepJob>> jobs);
  // Submits jobs that hold their layers; a job the batcher refuses is completed with the error.
  void StartSteps(std::vector<std::unique_ptr<StepJob>> jobs);
  // replica_id and kv_cache of GetServerInfo.
  void FillSessionInfo(v1::GetServerInfoResponse* response) const;

  // Adds the trailing metadata key of a moved session (session_moves.h) when st says it moved.
  static void AddMovedTo(grpc::CallbackServerContext* ctx, const absl::Status& st);

  friend class AttendStreamReactor;
  friend class SessionImportReactor;
  friend class RejectedStreamReactor;

  // Open AttendStreams, for EndOpenStreams. Register returns true when streams are already being
  // ended (the new stream must finish at once).
  bool RegisterStream(AttendStreamReactor* stream);
  void UnregisterStream(AttendStreamReactor* stream);
  // Streams refused at once (RejectedStreamReactor) are counted, not registered.
  void StreamOpened();
  void StreamClosed();
  void StreamClosedLocked();

  const Options options_;
  Batcher* const batcher_;
  Backend* const backend_;
  Metrics* const metrics_;
  SessionManager* const sessions_;
  // Where every handler (and every AttendStream item) starts: takes the service over from gRPC's
  // thread (for TSan, tsan_annotations.h) and records the arrival (for QuietSince).
  void OnCallArrived(Clock::time_point t) {
    TakeBackFromGrpc(this);
    last_activity_ns_.store(t.time_since_epoch().count());
  }
  // Every answer (unary status or AttendStream item), for QuietSince.
  void OnCallAnswered() { last_activity_ns_.store(Clock::now().time_since_epoch().count()); }

  std::atomic<bool> draining_{false};
  std::atomic<Clock::rep> last_activity_ns_{0};
  PendingLimiter pending_;
  std::mutex streams_mu_;
  std::unordered_set<AttendStreamReactor*> streams_;  // guarded by streams_mu_
  int64_t open_streams_ = 0;                          // streams whose OnDone has not run
  std::condition_variable streams_done_;              // open_streams_ reached zero
  bool ending_streams_ = false;                       // guarded by streams_mu_
};

}  // namespace attn
