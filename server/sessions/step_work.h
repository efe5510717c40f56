// What a session step carries through the batcher and backend beside its AttendJob (job.step).
//
// Ownership: the job owns its StepWork; the session is shared with the SessionManager; request
// and response are borrowed from the reactor, which outlives the job. `pending` is set by the
// backend between BeginStepLaunch and EndStepLaunch and owns the pages it took.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "attn/v1/attention.pb.h"
#include "sessions/session.h"

namespace attn {

struct StepWork {
  std::shared_ptr<Session> session;
  int32_t layer = 0;
  const v1::StepRequest* request = nullptr;
  v1::StepResponse* response = nullptr;
  int64_t new_tokens = 0;
  std::optional<PendingAppend> pending;
};

}  // namespace attn
