// The one home of a session step's launch, whatever the backend: the batcher hands it batches
// of steps (StepJobs of one BatchKey), and each batch runs through
//   plan   - each step's append begun (pages taken, copy-on-write planned), its route, the
//            launch's layout;
//   stage  - the page table, row lists and sequence offsets written into the input staging, and
//            the steps' tensors copied into it straight from where they are (the received
//            message's slices, or host regions);
//   launch - the device's copies and kernels (StepDevice::Launch), asynchronous on a GPU;
//   finish - wait, commit every append (or give every page back when the launch failed), hand
//            each step its outputs (a part of the launch's output staging, sent from there) and
//            tell its caller.
// A launch the device has no memory for is split in halves, then halves of those, so that only
// a step that does not fit by itself fails. The device's lanes run launches side by side: while
// one lane waits for the device, another plans and stages the next launch.
//
// Ownership: the pipeline owns the batches it was given until each step's done has run; the
// device is borrowed and must outlive it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/batch_runner.h"
#include "engine/completion_pool.h"
#include "sessions/step_device.h"
#include "sessions/step_job.h"
#include "sessions/step_launch.h"

namespace attn {

class StepPipeline : public BatchRunner {
 public:
  struct Options {
    // Threads that tell the callers of launches of several calls (each answer encoded and sent)
    // in parallel while the lane goes on to its next launch.
    int completion_threads = 2;
    // How long a lane that has just finished a launch looks for the next batch (yielding the
    // core) before it sleeps: a lone caller's next step, coming one network round trip later,
    // then starts without a thread's wake-up (tens of microseconds). 0: it sleeps at once.
    std::chrono::microseconds idle_poll{0};
    // Lanes poll (for their next batch, and the device for their launch) even while other lanes
    // are at work. false: only a lane alone at work polls, and one idle lane at a time; the
    // others sleep, leaving the cores to the transport when many callers step at once.
    bool poll_when_busy = false;
  };
  static absl::StatusOr<std::unique_ptr<StepPipeline>> Create(const Options& options,
                                                              StepDevice* device);
  ~StepPipeline() override;  // finishes the batches it was given, then stops

  int MaxInFlightBatches() const override { return static_cast<int>(lanes_.size()); }
  // Takes a batch of StepJobs (JobKind::kStep) of one key.
  void RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) override;

  const StepDevice& device() const { return *device_; }

 private:
  struct Work {
    std::vector<std::unique_ptr<StepJob>> batch;
    std::function<void(const BatchReport&)> on_finished;
  };

  StepPipeline(const Options& options, StepDevice* device);
  void LaneLoop(int lane);
  // Before a lane sleeps for work: whether it polls first (yielding its core), and if so polls
  // until a batch is queued or idle_poll has passed. Called and returns with mu_ held.
  void PollForWork(std::unique_lock<std::mutex>& lock);
  void RunOnLane(int lane, Work work);
  // Plans, stages, launches and waits for members (indices into jobs), splitting the launch
  // when the device has no room for it; fills status[i] of each member that failed.
  void RunLaunches(int lane, std::span<std::unique_ptr<StepJob>> jobs, std::span<size_t> members,
                   std::span<absl::Status> status, BatchReport* report);
  // The launch's plan over members whose appends have begun, its staging filled.
  absl::Status PlanAndStage(int lane, std::span<StepJob* const> members, StepLaunch* launch);
  // Commits (ok) or aborts every member's append and, on success, hands each its outputs.
  void EndLaunch(const StepLaunch& launch, const absl::Status& st);
  // Tells each job's caller: on this lane when its steps are one call's (a lone Step, or a
  // BatchStep's) and no other batch waits for a lane, else over the completion pool (several
  // answers sent in parallel, and the lane free for the waiting batch at once).
  void Finish(std::vector<std::unique_ptr<StepJob>> batch, std::vector<absl::Status> status);

  StepDevice* const device_;
  const Options options_;
  std::unique_ptr<CompletionPool> completions_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  std::atomic<size_t> queued_{0};  // queue_.size(), read without the lock
  std::atomic<int> busy_lanes_{0};   // lanes with a batch on the device (taken, not yet told)
  std::atomic<bool> idle_poller_{false};  // an idle lane is polling for the next batch
  bool stop_ = false;
  std::vector<std::thread> lanes_;
};

}  // namespace attn
