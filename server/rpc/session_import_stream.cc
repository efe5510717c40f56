#include "rpc/session_import_stream.h"

#include <functional>
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
  header.shared_pages.assign(h.shared_pages().begin(), h.shared_pages().end());
  return header;
}

}  // namespace

SessionImportStream::SessionImportStream(Target target, std::string owner)
    : target_(std::move(target)), owner_(std::move(owner)) {}

// Importers go first (in reverse), each giving back its references, then the stream's numbering.
SessionImportStream::~SessionImportStream() {
  while (!importers_.empty()) importers_.pop_back();
}

absl::Status SessionImportStream::TakeHeader(const v1::SessionTransferHeader& h) {
  ASSIGN_OR_RETURN(SessionTransferHeader header, HeaderFromWire(h, target_.fp8));
  if (source_ids_.empty()) source_id_ = h.source_session_id();
  header.owner = owner_;
  RETURN_IF_ERROR(target_.sessions->CheckImport(header.shape,
                                                static_cast<int64_t>(importers_.size())));
  ASSIGN_OR_RETURN(std::unique_ptr<SessionImporter> importer,
                   SessionImporter::Create(std::move(header), &target_.sessions->pool(),
                                           target_.kv_region, target_.kv_device, &stream_pages_));
  importers_.push_back(std::move(importer));
  source_ids_.push_back(h.source_session_id());
  return absl::OkStatus();
}

absl::Status SessionImportStream::Take(v1::SessionTransferChunk& chunk) {
  SessionImporter* last = importers_.empty() ? nullptr : importers_.back().get();
  if (last == nullptr) {
    if (!chunk.has_header()) {
      return absl::InvalidArgumentError("ImportSession: the first chunk must be the header");
    }
    return TakeHeader(chunk.header());
  }
  const int64_t missing = last->expected() - last->received();
  if (chunk.has_header() && missing == 0) return TakeHeader(chunk.header());
  if (!chunk.has_page()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ImportSession: every chunk after the header is a page until the ", last->expected(),
        " pages its layer_pages announce have come (", missing, " to come)",
        chunk.has_header() ? "; then the header of the next session of a fork family may follow"
                           : ""));
  }
  SessionTransferPage page;
  page.index = chunk.page().index();
  page.kv = std::move(*chunk.mutable_page()->mutable_kv());
  page.crc32c = chunk.page().crc32c();
  RETURN_IF_ERROR(last->Accept(page));
  ++pages_;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::shared_ptr<Session>>> SessionImportStream::Complete() {
  if (importers_.empty()) return absl::InvalidArgumentError("ImportSession: no header");
  const SessionImporter& last = *importers_.back();
  if (last.received() != last.expected()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ImportSession: the stream ended after ", last.received(), " of the ", last.expected(),
        " pages the header's layer_pages announce"));
  }
  std::vector<std::function<absl::StatusOr<std::unique_ptr<Session>>(std::string)>> finish;
  for (const auto& importer : importers_) {
    SessionImporter* i = importer.get();
    finish.push_back([i](std::string id) { return i->Finish(std::move(id)); });
  }
  return target_.sessions->AddImported(finish, source_ids_);
}

}  // namespace attn
