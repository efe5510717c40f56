#include "engine/run_alone.h"

#include <future>
#include <utility>

namespace attn {

absl::Status RunAlone(Backend& backend, std::unique_ptr<AttendJob> job) {
  std::promise<absl::Status> result;
  std::promise<void> finished, destroyed;
  job->done = [&result](absl::Status st) { result.set_value(std::move(st)); };
  job->released = ReleaseNotice([&destroyed] { destroyed.set_value(); });
  Batch batch;
  batch.push_back(std::move(job));
  backend.RunBatch(std::move(batch), [&finished](const BatchReport&) { finished.set_value(); });
  absl::Status st = result.get_future().get();
  finished.get_future().wait();
  destroyed.get_future().wait();
  return st;
}

}  // namespace attn
