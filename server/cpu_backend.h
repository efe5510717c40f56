// The CPU backend: runs each request of a batch in place (no copies) on a shared thread pool.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/kernels/cpu_thread_pool.h"
#include "backend.h"

namespace attn {

class CpuBackend : public Backend {
 public:
  struct Options {
    int threads = 0;  // 0: one per core
    std::vector<int32_t> head_dims = {32, 64, 96, 128, 256};
  };
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const Options& options);

  const BackendInfo& Info() const override { return info_; }
  int MaxInFlightBatches() const override { return 1; }
  void RunBatch(Batch batch, std::function<void(const BatchReport&)> on_finished) override;

 private:
  CpuBackend(BackendInfo info, std::unique_ptr<kernels::cpu::CpuThreadPool> pool);
  absl::Status RunJob(AttendJob& job);

  BackendInfo info_;
  std::unique_ptr<kernels::cpu::CpuThreadPool> pool_;
  std::vector<char> workspace_;  // grown on demand; only the batcher's one thread calls in
};

}  // namespace attn
