// The CUDA backend. Prepare stages each request into pinned memory on its caller's thread. A
// batch is then gathered into one packed device buffer (async copies), computed by one varlen
// launch of the fused kernel, and its outputs copied back into each request's pinned buffer; the
// completion pool copies them into the responses and finishes the calls. Runs up to `streams`
// batches at once, one per lane (a CUDA stream with its own host thread), so that the copies of
// one batch overlap the kernel of another.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/kernels/cpu_thread_pool.h"
#include "engine/backend.h"
#include "engine/completion_pool.h"
#include "memory/device_pool.h"
#include "backends/host_copy.h"
#include "memory/pinned_pool.h"

namespace attn {

struct StepLaunch;
struct StepResults;

class CudaBackend : public Backend {
 public:
  struct Options {
    int device = 0;
    int streams = 2;
    int64_t device_pool_bytes = 8ll << 30;
    int64_t pinned_pool_bytes = 2ll << 30;
    // KV cache region of sessions (device memory, keys and values); 0: 80% of the memory free
    // at start after device_pool_bytes and 1 GiB of headroom.
    int64_t kv_cache_bytes = 0;
    int64_t kv_page_bytes = int64_t{32} << 10;
    // Threads that copy results into responses and finish calls.
    int completion_threads = std::clamp<int>(std::thread::hardware_concurrency() / 2, 2, 8);
    // Threads (the caller counted) that share a large request's host copies.
    int copy_threads = std::clamp<int>(std::thread::hardware_concurrency() / 2, 2, 8);
  };
  // UNAVAILABLE when no usable GPU or no kernels are compiled in.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Options& options);
  ~CudaBackend() override;

  const BackendInfo& Info() const override { return info_; }
  int MaxInFlightBatches() const override { return static_cast<int>(lanes_.size()); }
  // Stages the job's inputs into pinned memory; RESOURCE_EXHAUSTED when the pinned pool is full.
  absl::Status Prepare(AttendJob& job) override;
  // 16-bit requests whose q, k and v all arrive inline: straight from the received slices into
  // pinned staging (over the copy threads when large). Others as Backend's (float32 is then
  // converted into staging by Prepare).
  absl::Status StageWireInputs(AttendJob& job, const WireTensors& in) override;
  void RunBatch(Batch batch, std::function<void(const BatchReport&)> on_finished) override;
  BackendMemory Memory() const override;
  KvRegion kv_region() const override { return kv_; }
  // UNAVAILABLE once a sticky CUDA error has made the device context unusable.
  absl::Status Health() const override;
  // cudaIpcOpenMemHandle on this backend's device, its extent checked with the driver's
  // cuMemGetAddressRange; INVALID_ARGUMENT (naming the field) for a bad handle, device or size.
  absl::StatusOr<GpuImport> ImportIpcMemory(const std::string& handle, int32_t device_id,
                                            uint64_t bytes) override;
  absl::StatusOr<GpuImport> ImportVmmMemory(int fd, int32_t device_id, uint64_t bytes) override;
  bool HasGpu() const override { return true; }
  // cudaHostRegister (portable), undone by cudaHostUnregister; RESOURCE_EXHAUSTED when the
  // driver cannot page-lock the memory (limits, memory pressure).
  absl::StatusOr<std::function<void()>> RegisterHostMemory(char* data, uint64_t bytes) override;

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t events[4] = {};  // start, inputs copied, kernel done, outputs copied
    std::thread thread;
    // Device time per byte moved of this lane's large step launches, the fastest seen lately: at
    // least how long the next one will take.
    double device_us_per_byte = 0;
  };
  struct Work {
    Batch batch;
    std::function<void(const BatchReport&)> on_finished;
  };

  explicit CudaBackend(const Options& options) : options_(options) {}
  absl::Status Init();
  absl::Status AllocateKvRegion();
  void LaneLoop(Lane* lane);
  // Runs jobs as one launch, or, when the device pool cannot hold them together, as smaller
  // launches; fills one status per job.
  void RunSplittingOnExhaustion(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                std::span<absl::Status> status, BatchReport* report);
  // A batch of session steps: one paged launch over the KV region; one status per job. Returns
  // the launch's outputs (null when it failed), still to be copied into the responses.
  std::shared_ptr<const StepResults> RunSteps(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                              std::span<absl::Status> status, BatchReport* report);
  absl::Status LaunchSteps(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                           const StepLaunch& launch, BatchReport* report,
                           std::shared_ptr<StepResults>* results);
  // Copies each step's outputs into its response and tells its caller: on this lane for a
  // small launch, else over the completion pool.
  void FinishSteps(Batch batch, std::vector<absl::Status> status,
                   std::shared_ptr<const StepResults> results);
  // After a failed launch: records the error if it left the context unusable.
  void NoteIfDeviceLost(Lane& lane);
  // One packed launch of jobs on lane, waited for; adds its timings to the jobs and report.
  absl::Status Launch(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs, BatchReport* report);
  // Jobs whose tensors all lie in GPU regions, each launched over its regions in place (no copy
  // of a tensor), one after the other on lane's stream, waited for together.
  absl::Status LaunchInPlace(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                             BatchReport* report);

  const Options options_;
  BackendInfo info_;
  std::unique_ptr<DevicePool> device_pool_;
  std::unique_ptr<PinnedPool> pinned_pool_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::unique_ptr<CompletionPool> completions_;
  std::unique_ptr<kernels::cpu::CpuThreadPool> copy_pool_;
  std::unique_ptr<HostCopier> copier_;
  KvRegion kv_;  // cudaMalloc'ed by AllocateKvRegion, freed by the destructor
  std::atomic<int> sticky_error_{cudaSuccess};  // cudaError_t that made the context unusable

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  bool stop_ = false;
};

}  // namespace attn
