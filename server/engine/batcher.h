// Dynamic batcher: queues validated jobs and packs those that share a BatchKey into one launch of
// their runner (the backend for Attend requests, the step pipeline for session steps), up to
// max_batch_tokens. A job goes at once while its runner is idle; while the runner is busy, jobs
// gather for the next launch, each waiting at most its kind's delay (max_queue_delay_us,
// max_step_delay_us) and never beyond the moment the runner goes idle; session steps of a few
// tokens can be held to a number of launches in flight (max_small_step_launches). Owns the
// queued jobs; hands each batch (and its jobs) to its runner.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/batch_runner.h"
#include "engine/job.h"

namespace attn {

class Metrics;

class Batcher {
 public:
  struct Options {
    int64_t max_batch_tokens = 16384;
    // Longest an Attend request waits for company while the backend is busy.
    int64_t max_queue_delay_us = 500;
    // Attend requests wait for company up to max_queue_delay_us even while the backend is idle
    // (the packing of offline batch jobs over their latency); false: an idle backend takes a
    // request at once.
    bool gather_when_idle = false;
    // The same for session steps. 0: a step goes into the next launch as soon as the pipeline
    // can take one; steps that arrive while it cannot gather.
    int64_t max_step_delay_us = 0;
    // Session steps: at most this many launches of at most small_step_tokens tokens in flight
    // at once (0: as many as the step runner takes). Small steps that arrive while that many are
    // in flight gather until one of them finishes and go as one launch; batches with more tokens
    // ready (a BatchStep's chunks, prefill) still take any free lane.
    int max_small_step_launches = 0;
    int64_t small_step_tokens = 8;
    // The cap above holds only while at least this many session steps are in the batcher (queued
    // or in its runner's launches): many callers stepping at once gain from fuller launches, a few
    // lose the wait. 0: it always holds.
    int64_t small_step_cap_min_steps = 0;
    int64_t max_queue_size = 1024;
    // Bound on the tensor bytes (inputs and outputs) of all queued and running requests.
    int64_t max_inflight_bytes = int64_t{4} << 30;
  };
  // The runners of Attend jobs and of session steps (steps may be null: no sessions) and metrics
  // (nullable) must outlive the batcher.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const Options& options,
                                                         BatchRunner* attends, BatchRunner* steps,
                                                         Metrics* metrics);
  ~Batcher();  // Drains, then stops.

  // Queues a job. On error the job is not taken and its done is not called: RESOURCE_EXHAUSTED
  // when the queue is full or the request bytes in flight would pass max_inflight_bytes,
  // UNAVAILABLE once draining started (or, for a step, when there is no step runner).
  absl::Status Submit(std::unique_ptr<Job>& job);
  template <typename T>
  absl::Status Submit(std::unique_ptr<T>& job) {
    std::unique_ptr<Job> base(std::move(job));
    absl::Status st = Submit(base);
    if (!st.ok()) job.reset(static_cast<T*>(base.release()));
    return st;
  }
  // Submit for each job, all under one lock, so that jobs of one key are batched together
  // (BatchStep); one status per job, each job taken or not as by Submit.
  std::vector<absl::Status> SubmitAll(std::span<std::unique_ptr<Job>> jobs);

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
  // The queued jobs of one runner.
  struct Queue {
    BatchRunner* runner = nullptr;
    int64_t delay_us = 0;
    bool gather_when_idle = false;
    std::deque<std::unique_ptr<Job>> high;
    std::deque<std::unique_ptr<Job>> normal;
    int in_flight = 0;  // batches the runner holds
    int max_small = 0;           // Options::max_small_step_launches (steps only)
    int64_t small_tokens = 0;    // Options::small_step_tokens
    int small_in_flight = 0;     // batches of at most small_tokens the runner holds
    int64_t cap_min_jobs = 0;    // Options::small_step_cap_min_steps
    int64_t jobs_in_flight = 0;  // jobs of the batches the runner holds
    bool empty() const { return high.empty() && normal.empty(); }
    bool IsSmall(int64_t tokens) const { return max_small > 0 && tokens <= small_tokens; }
    // Whether a small batch of `tokens` must wait for one of the small launches in flight.
    bool SmallCapHolds(int64_t tokens) const {
      return IsSmall(tokens) && small_in_flight >= max_small &&
             static_cast<int64_t>(high.size() + normal.size()) + jobs_in_flight >= cap_min_jobs;
    }
  };

  Batcher(const Options& options, BatchRunner* attends, BatchRunner* steps, Metrics* metrics);
  Queue& QueueOf(const Job& job) { return queues_[static_cast<int>(job.kind)]; }
  absl::Status SubmitLocked(std::unique_ptr<Job>& job);  // mu_ held
  // Sends every batch that is ready now from the calling thread (a submitter, or a runner that
  // just finished a batch), without waking the dispatcher: a lone job's latency.
  void DispatchReadyNow();
  // Wakes the dispatcher when jobs are left queued (after DispatchReadyNow).
  void WakeDispatcherIfQueued();
  // Hands batch to q's runner and records its queueing time (mu_ not held).
  void Dispatch(Queue& q, JobBatch batch, Clock::time_point now);
  // Counts a batch taken from q as in flight.
  void TakeInFlight(Queue& q, const JobBatch& batch);
  void DispatchLoop();
  // Pulls cancelled and expired jobs out of the queues; the caller completes them unlocked.
  void TakeDeadJobs(Clock::time_point now, JobBatch* dead_cancelled, JobBatch* dead_expired);
  // The first of q's jobs that runs alone (high priority first), as a batch; empty if none.
  JobBatch TakeJobThatRunsAlone(Queue& q);
  // q's next batch when it is ready and q's runner can take it (in_flight counted), else an
  // empty one; *wake says until when to wait at most.
  JobBatch TakeReadyBatch(Queue& q, Clock::time_point now, Clock::time_point* wake);
  void FinishBatch(Queue& q, bool small, int64_t jobs, const BatchReport& report);
  void UpdatePendingLocked();

  const Options options_;
  Metrics* const metrics_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Queue queues_[2];  // by JobKind
  int64_t queued_ = 0;
  int64_t inflight_bytes_ = 0;
  int64_t outstanding_ = 0;  // accepted jobs not yet destroyed
  int finishing_ = 0;        // FinishBatch calls still running (Drain waits for them)
  bool draining_ = false;  // Submit refuses
  bool flushing_ = false;  // no waiting for batch partners
  bool stop_ = false;
  std::thread dispatcher_;
};

}  // namespace attn
