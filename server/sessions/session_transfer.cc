#include "sessions/session_transfer.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "sessions/crc32c.h"

namespace attn {
namespace {

// Byte offset of a session page (a run of span pool pages) in the region's key or value half.
int64_t PageOffset(int32_t run, const SessionShape& shape, const KvRegion& region) {
  return int64_t{run} * shape.page_span * region.page_bytes;
}

// shared_pages names pages the stream has, of this session's page layout.
absl::Status CheckSharedPages(const SessionTransferHeader& header, const StreamPages& stream) {
  if (header.shared_pages.empty()) return absl::OkStatus();
  const int64_t total = header.TotalPages();
  if (static_cast<int64_t>(header.shared_pages.size()) != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session transfer: shared_pages must have one entry per page of the tables (", total,
        "), got ", header.shared_pages.size()));
  }
  const auto sent = static_cast<int64_t>(stream.runs.size());
  for (size_t i = 0; i < header.shared_pages.size(); ++i) {
    const int64_t k = header.shared_pages[i];
    if (k < 0 || k > sent) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session transfer: shared_pages[", i, "] = ", k, " names no page sent before it (",
          sent, " were) in this stream"));
    }
    if (k > 0 && stream.spans[k - 1] != header.shape.page_span) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session transfer: shared_pages[", i, "] names a page of page_span ", stream.spans[k - 1],
          ", this session's page_span is ", header.shape.page_span));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SessionTransferHeader::TotalPages() const {
  int64_t n = 0;
  for (int64_t p : layer_pages) n += p;
  return n;
}

int64_t SessionTransferHeader::OwnPages() const {
  if (shared_pages.empty()) return TotalPages();
  int64_t n = 0;
  for (int64_t k : shared_pages) n += k == 0;
  return n;
}

absl::StatusOr<std::unique_ptr<SessionExporter>> SessionExporter::Create(
    const Session& session, KvPagePool* pool, KvRegion region, const StepDevice* device,
    StreamPages* stream) {
  ASSIGN_OR_RETURN(std::vector<Session::LayerState> layers, session.RefLayerStates());
  SessionTransferHeader header;
  header.shape = session.shape();
  header.owner = session.owner();
  header.page_bytes = int64_t{session.shape().page_span} * region.page_bytes;
  StreamPages own_stream;
  StreamPages& numbering = stream != nullptr ? *stream : own_stream;
  std::vector<OwnPage> own;
  bool shares = false;
  for (const Session::LayerState& l : layers) {
    header.layer_tokens.push_back(l.tokens);
    header.layer_pages.push_back(static_cast<int64_t>(l.pages.size()));
    for (int32_t run : l.pages) {
      auto [it, is_new] =
          numbering.index_of.emplace(run, static_cast<int64_t>(numbering.index_of.size()));
      if (is_new) own.push_back({run, it->second});
      header.shared_pages.push_back(is_new ? 0 : it->second + 1);
      shares |= !is_new;
    }
  }
  if (!shares) header.shared_pages.clear();
  return std::unique_ptr<SessionExporter>(new SessionExporter(
      std::move(header), std::move(layers), std::move(own), pool, region, device));
}

SessionExporter::SessionExporter(SessionTransferHeader header,
                                 std::vector<Session::LayerState> layers, std::vector<OwnPage> own,
                                 KvPagePool* pool, KvRegion region, const StepDevice* device)
    : header_(std::move(header)),
      layers_(std::move(layers)),
      own_(std::move(own)),
      pool_(pool),
      region_(region),
      device_(device) {}

absl::Status SessionExporter::Read(char* host, const char* kv, size_t bytes) const {
  if (device_ != nullptr) return device_->ReadKv(host, kv, bytes);
  std::memcpy(host, kv, bytes);
  return absl::OkStatus();
}

SessionExporter::~SessionExporter() {
  for (const Session::LayerState& l : layers_) pool_->Unref(l.pages, header_.shape.page_span);
}

std::optional<SessionTransferPage> SessionExporter::Next() {
  if (next_ >= own_.size() || !status_.ok()) return std::nullopt;
  const OwnPage& own = own_[next_++];
  const int64_t offset = PageOffset(own.run, header_.shape, region_);
  SessionTransferPage page;
  page.index = own.index;
  page.kv.resize(static_cast<size_t>(2 * header_.page_bytes));
  const auto n = static_cast<size_t>(header_.page_bytes);
  status_ = Read(page.kv.data(), region_.k + offset, n);
  if (status_.ok()) status_ = Read(page.kv.data() + n, region_.v + offset, n);
  if (!status_.ok()) return std::nullopt;
  page.crc32c = Crc32c(page.kv);
  return page;
}

absl::StatusOr<std::unique_ptr<SessionImporter>> SessionImporter::Create(
    SessionTransferHeader header, KvPagePool* pool, KvRegion region, const StepDevice* device,
    StreamPages* stream) {
  const SessionShape& shape = header.shape;
  if (shape.num_layers <= 0 || shape.page_tokens <= 0 || shape.page_span <= 0) {
    return absl::InvalidArgumentError("session transfer: shape has no layers or no page layout");
  }
  if (header.layer_tokens.size() != static_cast<size_t>(shape.num_layers) ||
      header.layer_pages.size() != static_cast<size_t>(shape.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session transfer: layer_tokens and layer_pages must have num_layers (",
                     shape.num_layers, ") entries"));
  }
  if (header.page_bytes != int64_t{shape.page_span} * region.page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session transfer: page_bytes ", header.page_bytes, " does not match this replica's ",
        int64_t{shape.page_span} * region.page_bytes, " (page_span ", shape.page_span, ")"));
  }
  if (shape.RowBytes() * shape.page_tokens > header.page_bytes) {
    return absl::InvalidArgumentError("session transfer: page_tokens rows exceed a page");
  }
  for (int32_t l = 0; l < shape.num_layers; ++l) {
    const int64_t tokens = header.layer_tokens[l];
    if (tokens < 0 || (shape.max_tokens > 0 && tokens > shape.max_tokens) ||
        header.layer_pages[l] != (tokens + shape.page_tokens - 1) / shape.page_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session transfer: layer ", l, " has ", tokens, " tokens in ", header.layer_pages[l],
          " pages"));
    }
  }
  StreamPages own_stream;
  StreamPages& numbering = stream != nullptr ? *stream : own_stream;
  RETURN_IF_ERROR(CheckSharedPages(header, numbering));
  std::vector<int32_t> taken;
  RETURN_IF_ERROR(pool->Allocate(header.OwnPages(), &taken, shape.page_span));
  // The tables: the pages taken, in order, where the page is the session's own; a page of the
  // stream, with one more reference, where it is shared.
  const int64_t first_index = static_cast<int64_t>(numbering.runs.size());
  const int64_t total = header.TotalPages();
  std::vector<int32_t> pages;
  std::vector<size_t> own;
  pages.reserve(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    const int64_t k = header.shared_pages.empty() ? 0 : header.shared_pages[i];
    if (k == 0) {
      own.push_back(pages.size());
      pages.push_back(taken[own.size() - 1]);
    } else {
      pages.push_back(numbering.runs[k - 1]);
      pool->Ref(std::span<const int32_t>(&pages.back(), 1), shape.page_span);
    }
  }
  numbering.runs.insert(numbering.runs.end(), taken.begin(), taken.end());
  numbering.spans.insert(numbering.spans.end(), taken.size(), shape.page_span);
  return std::unique_ptr<SessionImporter>(new SessionImporter(
      std::move(header), std::move(pages), std::move(own), first_index, pool, region, device));
}

SessionImporter::SessionImporter(SessionTransferHeader header, std::vector<int32_t> pages,
                                 std::vector<size_t> own, int64_t first_index, KvPagePool* pool,
                                 KvRegion region, const StepDevice* device)
    : header_(std::move(header)),
      pages_(std::move(pages)),
      own_(std::move(own)),
      first_index_(first_index),
      pool_(pool),
      region_(region),
      device_(device) {}

absl::Status SessionImporter::Write(char* kv, const char* host, size_t bytes) const {
  if (device_ != nullptr) return device_->WriteKv(kv, host, bytes);
  std::memcpy(kv, host, bytes);
  return absl::OkStatus();
}

SessionImporter::~SessionImporter() {
  if (!finished_) pool_->Unref(pages_, header_.shape.page_span);
}

absl::Status SessionImporter::Accept(const SessionTransferPage& page) {
  if (finished_ || received_ >= static_cast<int64_t>(own_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("session transfer: page index ", page.index, " after all ", own_.size(),
                     " pages the header's layer_pages announce"));
  }
  if (page.index != first_index_ + received_) {
    return absl::InvalidArgumentError(absl::StrCat("session transfer: page index ", page.index,
                                                   " where ", first_index_ + received_,
                                                   " was expected"));
  }
  if (static_cast<int64_t>(page.kv.size()) != 2 * header_.page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session transfer: page ", page.index, "'s kv has ", page.kv.size(), " bytes, not ",
        2 * header_.page_bytes, " (2 x page_bytes)"));
  }
  if (Crc32c(page.kv) != page.crc32c) {
    return absl::DataLossError(
        absl::StrCat("session transfer: page ", page.index,
                     "'s kv does not match its crc32c (CRC32C): damaged on the way"));
  }
  const int64_t offset = PageOffset(pages_[own_[received_]], header_.shape, region_);
  const auto n = static_cast<size_t>(header_.page_bytes);
  RETURN_IF_ERROR(Write(region_.k + offset, page.kv.data(), n));
  RETURN_IF_ERROR(Write(region_.v + offset, page.kv.data() + n, n));
  ++received_;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Session>> SessionImporter::Finish(std::string id) {
  if (finished_ || received_ != static_cast<int64_t>(own_.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session transfer: ", received_, " of ", own_.size(), " pages received"));
  }
  std::vector<Session::LayerState> layers(header_.layer_tokens.size());
  size_t next = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    layers[l].tokens = header_.layer_tokens[l];
    const auto n = static_cast<size_t>(header_.layer_pages[l]);
    layers[l].pages.assign(pages_.begin() + next, pages_.begin() + next + n);
    next += n;
  }
  auto session = std::make_unique<Session>(std::move(id), header_.owner, header_.shape, pool_);
  session->AdoptLayers(std::move(layers));
  finished_ = true;
  return session;
}

}  // namespace attn
