#include "engine/batcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "observability/metrics.h"

namespace attn {
namespace {

// How often queued jobs are checked for cancellation while nothing else wakes the dispatcher.
constexpr auto kSweepInterval = std::chrono::milliseconds(5);

int64_t BatchTokens(const JobBatch& batch) {
  int64_t tokens = 0;
  for (const auto& job : batch) tokens += job->Tokens();
  return tokens;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const Options& options,
                                                         BatchRunner* attends, BatchRunner* steps,
                                                         Metrics* metrics) {
  if (options.max_batch_tokens < 1) {
    return absl::InvalidArgumentError("max_batch_tokens must be >= 1");
  }
  if (options.max_queue_delay_us < 0) {
    return absl::InvalidArgumentError("max_queue_delay_us must be >= 0");
  }
  if (options.max_step_delay_us < 0) {
    return absl::InvalidArgumentError("max_step_delay_us must be >= 0");
  }
  if (options.max_small_step_launches < 0) {
    return absl::InvalidArgumentError("max_small_step_launches must be >= 0");
  }
  if (options.small_step_tokens < 1) {
    return absl::InvalidArgumentError("small_step_tokens must be >= 1");
  }
  if (options.small_step_cap_min_steps < 0) {
    return absl::InvalidArgumentError("small_step_cap_min_steps must be >= 0");
  }
  if (options.max_queue_size < 1) return absl::InvalidArgumentError("max_queue_size must be >= 1");
  if (options.max_inflight_bytes < 1) {
    return absl::InvalidArgumentError("max_inflight_bytes must be >= 1");
  }
  if (attends == nullptr) return absl::InvalidArgumentError("the Attend runner is null");
  return std::unique_ptr<Batcher>(new Batcher(options, attends, steps, metrics));
}

Batcher::Batcher(const Options& options, BatchRunner* attends, BatchRunner* steps,
                 Metrics* metrics)
    : options_(options), metrics_(metrics) {
  Queue& a = queues_[static_cast<int>(JobKind::kAttend)];
  a.runner = attends;
  a.delay_us = options.max_queue_delay_us;
  a.gather_when_idle = options.gather_when_idle;
  Queue& s = queues_[static_cast<int>(JobKind::kStep)];
  s.runner = steps;
  s.delay_us = options.max_step_delay_us;
  s.max_small = options.max_small_step_launches;
  s.small_tokens = options.small_step_tokens;
  s.cap_min_jobs = options.small_step_cap_min_steps;
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

absl::Status Batcher::Submit(std::unique_ptr<Job>& job) {
  absl::Status st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    st = SubmitLocked(job);
  }
  if (st.ok()) {
    DispatchReadyNow();
    WakeDispatcherIfQueued();
  }
  return st;
}

std::vector<absl::Status> Batcher::SubmitAll(std::span<std::unique_ptr<Job>> jobs) {
  std::vector<absl::Status> status;
  status.reserve(jobs.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& job : jobs) status.push_back(SubmitLocked(job));
  }
  DispatchReadyNow();
  WakeDispatcherIfQueued();
  return status;
}

void Batcher::WakeDispatcherIfQueued() {
  // The dispatcher has work only for jobs still queued (its delay timer, their deadlines): a job
  // dispatched at once from the caller's thread would wake it for nothing, once per call.
  std::lock_guard<std::mutex> lock(mu_);
  if (queued_ > 0) cv_.notify_all();
}

void Batcher::DispatchReadyNow() {
  for (Queue& q : queues_) {
    const auto now = Clock::now();
    JobBatch batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (q.empty()) continue;
      auto wake = Clock::time_point::max();
      batch = TakeReadyBatch(q, now, &wake);
    }
    if (!batch.empty()) Dispatch(q, std::move(batch), now);
  }
}

void Batcher::Dispatch(Queue& q, JobBatch batch, Clock::time_point now) {
  for (auto& job : batch) {
    const Clock::time_point from = job->ready != Clock::time_point{} ? job->ready : job->arrival;
    job->queue_us = Micros(now - from);
    if (metrics_) metrics_->ObserveQueueSeconds(job->queue_us * 1e-6);
  }
  const bool small = q.IsSmall(BatchTokens(batch));
  const auto jobs = static_cast<int64_t>(batch.size());
  q.runner->RunBatch(std::move(batch), [this, &q, small, jobs](const BatchReport& r) {
    FinishBatch(q, small, jobs, r);
  });
}

absl::Status Batcher::SubmitLocked(std::unique_ptr<Job>& job) {
  const int64_t bytes = job->bytes;
  if (draining_) return absl::UnavailableError("attnd is shutting down; retry on another replica");
  Queue& q = QueueOf(*job);
  if (q.runner == nullptr) {
    return absl::UnavailableError("this attnd has no runner for session steps");
  }
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
    // Only Drain waits for this count, so only its end is told: a notify per job woke the
    // dispatcher for nothing once per step (32 wake-ups, each a context switch, for a BatchStep
    // of 32). Under the lock: once Drain sees the count reach zero, ~Batcher may destroy cv_.
    if (draining_ && outstanding_ == 0) cv_.notify_all();
  });
  (job->high_priority ? q.high : q.normal).push_back(std::move(job));
  ++queued_;
  UpdatePendingLocked();
  return absl::OkStatus();
}

void Batcher::StartDraining() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    flushing_ = true;
    cv_.notify_all();
  }
  DispatchReadyNow();
}

void Batcher::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  flushing_ = draining_ = true;
  cv_.notify_all();
  cv_.wait(lock, [&] {
    return outstanding_ == 0 && queues_[0].in_flight == 0 && queues_[1].in_flight == 0 &&
           finishing_ == 0;
  });
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

void Batcher::TakeDeadJobs(Clock::time_point now, JobBatch* cancelled, JobBatch* expired) {
  for (Queue& queue : queues_) {
    for (auto* q : {&queue.high, &queue.normal}) {
      for (auto it = q->begin(); it != q->end();) {
        Job& job = **it;
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
}

JobBatch Batcher::TakeJobThatRunsAlone(Queue& queue) {
  for (auto* q : {&queue.high, &queue.normal}) {
    const auto it =
        std::find_if(q->begin(), q->end(), [](const auto& job) { return job->runs_alone; });
    if (it == q->end()) continue;
    JobBatch batch;
    batch.push_back(std::move(*it));
    q->erase(it);
    --queued_;
    TakeInFlight(queue, batch);
    return batch;
  }
  return {};
}

JobBatch Batcher::TakeReadyBatch(Queue& queue, Clock::time_point now, Clock::time_point* wake) {
  if (queue.empty() || queue.in_flight >= queue.runner->MaxInFlightBatches()) return {};
  std::deque<std::unique_ptr<Job>>* head_queue = !queue.high.empty() ? &queue.high : &queue.normal;
  const Job& head = *head_queue->front();
  if (head.runs_alone) return TakeJobThatRunsAlone(queue);
  // Tokens of jobs that could join head's batch, to see whether the batch is already full.
  int64_t tokens = 0;
  for (auto* q : {&queue.high, &queue.normal}) {
    for (const auto& job : *q) {
      if (job->key == head.key) tokens += job->Tokens();
    }
  }
  // Small steps while as many small launches as allowed are in flight gather until one of them
  // finishes (FinishBatch dispatches them then).
  if (queue.SmallCapHolds(tokens) && !flushing_) {
    return TakeJobThatRunsAlone(queue);
  }
  // An idle runner takes the head at once: waiting would only delay it. A busy one's next batch
  // gathers what arrives meanwhile, for at most the kind's delay.
  const auto flush_at = head.arrival + std::chrono::microseconds(queue.delay_us);
  const bool idle = queue.in_flight == 0 && !queue.gather_when_idle;
  const bool ready = idle || tokens >= options_.max_batch_tokens || now >= flush_at || flushing_;
  if (!ready) {
    *wake = std::min(*wake, flush_at);
    return TakeJobThatRunsAlone(queue);  // while the head waits for company
  }
  const BatchKey key = head.key;
  JobBatch batch;
  int64_t batch_tokens = 0;
  for (auto* q : {&queue.high, &queue.normal}) {
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
  TakeInFlight(queue, batch);
  return batch;
}

void Batcher::TakeInFlight(Queue& q, const JobBatch& batch) {
  ++q.in_flight;
  q.jobs_in_flight += static_cast<int64_t>(batch.size());
  if (q.IsSmall(BatchTokens(batch))) ++q.small_in_flight;
}

void Batcher::DispatchLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto now = Clock::now();
    JobBatch cancelled, expired;
    TakeDeadJobs(now, &cancelled, &expired);
    JobBatch batches[2];
    auto wake = now + kSweepInterval;
    for (int k = 0; k < 2; ++k) {
      if (queues_[k].runner != nullptr) batches[k] = TakeReadyBatch(queues_[k], now, &wake);
    }
    if (cancelled.empty() && expired.empty() && batches[0].empty() && batches[1].empty()) {
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
    for (int k = 0; k < 2; ++k) {
      if (!batches[k].empty()) Dispatch(queues_[k], std::move(batches[k]), now);
    }
    // Destroyed unlocked: a job's release takes mu_.
    cancelled.clear();
    expired.clear();
    lock.lock();
  }
}

void Batcher::FinishBatch(Queue& q, bool small, int64_t jobs, const BatchReport& report) {
  if (metrics_) metrics_->ObserveBatch(report);
  {
    std::lock_guard<std::mutex> lock(mu_);
    --q.in_flight;
    q.jobs_in_flight -= jobs;
    if (small) --q.small_in_flight;
    ++finishing_;
  }
  // What gathered while the runner was busy goes now, from this thread (no hop to the
  // dispatcher).
  DispatchReadyNow();
  std::lock_guard<std::mutex> lock(mu_);
  --finishing_;
  // Drain waits for the batches to finish, and the dispatcher for jobs still queued; nobody else.
  // Notified under the lock: once Drain sees the last batch finish, ~Batcher may destroy cv_,
  // which must not happen while this thread is still inside notify_all (found by TSan).
  if (draining_ || queued_ > 0) cv_.notify_all();
}

}  // namespace attn
