// One job through a runner outside the batcher (the start-up warm-ups), waited for to the end.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "engine/batch_runner.h"
#include "engine/job.h"

namespace attn {

// Runs job as a batch of one and returns its status once the runner has finished the batch and
// destroyed the job (so that nothing the job held, such as a session and its pages, is used
// after this returns). job->done is replaced; `inspect` (may be null) sees the job as done runs,
// while it is still alive.
absl::Status RunAlone(BatchRunner& runner, std::unique_ptr<Job> job,
                      const std::function<void(const Job&)>& inspect = nullptr);

}  // namespace attn
