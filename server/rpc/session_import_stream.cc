#include "rpc/session_import_stream.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "rpc/step_validation.h"
#include "sessions/session_manager.h"

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

SessionImportStream::SessionImportStream(Target target, std::string owner)
    : target_(std::move(target)), owner_(std::move(owner)) {}

SessionImportStream::~SessionImportStream() = default;  // importer_ gives back its pages

absl::Status SessionImportStream::TakeHeader(const v1::SessionTransferHeader& h) {
  ASSIGN_OR_RETURN(SessionTransferHeader header, HeaderFromWire(h, target_.fp8));
  source_id_ = h.source_session_id();
  header.owner = owner_;
  RETURN_IF_ERROR(target_.sessions->CheckImport(header.shape));
  ASSIGN_OR_RETURN(importer_, SessionImporter::Create(std::move(header),
                                                      &target_.sessions->pool(),
                                                      target_.kv_region, target_.kv_device));
  return absl::OkStatus();
}

absl::Status SessionImportStream::Take(v1::SessionTransferChunk& chunk) {
  if (importer_ == nullptr) {
    if (!chunk.has_header()) {
      return absl::InvalidArgumentError("ImportSession: the first chunk must be the header");
    }
    return TakeHeader(chunk.header());
  }
  if (!chunk.has_page()) {
    return absl::InvalidArgumentError("ImportSession: every chunk after the header is a page");
  }
  SessionTransferPage page;
  page.index = chunk.page().index();
  page.kv = std::move(*chunk.mutable_page()->mutable_kv());
  page.crc32c = chunk.page().crc32c();
  RETURN_IF_ERROR(importer_->Accept(page));
  ++pages_;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionImportStream::Complete() {
  if (importer_ == nullptr) return absl::InvalidArgumentError("ImportSession: no header");
  if (importer_->received() != importer_->expected()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ImportSession: the stream ended after ", importer_->received(), " of the ",
        importer_->expected(), " pages the header's layer_pages announce"));
  }
  SessionImporter* importer = importer_.get();
  return target_.sessions->AddImported(
      [importer](std::string id) { return importer->Finish(std::move(id)); });
}

}  // namespace attn
