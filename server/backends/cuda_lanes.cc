// The lanes of the CUDA backend's Attend path: each a CUDA stream with a host thread of its own
// that takes the next batch, launches it and hands its jobs to the completion pool.
#include <algorithm>

#include "backends/cuda_backend.h"
#include "backends/cuda_util.h"
#include "common/status_util.h"

namespace attn {
absl::Status CudaBackend::StartLanes() {
  for (int i = 0; i < options_.streams; ++i) {
    auto lane = std::make_unique<Lane>();
    const absl::Status created = CreateLaneStream(&lane->stream, lane->events);
    lanes_.push_back(std::move(lane));  // StopLanes destroys what was created
    RETURN_IF_ERROR(created);
  }
  for (auto& lane : lanes_) lane->thread = std::thread([this, l = lane.get()] { LaneLoop(l); });
  return absl::OkStatus();
}

void CudaBackend::StopLanes() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
  for (auto& lane : lanes_) DestroyLaneStream(lane->stream, lane->events);
}

void CudaBackend::RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({JobsAs<AttendJob>(std::move(batch)), std::move(on_finished)});
  }
  cv_.notify_one();
}

void CudaBackend::LaneLoop(Lane* lane) {
  cudaSetDevice(options_.device);
  for (;;) {
    Work work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    BatchReport report;
    report.requests = static_cast<int32_t>(work.batch.size());
    for (const auto& job : work.batch) report.tokens += job->Tokens();
    std::vector<absl::Status> status(work.batch.size());
    // Large requests whose tensors all lie in GPU regions run in place, each its own launch;
    // the rest are packed into one.
    const auto packed_end = std::stable_partition(
        work.batch.begin(), work.batch.end(), [](const auto& job) { return !AttendsInPlace(*job); });
    const size_t packed = static_cast<size_t>(packed_end - work.batch.begin());
    const std::span<std::unique_ptr<AttendJob>> jobs(work.batch);
    const std::span<absl::Status> statuses(status);
    if (packed > 0) {
      RunSplittingOnExhaustion(*lane, jobs.first(packed), statuses.first(packed), &report);
    }
    if (packed < jobs.size()) {
      const absl::Status st = LaunchInPlace(*lane, jobs.subspan(packed), &report);
      if (!st.ok() && !absl::IsResourceExhausted(st)) state_->NoteIfDeviceLost(lane->stream);
      std::fill(statuses.begin() + packed, statuses.end(), st);
    }
    CompleteJobs(std::move(work.batch), std::move(status));
    work.on_finished(report);
  }
}

void CudaBackend::CompleteJobs(AttendBatch batch, std::vector<absl::Status> status) {
  // The results are in pinned memory now; placing them and finishing the calls runs on the
  // completion pool while this lane takes the next batch.
  for (size_t i = 0; i < batch.size(); ++i) {
    std::shared_ptr<AttendJob> job(std::move(batch[i]));
    completions_->Post([this, job, st = std::move(status[i])] {
      // GPU regions got their outputs on the device.
      if (st.ok() && !job->device_tensors) {
        const auto start = Clock::now();
        UnstageOutputs(*job);
        job->host_copy_us += Micros(Clock::now() - start);
      }
      job->backend_state.reset();  // staging back to the pool before the caller hears
      job->done(st);
    });
  }
}

}  // namespace attn
