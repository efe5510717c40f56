// Dynamic batcher: queues validated Attend jobs and packs those that share a BatchKey into one
// backend launch, up to max_batch_tokens or max_queue_delay, whichever comes first. Owns the
// queued jobs; hands each batch (and its jobs) to the backend.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <vector>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attend_job.h"
#include "engine/backend.h"

namespace attn {

class Metrics;

class Batcher {
 public:
  struct Options {
    int64_t max_batch_tokens = 16384;
    int64_t max_queue_delay_us = 500;
    // The same for session steps (BatchKey::page_tokens > 0). 0: a step goes into the next
    // launch as soon as the backend can take one; steps that arrive while it is busy gather.
    int64_t max_step_delay_us = 0;
    int64_t max_queue_size = 1024;
    // Bound on the tensor bytes (inputs and outputs) of all queued and running requests.
    int64_t max_inflight_bytes = int64_t{4} << 30;
  };
  // backend and metrics (nullable) must outlive the batcher.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const Options& options, Backend* backend,
                                                         Metrics* metrics);
  ~Batcher();  // Drains, then stops.

  // Queues a job. On error the job is not taken and its done is not called: RESOURCE_EXHAUSTED
  // when the queue is full or the request bytes in flight would pass max_inflight_bytes,
  // UNAVAILABLE once draining started.
  absl::Status Submit(std::unique_ptr<AttendJob>& job);
  // Submit for each job, all under one lock, so that jobs of one key are batched together
  // (BatchStep); one status per job, each job taken or not as by Submit.
  std::vector<absl::Status> SubmitAll(std::span<std::unique_ptr<AttendJob>> jobs);

  // Dispatches queued jobs without waiting for batch partners (during a drain none are coming),
  // and new ones at once. It still takes jobs: the service refuses new calls itself, so what
  // reaches the batcher during a drain belongs to calls already accepted (a session step that
  // waited behind an earlier step of its layer), which must not be refused. Returns at once.
  void StartDraining();
  // StartDraining, stops taking work (Submit answers UNAVAILABLE), then returns once every
  // accepted job's done has returned.
  void Drain();

  // Accepted jobs whose done has not returned: queued, running or being completed.
  int64_t Pending() const;
  int64_t InflightBytes() const;

 private:
  Batcher(const Options& options, Backend* backend, Metrics* metrics);
  absl::Status SubmitLocked(std::unique_ptr<AttendJob>& job);  // mu_ held
  // Session steps at the head of the queue that find a backend slot free go to the backend from
  // the submitting thread, without waking the dispatcher (a lone step's latency).
  void DispatchStepsNow();
  void DispatchLoop();
  // Pulls cancelled and expired jobs out of the queues; the caller completes them unlocked.
  void TakeDeadJobs(Clock::time_point now, Batch* dead_cancelled, Batch* dead_expired);
  // The first queued job that runs alone (high priority first), as a batch; empty if none.
  Batch TakeJobThatRunsAlone();
  // The next batch, or an empty one when nothing is ready yet; *wake says until when to wait.
  Batch TakeReadyBatch(Clock::time_point now, Clock::time_point* wake);
  void FinishBatch(const BatchReport& report);
  void UpdatePendingLocked();

  const Options options_;
  Backend* const backend_;
  Metrics* const metrics_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<AttendJob>> high_;
  std::deque<std::unique_ptr<AttendJob>> normal_;
  int in_flight_batches_ = 0;
  int64_t queued_ = 0;
  int64_t inflight_bytes_ = 0;
  int64_t outstanding_ = 0;  // accepted jobs not yet destroyed
  bool draining_ = false;  // Submit refuses
  bool flushing_ = false;  // no waiting for batch partners
  bool stop_ = false;
  std::thread dispatcher_;
};

}  // namespace attn
