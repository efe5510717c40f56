// Where the batcher sends the batches of one kind of job: the backend runs Attend batches, the
// step pipeline (sessions/step_pipeline.h) batches of session steps.
#pragma once

#include <functional>

#include "engine/job.h"
#include "observability/batch_report.h"

namespace attn {

class BatchRunner {
 public:
  virtual ~BatchRunner() = default;

  // Most batches the runner runs at once; the batcher holds back its next batch until one of
  // them finishes.
  virtual int MaxInFlightBatches() const = 0;

  // Runs a batch of jobs of the runner's kind that share one BatchKey. Takes ownership of the
  // jobs; calls each job's done exactly once, from any thread. Calls on_finished with the batch's
  // report once it can take another batch, which may be before every done has run. May return
  // before the work is done.
  virtual void RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) = 0;
};

}  // namespace attn
