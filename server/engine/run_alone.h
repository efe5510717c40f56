// One job through a backend outside the batcher (the start-up warm-ups), waited for to the end.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "engine/attend_job.h"
#include "engine/backend.h"

namespace attn {

// Runs job as a batch of one and returns its status once the backend has finished the batch and
// destroyed the job (so that nothing the job held, such as a session and its pages, is used
// after this returns). job->done is replaced.
absl::Status RunAlone(Backend& backend, std::unique_ptr<AttendJob> job);

}  // namespace attn
