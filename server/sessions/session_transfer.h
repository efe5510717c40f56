// Moving one session's state between replicas, independent of the wire: the exporter reads the
// session's pages out of the KV region one page at a time (bounded memory), each with a CRC32C
// of its keys and values; the importer takes every page it will need from its pool up front
// (all or nothing: a full replica refuses before any byte moves), checks each page as it
// arrives and only then gives out a session. Either side dropping out midway frees what it took;
// the source session is not touched by an export, so a failed move leaves it whole.
//
// Several sessions may share one stream (a fork family): each session's header, then its pages.
// A page a session shares with one sent before it in the stream is not sent again: its header
// names it (shared_pages), and the importer takes one more reference on the page it already
// wrote, so that the peer holds the family's pages once, shared as on the source (and copied on
// write as there). Exporters and importers of one stream share its page numbering (StreamPages).
//
// Pages are read and written with the step device's copies (StepDevice::ReadKv/WriteKv: memcpy
// for the CPU backend's host region, device copies for CUDA's), or with memcpy when no device is
// given (the region is then host memory). Ownership: the exporter
// owns one extra reference on every page it will read until it is destroyed; the importer owns
// the pages it took until Finish hands them to the new session.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session.h"
#include "sessions/step_device.h"

namespace attn {

// What precedes a session's pages: everything but the bytes.
struct SessionTransferHeader {
  SessionShape shape;
  std::string owner;
  std::vector<int64_t> layer_tokens;  // per layer
  std::vector<int64_t> layer_pages;   // pages of each layer's table, sent in layer order
  int64_t page_bytes = 0;             // of keys per session page (values as many)
  // Per page of the tables (in layer order): 0 for a page of its own, sent after the header;
  // k >= 1 for the stream's page k - 1, sent before. Empty: every page is its own.
  std::vector<int64_t> shared_pages;
  int64_t TotalPages() const;  // pages of the tables
  int64_t OwnPages() const;    // of them, the pages sent after this header
};

// The numbering of a stream's pages, shared by the exporters (run -> index: the pages sent so
// far) or by the importers (index -> run: the pages taken so far) of one stream.
struct StreamPages {
  std::unordered_map<int32_t, int64_t> index_of;  // exporters: pool run -> stream index
  std::vector<int32_t> runs;                      // importers: stream index -> pool run
  std::vector<int32_t> spans;                     // importers: stream index -> its page_span
};

// One session page: its keys then its values, and the CRC32C of those bytes.
struct SessionTransferPage {
  int64_t index = 0;  // in the order of the header's tables
  std::string kv;     // 2 * header.page_bytes
  uint32_t crc32c = 0;
};

class SessionExporter {
 public:
  // stream: the numbering of the stream the session goes in with others (a fork family): pages
  // already in it are named in the header, not sent again. Null: a stream of its own.
  static absl::StatusOr<std::unique_ptr<SessionExporter>> Create(
      const Session& session, KvPagePool* pool, KvRegion region,
      const StepDevice* device = nullptr, StreamPages* stream = nullptr);
  ~SessionExporter();  // drops the references it took

  const SessionTransferHeader& header() const { return header_; }
  // The next page, or nullopt once every page was given or a read failed (status() says).
  std::optional<SessionTransferPage> Next();
  const absl::Status& status() const { return status_; }

 private:
  struct OwnPage {
    int32_t run;
    int64_t index;  // in the stream
  };
  SessionExporter(SessionTransferHeader header, std::vector<Session::LayerState> layers,
                  std::vector<OwnPage> own, KvPagePool* pool, KvRegion region,
                  const StepDevice* device);
  absl::Status Read(char* host, const char* kv, size_t bytes) const;
  const SessionTransferHeader header_;
  const std::vector<Session::LayerState> layers_;  // one reference on each page, owned
  const std::vector<OwnPage> own_;                 // the pages to send, in order
  KvPagePool* const pool_;
  const KvRegion region_;
  const StepDevice* const device_;  // null: memcpy
  absl::Status status_;
  size_t next_ = 0;  // in own_
};

class SessionImporter {
 public:
  // Checks the header against this replica (page size, shape) and takes every page the session
  // needs: its own from the pool, one more reference on each it shares with the sessions before it
  // in the stream (stream: their pages; null: a stream of its own). INVALID_ARGUMENT naming the
  // field that does not fit, RESOURCE_EXHAUSTED when the pool is short of pages. The stream's
  // numbering gets the session's own pages at once; they are written as they arrive.
  static absl::StatusOr<std::unique_ptr<SessionImporter>> Create(
      SessionTransferHeader header, KvPagePool* pool, KvRegion region,
      const StepDevice* device = nullptr, StreamPages* stream = nullptr);
  ~SessionImporter();  // gives back the pages when Finish did not run

  // Writes the page into its place: DATA_LOSS when its checksum does not match its bytes,
  // INVALID_ARGUMENT for a page out of order or of the wrong size.
  absl::Status Accept(const SessionTransferPage& page);
  // The session with every page received; FAILED_PRECONDITION while some are missing.
  absl::StatusOr<std::unique_ptr<Session>> Finish(std::string id);

  int64_t received() const { return received_; }                        // own pages so far
  int64_t expected() const { return static_cast<int64_t>(own_.size()); }  // of the header
  const SessionTransferHeader& header() const { return header_; }

 private:
  SessionImporter(SessionTransferHeader header, std::vector<int32_t> pages,
                  std::vector<size_t> own, int64_t first_index, KvPagePool* pool,
                  KvRegion region, const StepDevice* device);
  absl::Status Write(char* kv, const char* host, size_t bytes) const;
  const SessionTransferHeader header_;
  // The tables' pages in the header's order, one reference on each owned until Finish (a page
  // named twice holds two).
  std::vector<int32_t> pages_;
  const std::vector<size_t> own_;  // where in pages_ the pages sent after the header go
  const int64_t first_index_;      // the stream index of the first of them
  KvPagePool* const pool_;
  const KvRegion region_;
  const StepDevice* const device_;  // null: memcpy
  int64_t received_ = 0;
  bool finished_ = false;
};

}  // namespace attn
