// ImportSession: the receiving side of a session's hand-off (attention.proto). One chunk is read
// at a time and the next read starts only once it has been checked and written into its page, so
// a transfer holds one page in memory here (gRPC's flow control holds the sender back meanwhile).
// The session is created only after the last page, with its owner the identity of the caller's
// token; every failure before that frees the pages taken. The chunks themselves are checked by
// SessionImportStream.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "common/tsan_annotations.h"
#include "observability/metrics.h"
#include "rpc/attention_service.h"
#include "rpc/grpc_status.h"
#include "rpc/session_import_stream.h"
#include "sessions/session_manager.h"

namespace attn {

// Owns itself from its creation until OnDone.
class SessionImportReactor : public grpc::ServerReadReactor<v1::SessionTransferChunk> {
 public:
  SessionImportReactor(AttentionService* service, grpc::CallbackServerContext* ctx,
                       v1::ImportSessionResponse* response)
      : service_(service), ctx_(ctx), response_(response), start_(Clock::now()) {
    absl::Status st = Admit();
    if (!st.ok()) {
      End(st);
      return;
    }
    ReadNext();
  }

  // gRPC runs each reaction after the call into it that asked for it (StartRead, Finish), on
  // another of its threads: the hand-off marks show TSan that ordering (tsan_annotations.h).
  void OnReadDone(bool ok) override {
    TakeBackFromGrpc(this);
    service_->OnCallArrived(Clock::now());
    if (!ok) {
      End(Complete());
      return;
    }
    received_ += static_cast<int64_t>(chunk_.ByteSizeLong());
    absl::Status st = stream_->Take(chunk_);
    if (!st.ok()) {
      End(st);
      return;
    }
    ReadNext();
  }

  void OnDone() override {
    TakeBackFromGrpc(this);
    service_->HandlerReturns();
    delete this;
  }

 private:
  using Clock = std::chrono::steady_clock;

  void ReadNext() {
    HandOffToGrpc(this);
    StartRead(&chunk_);
  }

  // Who may import, and whether this replica can.
  absl::Status Admit() {
    ASSIGN_OR_RETURN(std::string client, service_->Identify(ctx_));
    if (service_->sessions_ == nullptr) {
      return absl::UnimplementedError("this attnd has no KV cache region: it takes no sessions");
    }
    SessionImportStream::Target target;
    target.sessions = service_->sessions_;
    target.kv_region = service_->options_.kv_region;
    target.kv_device = service_->options_.kv_device;
    target.fp8 = service_->options_.limits.fp8;
    stream_ = std::make_unique<SessionImportStream>(std::move(target),
                                                    service_->SessionOwner(client));
    return absl::OkStatus();
  }

  // The sender closed its side: the session is made when every page came.
  absl::Status Complete() {
    if (ctx_->IsCancelled()) return absl::CancelledError("ImportSession: the sender went away");
    ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Session>> made, stream_->Complete());
    response_->set_session_id(made.front()->id());
    for (const auto& s : made) response_->add_session_ids(s->id());
    response_->set_replica_id(service_->sessions_->options().replica_id);
    response_->set_pages(stream_->pages());
    return absl::OkStatus();
  }

  void End(const absl::Status& st) {
    const std::string source_id = stream_ ? stream_->source_id() : "";
    stream_.reset();  // pages not handed to a session go back now
    const absl::Status out =
        st.ok() || source_id.empty()
            ? st
            : absl::Status(st.code(), absl::StrCat(st.message(), " (importing ", source_id, ")"));
    service_->OnCallAnswered();
    if (service_->metrics_) {
      service_->metrics_->ObserveRequest(
          Rpc::kImportSession, out.code(),
          std::chrono::duration<double>(Clock::now() - start_).count(), received_,
          out.ok() ? static_cast<int64_t>(response_->ByteSizeLong()) : 0);
    }
    HandOffToGrpc(this);
    Finish(ToGrpcStatus(out));
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::ImportSessionResponse* const response_;
  const Clock::time_point start_;
  v1::SessionTransferChunk chunk_;
  std::unique_ptr<SessionImportStream> stream_;  // from Admit until End
  int64_t received_ = 0;
};

grpc::ServerReadReactor<v1::SessionTransferChunk>* AttentionService::ImportSession(
    grpc::CallbackServerContext* ctx, v1::ImportSessionResponse* response) {
  OnCallArrived(Clock::now());
  return new SessionImportReactor(this, ctx, response);
}

}  // namespace attn
