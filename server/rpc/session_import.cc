// ImportSession: the receiving side of a session's hand-off (attention.proto). One chunk is read
// at a time and the next read starts only once it has been checked and written into its page, so
// a transfer holds one page in memory here (gRPC's flow control holds the sender back meanwhile).
// The session is created only after the last page, with its owner the identity of the caller's
// token; every failure before that frees the pages taken (SessionImporter).
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "common/tsan_annotations.h"
#include "observability/metrics.h"
#include "rpc/attention_service.h"
#include "rpc/grpc_status.h"
#include "rpc/step_validation.h"
#include "sessions/session_manager.h"
#include "sessions/session_transfer.h"

namespace attn {
namespace {

// The session's cache type and scales, checked as CreateSession checks them (fp8: what this
// replica's backend offers).
absl::Status CacheFromWire(const v1::SessionTransferHeader& h, const Fp8Features& fp8,
                           SessionShape* shape) {
  v1::CreateSessionRequest as_created;
  as_created.set_dtype(h.dtype());
  as_created.set_head_dim(h.head_dim());
  as_created.set_cache_dtype(h.cache_dtype());
  *as_created.mutable_k_scales() = h.k_scales();
  *as_created.mutable_v_scales() = h.v_scales();
  SessionManager::CreateParams p;
  RETURN_IF_ERROR(SessionCacheParams(as_created, fp8, &p));
  shape->cache_dtype = p.cache_dtype;
  shape->k_scales = std::move(p.k_scales);
  shape->v_scales = std::move(p.v_scales);
  return absl::OkStatus();
}

absl::StatusOr<SessionTransferHeader> HeaderFromWire(const v1::SessionTransferHeader& h,
                                                     const Fp8Features& fp8) {
  SessionTransferHeader header;
  header.shape.num_layers = h.num_layers();
  header.shape.num_kv_heads = h.num_kv_heads();
  header.shape.head_dim = h.head_dim();
  ASSIGN_OR_RETURN(header.shape.dtype, SessionDType(h.dtype()));
  header.shape.max_tokens = h.max_tokens();
  header.shape.page_tokens = h.page_tokens();
  header.shape.page_span = h.page_span();
  RETURN_IF_ERROR(CacheFromWire(h, fp8, &header.shape));
  header.page_bytes = h.page_bytes();
  header.layer_tokens.assign(h.layer_tokens().begin(), h.layer_tokens().end());
  header.layer_pages.assign(h.layer_pages().begin(), h.layer_pages().end());
  return header;
}

}  // namespace

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
    absl::Status st = Take();
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
    owner_ = service_->SessionOwner(client);
    if (service_->sessions_ == nullptr) {
      return absl::UnimplementedError("this attnd has no KV cache region: it takes no sessions");
    }
    return absl::OkStatus();
  }

  absl::Status Take() {
    if (importer_ == nullptr) {
      if (!chunk_.has_header()) {
        return absl::InvalidArgumentError("ImportSession: the first chunk must be the header");
      }
      ASSIGN_OR_RETURN(SessionTransferHeader header, HeaderFromWire(chunk_.header(), service_->options_.limits.fp8));
      source_id_ = chunk_.header().source_session_id();
      header.owner = owner_;
      RETURN_IF_ERROR(service_->sessions_->CheckImport(header.shape));
      ASSIGN_OR_RETURN(importer_,
                       SessionImporter::Create(std::move(header), &service_->sessions_->pool(),
                                               service_->options_.kv_region,
                                               service_->options_.kv_device));
      return absl::OkStatus();
    }
    if (!chunk_.has_page()) {
      return absl::InvalidArgumentError("ImportSession: every chunk after the header is a page");
    }
    SessionTransferPage page;
    page.index = chunk_.page().index();
    page.kv = std::move(*chunk_.mutable_page()->mutable_kv());
    page.crc32c = chunk_.page().crc32c();
    RETURN_IF_ERROR(importer_->Accept(page));
    ++pages_;
    return absl::OkStatus();
  }

  // The sender closed its side: the session is made when every page came.
  absl::Status Complete() {
    if (ctx_->IsCancelled()) return absl::CancelledError("ImportSession: the sender went away");
    if (importer_ == nullptr) return absl::InvalidArgumentError("ImportSession: no header");
    SessionImporter* importer = importer_.get();
    ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                     service_->sessions_->AddImported(
                         [importer](std::string id) { return importer->Finish(std::move(id)); }));
    response_->set_session_id(s->id());
    response_->set_replica_id(service_->sessions_->options().replica_id);
    response_->set_pages(pages_);
    return absl::OkStatus();
  }

  void End(const absl::Status& st) {
    importer_.reset();  // pages not handed to a session go back now
    const absl::Status out =
        st.ok() || source_id_.empty()
            ? st
            : absl::Status(st.code(), absl::StrCat(st.message(), " (importing ", source_id_, ")"));
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
  std::string owner_;
  std::string source_id_;
  std::unique_ptr<SessionImporter> importer_;
  int64_t pages_ = 0;
  int64_t received_ = 0;
};

grpc::ServerReadReactor<v1::SessionTransferChunk>* AttentionService::ImportSession(
    grpc::CallbackServerContext* ctx, v1::ImportSessionResponse* response) {
  OnCallArrived(Clock::now());
  return new SessionImportReactor(this, ctx, response);
}

}  // namespace attn
