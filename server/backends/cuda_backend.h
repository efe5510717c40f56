// The CUDA backend of Attend. Prepare stages each request into pinned memory on its caller's
// thread. A batch is then gathered into one packed device buffer (async copies), computed by one
// varlen launch of the fused kernel, and its outputs copied back into each request's pinned
// buffer, from which they are sent as they are (16-bit dtypes) or converted (float32); the
// completion pool finishes the calls. Runs up to `streams` batches at once, one per lane (a CUDA
// stream with its own host thread), so that the copies of one batch overlap the kernel of
// another. Its parts live in files of their own: cuda_backend.cc (creation, description, health),
// cuda_lanes.cc (the lanes), cuda_attend_launch.cc (staging and launches of Attend),
// cuda_memory_import.cc (GPU regions, registered host regions). Session steps run on the step
// device it creates (CreateStepDevice, cuda_step_device.h), which shares its device state.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/kernels/cpu_thread_pool.h"
#include "backends/cuda_device_state.h"
#include "backends/cuda_step_device.h"
#include "backends/host_copy.h"
#include "engine/backend.h"
#include "engine/completion_pool.h"

namespace attn {

class CudaBackend : public Backend {
 public:
  struct Options {
    int device = 0;
    int streams = 2;
    int64_t device_pool_bytes = 8ll << 30;
    int64_t pinned_pool_bytes = 2ll << 30;
    // Threads that copy results into responses and finish calls.
    int completion_threads = std::clamp<int>(std::thread::hardware_concurrency() / 2, 2, 8);
    // Threads (the caller counted) that share a large request's host copies.
    int copy_threads = std::clamp<int>(std::thread::hardware_concurrency() / 2, 2, 8);
    // All-FP8 Attend launches (fp8_attend_tensor_cores), and FP8-cache session steps of more
    // than 16 new tokens (fp8_step_tensor_cores, through the step device), run the FP8
    // tensor-core kernel where it can take them (kernels::cuda::CanImplementFp8Attention /
    // CanImplementFp8TensorCores), else the conversion path.
    bool fp8_attend_tensor_cores = false;
    bool fp8_step_tensor_cores = false;
  };
  // UNAVAILABLE when no usable GPU or no kernels are compiled in.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Options& options);
  ~CudaBackend() override;

  // The step device of sessions on this backend's GPU (its KV region allocated now); null with a
  // message in the log when the GPU has no room for a KV region. Must be destroyed before the
  // backend.
  absl::StatusOr<std::unique_ptr<CudaStepDevice>> CreateStepDevice(
      const CudaStepDevice::Options& options);

  const BackendInfo& Info() const override { return info_; }
  int MaxInFlightBatches() const override { return static_cast<int>(lanes_.size()); }
  // Stages the job's inputs into pinned memory and places its outputs (pinned, or straight into
  // registered output regions); RESOURCE_EXHAUSTED when the pinned pool is full.
  absl::Status Prepare(AttendJob& job) override;
  // 16-bit requests whose q, k and v all arrive inline: straight from the received slices into
  // pinned staging (over the copy threads when large). Others as Backend's (float32 is then
  // converted into staging by Prepare).
  absl::Status StageWireInputs(AttendJob& job, const WireTensors& in) override;
  void RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) override;
  BackendMemory Memory() const override;
  // UNAVAILABLE once a sticky CUDA error has made the device context unusable.
  absl::Status Health() const override { return state_->Health(); }
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
  };
  struct Work {
    AttendBatch batch;
    std::function<void(const BatchReport&)> on_finished;
  };

  explicit CudaBackend(const Options& options) : options_(options) {}
  absl::Status Init();
  // cuda_lanes.cc
  absl::Status StartLanes();
  void StopLanes();
  void LaneLoop(Lane* lane);
  // Hands each finished job to the completion pool: its outputs from pinned staging into their
  // place (converted, for float32), then its caller is told.
  void CompleteJobs(AttendBatch batch, std::vector<absl::Status> status);
  // cuda_attend_launch.cc
  // Runs jobs as one launch, or, when the device pool cannot hold them together, as smaller
  // launches; fills one status per job.
  void RunSplittingOnExhaustion(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                std::span<absl::Status> status, BatchReport* report);
  // One packed launch of jobs on lane, waited for; adds its timings to the jobs and report.
  absl::Status Launch(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs, BatchReport* report);
  // Jobs whose tensors all lie in GPU regions, each launched over its regions in place (no copy
  // of a tensor), one after the other on lane's stream, waited for together.
  absl::Status LaunchInPlace(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                             BatchReport* report);
  // A finished job's outputs, from its pinned staging, into job.o and job.lse (sent from there)
  // or into its unregistered output regions.
  void UnstageOutputs(AttendJob& job) const;
  // True for a job whose tensors all lie in GPU regions and whose q is large: it runs by a
  // launch of its own over its regions in place (runs_alone).
  static bool AttendsInPlace(const AttendJob& job);

  const Options options_;
  BackendInfo info_;
  std::shared_ptr<CudaDeviceState> state_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::unique_ptr<CompletionPool> completions_;
  std::unique_ptr<kernels::cpu::CpuThreadPool> copy_pool_;
  std::unique_ptr<HostCopier> copier_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  bool stop_ = false;
};

}  // namespace attn
