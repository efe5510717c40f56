// Moving one session's state between replicas, independent of the wire: the exporter reads the
// session's pages out of the KV region one page at a time (bounded memory), each with a CRC32C
// of its keys and values; the importer takes every page it will need from its pool up front
// (all or nothing: a full replica refuses before any byte moves), checks each page as it
// arrives and only then gives out a session. Either side dropping out midway frees what it took;
// the source session is not touched by an export, so a failed move leaves it whole.
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
  int64_t TotalPages() const;
};

// One session page: its keys then its values, and the CRC32C of those bytes.
struct SessionTransferPage {
  int64_t index = 0;  // in the order of the header's tables
  std::string kv;     // 2 * header.page_bytes
  uint32_t crc32c = 0;
};

class SessionExporter {
 public:
  static absl::StatusOr<std::unique_ptr<SessionExporter>> Create(
      const Session& session, KvPagePool* pool, KvRegion region,
      const StepDevice* device = nullptr);
  ~SessionExporter();  // drops the references it took

  const SessionTransferHeader& header() const { return header_; }
  // The next page, or nullopt once every page was given or a read failed (status() says).
  std::optional<SessionTransferPage> Next();
  const absl::Status& status() const { return status_; }

 private:
  SessionExporter(SessionTransferHeader header, std::vector<Session::LayerState> layers,
                  KvPagePool* pool, KvRegion region, const StepDevice* device);
  absl::Status Read(char* host, const char* kv, size_t bytes) const;
  const SessionTransferHeader header_;
  const std::vector<Session::LayerState> layers_;
  KvPagePool* const pool_;
  const KvRegion region_;
  const StepDevice* const device_;  // null: memcpy
  absl::Status status_;
  size_t layer_ = 0;
  size_t page_ = 0;
  int64_t index_ = 0;
};

class SessionImporter {
 public:
  // Checks the header against this replica (page size, shape) and takes every page the session
  // needs: INVALID_ARGUMENT naming the field that does not fit, RESOURCE_EXHAUSTED when the pool
  // is short of pages.
  static absl::StatusOr<std::unique_ptr<SessionImporter>> Create(
      SessionTransferHeader header, KvPagePool* pool, KvRegion region,
      const StepDevice* device = nullptr);
  ~SessionImporter();  // gives back the pages when Finish did not run

  // Writes the page into its place: DATA_LOSS when its checksum does not match its bytes,
  // INVALID_ARGUMENT for a page out of order or of the wrong size.
  absl::Status Accept(const SessionTransferPage& page);
  // The session with every page received; FAILED_PRECONDITION while some are missing.
  absl::StatusOr<std::unique_ptr<Session>> Finish(std::string id);

  int64_t received() const { return received_; }                          // pages so far
  int64_t expected() const { return static_cast<int64_t>(pages_.size()); }  // of the header

 private:
  SessionImporter(SessionTransferHeader header, std::vector<int32_t> pages, KvPagePool* pool,
                  KvRegion region, const StepDevice* device);
  absl::Status Write(char* kv, const char* host, size_t bytes) const;
  const SessionTransferHeader header_;
  std::vector<int32_t> pages_;  // taken, in the header's table order; owned until Finish
  KvPagePool* const pool_;
  const KvRegion region_;
  const StepDevice* const device_;  // null: memcpy
  int64_t received_ = 0;
  bool finished_ = false;
};

}  // namespace attn
