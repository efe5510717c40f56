#include "import_fuzz.h"

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/v1/attention.pb.h"
#include "rpc/session_import_stream.h"
#include "session_fuzz.h"
#include "sessions/crc32c.h"
#include "sessions/session_manager.h"
#include "sessions/session_transfer.h"

namespace attn::fuzz {
namespace {

constexpr int kMaxRecords = 64;
constexpr int kMaxStreams = 8;

bool AnImportMayAnswer(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kFailedPrecondition:
      return true;
    default:
      return false;
  }
}

// n bytes of finite float16/bfloat16 values (the exponent never all ones), a pattern of fill's.
std::string FinitePageBytes(size_t n, uint32_t fill) {
  std::string out(n, '\0');
  uint32_t x = fill * 2654435761u + 11;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    const uint8_t r = static_cast<uint8_t>(x >> 24);
    out[i] = static_cast<char>(i % 2 == 1 ? (r & 0x80) | (r & 0x3b) : r);
  }
  return out;
}

// One ImportSession stream and what the sender has had accepted so far.
class Stream {
 public:
  Stream(SessionEngine& e, Outcome* out)
      : e_(e),
        out_(out),
        free_before_(e.pool->FreePages()),
        sessions_before_(e.manager->OpenSessions()),
        stream_(std::make_unique<SessionImportStream>(Target(e), "")) {}

  bool done() const { return done_; }

  void Chunk(v1::SessionTransferChunk chunk) {
    const bool header = chunk.has_header();
    const std::string kv = chunk.has_page() ? chunk.page().kv() : "";
    const absl::Status st = stream_->Take(chunk);
    if (!st.ok()) return Refused(st);
    if (header) {
      headers_.push_back(chunk.header());
    } else {
      sent_.push_back(kv);
      sent_span_ += headers_.back().page_span();
    }
  }

  void Page(const uint8_t* p, size_t len) {
    if (len < 4) return;
    int8_t index_delta;
    int16_t size_delta;
    std::memcpy(&index_delta, p, 1);
    std::memcpy(&size_delta, p + 1, 2);
    uint32_t fill = 0;
    std::memcpy(&fill, p + 4, std::min<size_t>(len - 4, 4));
    const int64_t page_bytes =
        headers_.empty() ? SessionEngine::kPageBytes : headers_.back().page_bytes();
    const int64_t bytes = std::max<int64_t>(0, 2 * page_bytes + size_delta);
    v1::SessionTransferChunk chunk;
    chunk.mutable_page()->set_index(static_cast<int64_t>(sent_.size()) + index_delta);
    std::string kv = FinitePageBytes(static_cast<size_t>(bytes), fill);
    chunk.mutable_page()->set_crc32c(Crc32c(kv) ^ p[3]);
    chunk.mutable_page()->set_kv(std::move(kv));
    Chunk(std::move(chunk));
  }

  // The sender went away: nothing may stay behind.
  void Drop() {
    stream_.reset();
    done_ = true;
    ExpectAsBefore("a dropped stream");
  }

  // The sender closed its side.
  void End() {
    absl::StatusOr<std::vector<std::shared_ptr<Session>>> made = stream_->Complete();
    if (!made.ok()) return Refused(made.status());
    stream_.reset();
    done_ = true;
    if (made->size() != headers_.size()) {
      Violation(absl::StrCat(headers_.size(), " headers made ", made->size(), " sessions"));
    }
    Check(*made);
    for (auto& s : *made) {
      const std::string id = s->id();
      s.reset();
      if (!e_.manager->Close(id, "").ok()) Violation("an imported session cannot be closed");
    }
    ExpectAsBefore("imported sessions, closed");
    if (out_->violation.empty()) out_->valid = out_->computed = true;
  }

 private:
  static SessionImportStream::Target Target(SessionEngine& e) {
    SessionImportStream::Target t;
    t.sessions = e.manager.get();
    t.kv_region = e.device->kv_region();
    t.kv_device = e.device.get();
    t.fp8 = e.backend->Info().fp8;
    return t;
  }

  void Violation(const std::string& what) {
    if (out_->violation.empty()) out_->violation = what;
  }

  void Refused(const absl::Status& st) {
    if (!AnImportMayAnswer(st.code())) {
      Violation(absl::StrCat("an import answered ", st.ToString()));
    } else if (st.message().empty()) {
      Violation("an import refused without a message");
    }
    Drop();
  }

  void ExpectAsBefore(const char* after) {
    if (e_.pool->FreePages() != free_before_) {
      Violation(absl::StrCat(after, " left ", free_before_ - e_.pool->FreePages(),
                             " pages taken"));
    }
    if (e_.manager->OpenSessions() != sessions_before_) {
      Violation(absl::StrCat(after, " left ", e_.manager->OpenSessions() - sessions_before_,
                             " sessions open"));
    }
  }

  // The bytes each page of the header's tables must hold: the stream's page it names, or its own
  // pages in the order they came (first: the stream index of its first own page).
  std::vector<const std::string*> Expected(const v1::SessionTransferHeader& h, size_t* first) {
    std::vector<const std::string*> table;
    int64_t total = 0;
    for (int64_t p : h.layer_pages()) total += p;
    for (int64_t i = 0; i < total; ++i) {
      const int64_t k = h.shared_pages().empty() ? 0 : h.shared_pages(static_cast<int>(i));
      const size_t at = k == 0 ? (*first)++ : static_cast<size_t>(k - 1);
      table.push_back(at < sent_.size() ? &sent_[at] : nullptr);
    }
    return table;
  }

  // Each session holds what its header said and the bytes sent, page for page, and the pool
  // counts each page sent once (shared ones as well).
  void Check(const std::vector<std::shared_ptr<Session>>& made) {
    if (e_.manager->OpenSessions() != sessions_before_ + static_cast<int64_t>(made.size())) {
      Violation("an accepted stream did not add exactly its sessions");
    }
    if (e_.pool->FreePages() != free_before_ - sent_span_) {
      Violation(absl::StrCat("the pool lost ", free_before_ - e_.pool->FreePages(),
                             " pages for the ", sent_span_, " pool pages sent"));
    }
    // Each page holds one reference per table entry naming it, over all the sessions.
    std::map<std::pair<int32_t, int32_t>, int32_t> entries;  // (run, span) -> table entries
    for (const auto& s : made) {
      for (int32_t run : s->TablePages()) ++entries[{run, s->shape().page_span}];
    }
    for (const auto& [page, n] : entries) {
      if (e_.pool->RefCount(page.first, page.second) != n) {
        Violation(absl::StrCat("page run ", page.first, " has ",
                               e_.pool->RefCount(page.first, page.second), " references for ",
                               n, " table entries"));
      }
    }
    size_t first = 0;
    for (size_t k = 0; k < made.size() && k < headers_.size(); ++k) {
      const Session& s = *made[k];
      const v1::SessionTransferHeader& h = headers_[k];
      for (int32_t l = 0; l < s.shape().num_layers; ++l) {
        if (l >= h.layer_tokens_size() || s.CachedTokens(l) != h.layer_tokens(l)) {
          Violation(absl::StrCat("session ", k, " layer ", l, " holds ", s.CachedTokens(l),
                                 " tokens, not the header's"));
        }
      }
      const std::vector<const std::string*> expected = Expected(h, &first);
      if (s.PagesHeld() != static_cast<int64_t>(expected.size()) * h.page_span()) {
        Violation(absl::StrCat("session ", k, " holds ", s.PagesHeld(), " pool pages, its tables ",
                               expected.size(), " of span ", h.page_span()));
      }
      // Read back in a stream of its own: pages it holds twice come once, named in the header.
      auto exporter =
          SessionExporter::Create(s, e_.pool.get(), e_.device->kv_region(), e_.device.get());
      if (!exporter.ok()) {
        Violation(absl::StrCat("an imported session cannot be exported: ",
                               exporter.status().ToString()));
        return;
      }
      std::vector<std::string> own;
      for (auto page = (*exporter)->Next(); page; page = (*exporter)->Next()) {
        own.push_back(std::move(page->kv));
      }
      const std::vector<int64_t>& shared = (*exporter)->header().shared_pages;
      size_t next = 0;
      for (size_t i = 0; i < expected.size(); ++i) {
        const int64_t ref = shared.empty() ? 0 : shared[i];
        const size_t at = ref == 0 ? next++ : static_cast<size_t>(ref - 1);
        if (at >= own.size() || expected[i] == nullptr || own[at] != *expected[i]) {
          Violation(absl::StrCat("session ", k, " page ", i, " reads back other bytes than sent"));
          return;
        }
      }
    }
  }

  SessionEngine& e_;
  Outcome* const out_;
  const int64_t free_before_;
  const int64_t sessions_before_;
  std::unique_ptr<SessionImportStream> stream_;
  bool done_ = false;
  std::vector<v1::SessionTransferHeader> headers_;  // the headers the stream took
  std::vector<std::string> sent_;                   // the pages it took, in stream order
  int64_t sent_span_ = 0;                           // pool pages of them
};

}  // namespace

Outcome RunImportInput(const uint8_t* data, size_t size) {
  SessionEngine& e = SessionEngine::Get();
  Outcome out;
  out.parsed = true;
  std::unique_ptr<Stream> stream;
  int streams = 0;
  size_t at = 0;
  for (int records = 0; at + 3 <= size && records < kMaxRecords; ++records) {
    const uint8_t op = data[at];
    const size_t len = data[at + 1] | (size_t{data[at + 2]} << 8);
    at += 3;
    if (len > size - at) break;
    const uint8_t* payload = data + at;
    at += len;
    if (op >= static_cast<uint8_t>(ImportOp::kCount)) continue;
    if (stream == nullptr) {
      if (streams++ == kMaxStreams) break;
      stream = std::make_unique<Stream>(e, &out);
    }
    switch (static_cast<ImportOp>(op)) {
      case ImportOp::kChunk: {
        v1::SessionTransferChunk chunk;
        if (chunk.ParseFromArray(payload, static_cast<int>(len))) stream->Chunk(std::move(chunk));
        break;
      }
      case ImportOp::kPage: stream->Page(payload, len); break;
      case ImportOp::kEnd: stream->End(); break;
      case ImportOp::kDrop: stream->Drop(); break;
      case ImportOp::kCount: break;
    }
    if (stream->done()) stream.reset();
    if (!out.violation.empty()) return out;
  }
  if (stream != nullptr) stream->End();
  return out;
}

void AppendImportRecord(std::string* input, ImportOp op, const std::string& payload) {
  input->push_back(static_cast<char>(op));
  input->push_back(static_cast<char>(payload.size() & 0xff));
  input->push_back(static_cast<char>((payload.size() >> 8) & 0xff));
  input->append(payload);
}

std::string ImportPagePayload(int8_t index_delta, int16_t size_delta, uint8_t crc_xor,
                              uint32_t fill) {
  std::string p(8, '\0');
  std::memcpy(p.data(), &index_delta, 1);
  std::memcpy(p.data() + 1, &size_delta, 2);
  p[3] = static_cast<char>(crc_xor);
  std::memcpy(p.data() + 4, &fill, 4);
  return p;
}

}  // namespace attn::fuzz
