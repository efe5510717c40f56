#include "engine/batcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "observability/metrics.h"

namespace attn {
namespace {

// How often queued jobs are checked for cancellation while nothing else wakes the dispatcher.
constexpr auto kSweepInterval = std::chrono::milliseconds(5);

// Tensor bytes a job holds while it is in the server: its inputs and its sized outputs.
int64_t JobBytes(const AttendJob& job) {
  if (job.request == nullptr) return job.bytes;  // a session step sizes itself
  // Inputs in the message (in its data fields, or copied from the wire path's slices): those
  // not in a region.
  const v1::AttendRequest& r = *job.request;
  const auto inline_bytes = [](const v1::Tensor& t, std::string_view b) {
    return t.has_region() ? int64_t{0} : static_cast<int64_t>(b.size());
  };
  int64_t bytes = inline_bytes(r.q(), job.q_bytes) + inline_bytes(r.k(), job.k_bytes) +
                  inline_bytes(r.v(), job.v_bytes);
  bytes += inline_bytes(r.q(), job.q_bytes);  // o
  if (job.return_lse) bytes += int64_t{4} * job.key.num_heads * job.total_q;
  return bytes;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const Options& options,
                                                         Backend* backend, Metrics* metrics) {
  if (options.max_batch_tokens < 1) return absl::InvalidArgumentError("max_batch_tokens must be >= 1");
  if (options.max_queue_delay_us < 0) {
    return absl::InvalidArgumentError("max_queue_delay_us must be >= 0");
  }
  if (options.max_queue_size < 1) return absl::InvalidArgumentError("max_queue_size must be >= 1");
  if (options.max_inflight_bytes < 1) {
    return absl::InvalidArgumentError("max_inflight_bytes must be >= 1");
  }
  if (backend == nullptr) return absl::InvalidArgumentError("backend is null");
  return std::unique_ptr<Batcher>(new Batcher(options, backend, metrics));
}

Batcher::Batcher(const Options& options, Backend* backend, Metrics* metrics)
    : options_(options), backend_(backend), metrics_(metrics) {
  dispatcher_ = std::thread([this] { DispatchLoop(); });
}

Batcher::~Batcher() {
  Drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  dispatcher_.join();
}

absl::Status Batcher::Submit(std::unique_ptr<AttendJob>& job) {
  absl::Status st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    st = SubmitLocked(job);
  }
  if (st.ok()) {
    DispatchStepsNow();
    cv_.notify_all();
  }
  return st;
}

std::vector<absl::Status> Batcher::SubmitAll(std::span<std::unique_ptr<AttendJob>> jobs) {
  std::vector<absl::Status> status;
  status.reserve(jobs.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& job : jobs) status.push_back(SubmitLocked(job));
  }
  DispatchStepsNow();
  cv_.notify_all();
  return status;
}

void Batcher::DispatchStepsNow() {
  const auto now = Clock::now();
  Batch batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.max_step_delay_us != 0 || !high_.empty() || normal_.empty() ||
        normal_.front()->key.page_tokens == 0 ||
        in_flight_batches_ >= backend_->MaxInFlightBatches()) {
      return;
    }
    auto wake = Clock::time_point::max();
    batch = TakeReadyBatch(now, &wake);
    if (batch.empty()) return;
    ++in_flight_batches_;
  }
  for (auto& job : batch) {
    job->queue_us = Micros(now - job->arrival);
    if (metrics_) metrics_->ObserveQueueSeconds(job->queue_us * 1e-6);
  }
  backend_->RunBatch(std::move(batch), [this](const BatchReport& r) { FinishBatch(r); });
}

absl::Status Batcher::SubmitLocked(std::unique_ptr<AttendJob>& job) {
  const int64_t bytes = JobBytes(*job);
  {
    if (draining_) return absl::UnavailableError("attnd is shutting down; retry on another replica");
    if (queued_ >= options_.max_queue_size) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request queue is full (max_queue_size ", options_.max_queue_size, "); retry later"));
    }
    if (inflight_bytes_ + bytes > options_.max_inflight_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request memory exhausted: this request needs ", bytes, " bytes, ", inflight_bytes_,
          " of ", options_.max_inflight_bytes, " are held by requests in flight ",
          "(max_inflight_bytes); retry later"));
    }
    inflight_bytes_ += bytes;
    ++outstanding_;
    // Whichever path completes the job: its bytes are given back before the caller hears (so a
    // caller's next request finds them free), and it counts as pending until it is destroyed
    // (after its done has returned), which Drain waits for.
    job->done = [this, bytes, shm_read = job->region_bytes_read,
                 shm_written = job->region_bytes_written,
                 done = std::move(job->done)](absl::Status st) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        inflight_bytes_ -= bytes;
      }
      if (st.ok() && metrics_) metrics_->AddSharedMemoryTensorBytes(shm_read, shm_written);
      done(std::move(st));
    };
    job->released = ReleaseNotice([this] {
      std::lock_guard<std::mutex> lock(mu_);
      --outstanding_;
      UpdatePendingLocked();
      // Under the lock: once Drain sees the count reach zero, ~Batcher may destroy cv_.
      cv_.notify_all();
    });
    (job->high_priority ? high_ : normal_).push_back(std::move(job));
    ++queued_;
    UpdatePendingLocked();
  }
  return absl::OkStatus();
}

void Batcher::StartDraining() {
  std::lock_guard<std::mutex> lock(mu_);
  flushing_ = true;
  cv_.notify_all();
}

void Batcher::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  flushing_ = draining_ = true;
  cv_.notify_all();
  cv_.wait(lock, [&] { return outstanding_ == 0 && in_flight_batches_ == 0; });
}

int64_t Batcher::InflightBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inflight_bytes_;
}

int64_t Batcher::Pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outstanding_;
}

void Batcher::UpdatePendingLocked() {
  if (metrics_) metrics_->SetPendingRequests(outstanding_);
}

void Batcher::TakeDeadJobs(Clock::time_point now, Batch* cancelled, Batch* expired) {
  for (auto* q : {&high_, &normal_}) {
    for (auto it = q->begin(); it != q->end();) {
      AttendJob& job = **it;
      // The deadline first: gRPC also cancels a call whose deadline has passed.
      if (job.deadline <= now) {
        expired->push_back(std::move(*it));
      } else if (job.is_cancelled && job.is_cancelled()) {
        cancelled->push_back(std::move(*it));
      } else {
        ++it;
        continue;
      }
      it = q->erase(it);
      --queued_;
    }
  }
}

Batch Batcher::TakeJobThatRunsAlone() {
  for (auto* q : {&high_, &normal_}) {
    const auto it = std::find_if(q->begin(), q->end(), [](const auto& job) { return job->runs_alone; });
    if (it == q->end()) continue;
    Batch batch;
    batch.push_back(std::move(*it));
    q->erase(it);
    --queued_;
    return batch;
  }
  return {};
}

Batch Batcher::TakeReadyBatch(Clock::time_point now, Clock::time_point* wake) {
  std::deque<std::unique_ptr<AttendJob>>* head_queue = !high_.empty() ? &high_ : &normal_;
  if (head_queue->empty()) return {};
  const AttendJob& head = *head_queue->front();
  // Tokens of jobs that could join head's batch, to see whether the batch is already full.
  int64_t tokens = 0;
  for (auto* q : {&high_, &normal_}) {
    for (const auto& job : *q) {
      if (job->key == head.key) tokens += job->Tokens();
    }
  }
  // Session steps wait only while every backend slot is busy (continuous batching): whatever
  // arrived meanwhile forms the next launch, and a lone step never waits for company.
  const int64_t delay_us =
      head.key.page_tokens > 0 ? options_.max_step_delay_us : options_.max_queue_delay_us;
  const auto flush_at = head.arrival + std::chrono::microseconds(delay_us);
  if (!head.runs_alone && tokens < options_.max_batch_tokens && now < flush_at && !flushing_) {
    *wake = std::min(*wake, flush_at);
    return TakeJobThatRunsAlone();  // while the head waits for company
  }
  if (head.runs_alone) return TakeJobThatRunsAlone();
  const BatchKey key = head.key;
  Batch batch;
  int64_t batch_tokens = 0;
  for (auto* q : {&high_, &normal_}) {
    for (auto it = q->begin(); it != q->end();) {
      const int64_t t = (*it)->Tokens();
      if ((*it)->key == key && !(*it)->runs_alone &&
          (batch.empty() || batch_tokens + t <= options_.max_batch_tokens)) {
        batch_tokens += t;
        batch.push_back(std::move(*it));
        it = q->erase(it);
        --queued_;
      } else {
        ++it;
      }
    }
  }
  return batch;
}

void Batcher::DispatchLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto now = Clock::now();
    Batch cancelled, expired;
    TakeDeadJobs(now, &cancelled, &expired);
    Batch batch;
    auto wake = now + kSweepInterval;
    if (in_flight_batches_ < backend_->MaxInFlightBatches()) batch = TakeReadyBatch(now, &wake);
    if (!batch.empty()) ++in_flight_batches_;
    if (cancelled.empty() && expired.empty() && batch.empty()) {
      if (queued_ == 0) {
        cv_.wait(lock);
      } else {
        cv_.wait_until(lock, wake);
      }
      continue;
    }
    lock.unlock();
    for (auto& job : cancelled) job->done(absl::CancelledError("request cancelled while queued"));
    for (auto& job : expired) {
      job->done(absl::DeadlineExceededError("deadline expired while the request was queued"));
    }
    if (!batch.empty()) {
      for (auto& job : batch) {
        job->queue_us = Micros(now - job->arrival);
        if (metrics_) metrics_->ObserveQueueSeconds(job->queue_us * 1e-6);
      }
      backend_->RunBatch(std::move(batch), [this](const BatchReport& r) { FinishBatch(r); });
    }
    // Destroyed unlocked: a job's release takes mu_.
    cancelled.clear();
    expired.clear();
    lock.lock();
  }
}

void Batcher::FinishBatch(const BatchReport& report) {
  if (metrics_) metrics_->ObserveBatch(report);
  std::lock_guard<std::mutex> lock(mu_);
  --in_flight_batches_;
  // Notified under the lock: once Drain sees the last batch finish, ~Batcher may destroy cv_,
  // which must not happen while this thread is still inside notify_all (found by TSan).
  cv_.notify_all();
}

}  // namespace attn
