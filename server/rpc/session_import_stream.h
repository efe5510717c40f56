// The receiving side of one ImportSession stream (attention.proto), without gRPC: each chunk is
// checked and its page written into the KV region as it comes (SessionImporter), and the stream's
// sessions (one, or a fork family whose pages they share cross once) are made only once the
// sender has closed its side with every page sent. The ImportSession
// reactor feeds it; so does the import fuzz target (tests/fuzz/import_fuzz.h).
//
// Ownership: borrows the session manager (and its page pool), the KV region and the step device,
// which must outlive it; owns the pages it took until Complete hands them to the new sessions,
// and gives them back when destroyed before that (a stream that failed or was dropped).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/v1/attention.pb.h"
#include "engine/job.h"
#include "sessions/session.h"
#include "sessions/session_transfer.h"
#include "sessions/step_device.h"

namespace attn {

class SessionManager;

class SessionImportStream {
 public:
  struct Target {
    SessionManager* sessions = nullptr;
    KvRegion kv_region;
    const StepDevice* kv_device = nullptr;  // null: host memory, memcpy
    Fp8Features fp8;                        // what FP8 session caches this replica serves
  };
  // The imported sessions will belong to owner (the identity of the caller's token).
  SessionImportStream(Target target, std::string owner);
  ~SessionImportStream();

  // The next chunk (its page bytes are moved out): INVALID_ARGUMENT naming the field that does
  // not fit, DATA_LOSS for a page whose CRC32C does not match, RESOURCE_EXHAUSTED when the
  // session does not fit here, FAILED_PRECONDITION for an FP8 cache this backend does not serve,
  // UNAVAILABLE while this replica drains. After an error the stream is done: drop it.
  absl::Status Take(v1::SessionTransferChunk& chunk);
  // The sender closed its side: the stream's sessions, in the order of their headers, open here
  // now, or why not (INVALID_ARGUMENT when the stream ended before a header or before every page
  // a header announced).
  absl::StatusOr<std::vector<std::shared_ptr<Session>>> Complete();

  // The first session's id on the source (for logs); "" before the header.
  const std::string& source_id() const { return source_id_; }
  int64_t pages() const { return pages_; }  // pages received
  // The sessions' ids on the source, in the order of their headers.
  const std::vector<std::string>& source_ids() const { return source_ids_; }

 private:
  absl::Status TakeHeader(const v1::SessionTransferHeader& h);

  const Target target_;
  const std::string owner_;
  std::string source_id_;
  std::vector<std::string> source_ids_;
  StreamPages stream_pages_;  // the pages of the stream's sessions so far
  std::vector<std::unique_ptr<SessionImporter>> importers_;  // one per header
  int64_t pages_ = 0;
};

}  // namespace attn
