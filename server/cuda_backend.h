// The CUDA backend: each batch is packed into pinned staging, copied to the device, computed by
// one varlen launch of the fused kernel, copied back and scattered to its requests. Runs up to
// `streams` batches at once, one per lane (a CUDA stream with its own host thread), so that the
// staging and copies of one batch overlap the kernel of another.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "backend.h"
#include "device_pool.h"
#include "pinned_pool.h"

namespace attn {

class CudaBackend : public Backend {
 public:
  struct Options {
    int device = 0;
    int streams = 2;
    int64_t device_pool_bytes = 8ll << 30;
    int64_t pinned_pool_bytes = 2ll << 30;
  };
  // UNAVAILABLE when no usable GPU or no kernels are compiled in.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Options& options);
  ~CudaBackend() override;

  const BackendInfo& Info() const override { return info_; }
  int MaxInFlightBatches() const override { return static_cast<int>(lanes_.size()); }
  void RunBatch(Batch batch, std::function<void(const BatchReport&)> on_finished) override;
  BackendMemory Memory() const override;

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t events[4] = {};  // start, inputs copied, kernel done, outputs copied
    std::thread thread;
  };
  struct Work {
    Batch batch;
    std::function<void(const BatchReport&)> on_finished;
  };

  explicit CudaBackend(const Options& options) : options_(options) {}
  absl::Status Init();
  void LaneLoop(Lane* lane);
  // Runs one batch on lane; fills timings into the jobs and report.
  absl::Status Process(Lane& lane, Batch& batch, BatchReport* report);

  const Options options_;
  BackendInfo info_;
  std::unique_ptr<DevicePool> device_pool_;
  std::unique_ptr<PinnedPool> pinned_pool_;
  std::vector<std::unique_ptr<Lane>> lanes_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  bool stop_ = false;
};

}  // namespace attn
