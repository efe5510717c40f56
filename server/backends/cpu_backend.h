// The CPU backend: runs each Attend request of a batch in place (no copies) on a shared thread
// pool. Batches run on a worker thread of its own, so that RunBatch returns at once and the
// batcher keeps sweeping its queue (deadlines, cancellations) while a batch computes. Session
// steps run on the same pool through its step device (cpu_step_device.h).
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/kernels/cpu_thread_pool.h"
#include "engine/backend.h"

namespace attn {

class CpuBackend : public Backend {
 public:
  struct Options {
    int threads = 0;  // 0: one per core
    std::vector<int32_t> head_dims = {32, 64, 96, 128, 256};
  };
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const Options& options);
  ~CpuBackend() override;

  const BackendInfo& Info() const override { return info_; }
  int MaxInFlightBatches() const override { return 1; }
  void RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) override;
  // The pool Attend and session steps compute on.
  kernels::cpu::CpuThreadPool* thread_pool() const { return pool_.get(); }

 private:
  CpuBackend(BackendInfo info, std::unique_ptr<kernels::cpu::CpuThreadPool> pool);
  absl::Status RunJob(AttendJob& job);
  void* Workspace(const kernels::AttentionArgs& args);
  void Compute(AttendBatch& batch, const std::function<void(const BatchReport&)>& on_finished);
  void WorkerLoop();

  BackendInfo info_;
  std::unique_ptr<kernels::cpu::CpuThreadPool> pool_;
  std::vector<char> workspace_;  // grown on demand; used by the worker thread only

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<AttendBatch, std::function<void(const BatchReport&)>>> queue_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace attn
