// The CPU backend: runs each request of a batch in place (no copies) on a shared thread pool.
// Batches run on a worker thread of its own, so that RunBatch returns at once and the batcher
// keeps sweeping its queue (deadlines, cancellations) while a batch computes.
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
    // The KV cache region of sessions (host memory, touched only as pages are used).
    int64_t kv_cache_bytes = int64_t{256} << 20;
    int64_t kv_page_bytes = int64_t{32} << 10;
  };
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const Options& options);
  ~CpuBackend() override;

  const BackendInfo& Info() const override { return info_; }
  int MaxInFlightBatches() const override { return 1; }
  void RunBatch(Batch batch, std::function<void(const BatchReport&)> on_finished) override;
  KvRegion kv_region() const override { return kv_; }

 private:
  CpuBackend(BackendInfo info, std::unique_ptr<kernels::cpu::CpuThreadPool> pool);
  absl::Status RunJob(AttendJob& job);
  void* Workspace(const kernels::AttentionArgs& args);
  // A batch of session steps: one paged launch.
  void ComputeSteps(Batch& batch, const std::function<void(const BatchReport&)>& on_finished);
  void Compute(Batch& batch, const std::function<void(const BatchReport&)>& on_finished);
  void WorkerLoop();

  BackendInfo info_;
  std::unique_ptr<kernels::cpu::CpuThreadPool> pool_;
  std::vector<char> workspace_;  // grown on demand; used by the worker thread only
  KvRegion kv_;                   // mmap'ed at creation, unmapped by the destructor
  std::vector<char> step_q_, step_o_;  // packed q and o of a step launch (worker thread only)
  std::vector<float> step_lse_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Batch, std::function<void(const BatchReport&)>>> queue_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace attn
