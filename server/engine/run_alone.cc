#include "engine/run_alone.h"

#include <future>
#include <utility>

namespace attn {

absl::Status RunAlone(BatchRunner& runner, std::unique_ptr<Job> job,
                      const std::function<void(const Job&)>& inspect) {
  std::promise<absl::Status> result;
  std::promise<void> finished, destroyed;
  const Job* raw = job.get();
  job->done = [&result, &inspect, raw](absl::Status st) {
    if (inspect) inspect(*raw);
    result.set_value(std::move(st));
  };
  job->released = ReleaseNotice([&destroyed] { destroyed.set_value(); });
  JobBatch batch;
  batch.push_back(std::move(job));
  runner.RunBatch(std::move(batch), [&finished](const BatchReport&) { finished.set_value(); });
  absl::Status st = result.get_future().get();
  finished.get_future().wait();
  destroyed.get_future().wait();
  return st;
}

}  // namespace attn
