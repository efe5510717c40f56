// The CUDA backend's step device: the KV region in device memory, each lane a CUDA stream with
// its own pinned input staging, and a launch enqueued as one H2D copy of the staging (tensors of
// registered host regions and GPU regions straight from where they lie), the copy-on-write and
// append row copies into the KV region, the paged kernel, and the D2H copy of the outputs into
// the launch's pinned output staging (sent from there) or straight into output regions. A lone
// step whose tensors all lie in GPU regions runs over them in place, copying none.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/kernels/cuda_attention.h"
#include "backends/cuda_device_state.h"
#include "backends/cuda_util.h"
#include "backends/segment_copy.h"
#include "sessions/step_device.h"

namespace attn {

class CudaStepDevice : public StepDevice {
 public:
  struct Options {
    int lanes = 2;
    // KV cache region of sessions (device memory, keys and values); 0: 80% of the memory free
    // now, less reserve_bytes and 1 GiB of headroom.
    int64_t kv_cache_bytes = 0;
    int64_t kv_page_bytes = int64_t{32} << 10;
    int64_t reserve_bytes = 0;
    // FP8-cache steps of more than 16 new tokens (chunked prefill): q quantized to e4m3 and the
    // FP8 tensor-core kernel where it serves the launch (kernels::cuda::PlanOptions).
    bool fp8_tensor_cores = false;
    // 16-bit decode launches: the new rows written into their pages by the decode kernel
    // (kernels::PagedKv::append_k), not by a copy kernel before it.
    bool append_in_kernel = true;
    // Small decode launches whose outputs all come back through the output staging: o and lse
    // written by the decode kernel straight into that (pinned, mapped) staging, with no copy
    // after it.
    bool output_to_host = true;
    // Decode launches with KV splits: merged by the split kernel's last CTA of each group, on
    // counters at the start of the lane's workspace (kernels::cuda::PlanOptions::
    // decode_fused_combine), not by a combine kernel after it.
    bool fused_combine = true;
  };
  // A region of no pages (the device has no room for one) gives FAILED_PRECONDITION.
  static absl::StatusOr<std::unique_ptr<CudaStepDevice>> Create(
      const Options& options, std::shared_ptr<CudaDeviceState> state);
  ~CudaStepDevice() override;

  int Lanes() const override { return static_cast<int>(lanes_.size()); }
  KvRegion kv_region() const override { return kv_; }
  absl::Status Health() const override { return state_->Health(); }
  StepRoute RouteOf(const StepJob& job) const override;
  // One member whose tensors all lie in GPU regions, 16-byte aligned (as the kernels and the row
  // copies read and write them).
  bool RunsInPlace(std::span<StepJob* const> members) const override;
  absl::StatusOr<char*> InputStaging(int lane, size_t bytes) override;
  absl::StatusOr<OutputBytes> OutputStaging(size_t bytes) override;
  absl::Status Launch(int lane, const StepLaunch& launch) override;
  absl::StatusOr<StepLaunchTimes> Wait(int lane, const StepLaunch& launch) override;
  // Synchronous copies on the default stream (the lanes' streams are non-blocking, so these
  // wait for no launch); the pages copied belong to a session with no step running.
  absl::Status ReadKv(char* host, const char* kv, size_t bytes) const override;
  absl::Status WriteKv(char* kv, const char* host, size_t bytes) const override;

 private:
  // Device memory a lane keeps from launch to launch (from the device pool, on the lane's
  // stream), so that a launch like the last one allocates nothing; regrown when a launch needs
  // more, or much less.
  class LaneMemory {
   public:
    // At least `bytes` (null for none), valid for the lane's launches until the next call.
    absl::StatusOr<char*> Get(DevicePool* pool, cudaStream_t stream, size_t bytes);
    // For a launch about to use the memory Get returned: its first `counter_bytes` zero (a decode
    // plan's split counters, which the launch leaves zero), the rest the launch's to write. Sets
    // them on the stream only where an earlier launch may have written there.
    absl::Status PrepareForLaunch(size_t counter_bytes, cudaStream_t stream);
    void Release() {
      buffer_.reset();
      capacity_ = 0;
      zero_prefix_ = 0;
    }
    size_t capacity() const { return capacity_; }

   private:
    std::unique_ptr<DeviceBuffer> buffer_;
    size_t capacity_ = 0;
    size_t zero_prefix_ = 0;  // leading bytes known to be zero once the stream's work is done
  };
  struct Lane {
    cudaStream_t stream = nullptr;
    // start, inputs in (recorded only when outputs are copied after the kernel), kernel done
    // (likewise), end
    cudaEvent_t events[4] = {};
    PinnedBuffer staging;        // input staging, grown on demand, reused launch after launch
    PinnedBuffer segments;       // the segment table's host side (CopySegment), likewise
    // The device copy of the input staging, the launch's outputs, the kernel's workspace.
    LaneMemory in, out, workspace;
    // What the lane keeps after a launch: its buffers while they stay within its share of the
    // device pool, else nothing (a lane that held a large part of a small pool between launches
    // would make the other lanes' launches fail for want of memory that sits idle).
    void KeepWithin(size_t share) {
      if (in.capacity() + out.capacity() + workspace.capacity() <= share) return;
      in.Release();
      out.Release();
      workspace.Release();
    }
    // Device time per byte moved of this lane's large launches, the fastest seen lately: at
    // least how long the next one will take.
    double device_us_per_byte = 0;
    double expected_bytes = 0;  // of the launch in flight
    // The launch in flight copies outputs after its kernel (and times its inputs' copy apart).
    bool copies_out = true;
  };

  CudaStepDevice(std::shared_ptr<CudaDeviceState> state) : state_(std::move(state)) {}
  absl::Status Init(const Options& options);
  absl::Status AllocateKvRegion(const Options& options);
  absl::Status Enqueue(Lane& lane, const StepLaunch& launch);
  // Copies of the tensors in GPU regions (StepRoute::device), done by one segment-copy kernel for
  // the inputs and one for the outputs. FillSegments writes the table, inputs first, and returns
  // how many are inputs.
  static int32_t CountSegments(const StepLaunch& l);
  static int32_t FillSegments(const StepLaunch& l, char* dev_in, char* dev_out, CopySegment* table);
  static absl::Status CopyInputs(const StepLaunch& l, char* dev, const CopySegment* segments,
                                 int32_t n, cudaStream_t stream);
  static absl::Status CopyOutputs(const StepLaunch& l, const char* dev,
                                  const CopySegment* segments, int32_t n, cudaStream_t stream);
  // The kernel's plan for args and its workspace from the lane's memory. A decode plan whose
  // split-KV partials do not fit the device pool runs unsplit instead (no workspace): slower for
  // that launch, where failing would refuse a step whose tensors the pool holds.
  absl::Status PlanLaunch(const kernels::AttentionArgs& args, Lane& lane, kernels::cuda::Plan* plan,
                          char** workspace);

  std::shared_ptr<CudaDeviceState> state_;
  // Every launch's (Options::fp8_tensor_cores, fused_combine).
  kernels::cuda::PlanOptions plan_options_;
  bool append_in_kernel_ = true;              // Options::append_in_kernel
  bool output_to_host_ = true;                // Options::output_to_host
  KvRegion kv_;  // cudaMalloc'ed by AllocateKvRegion, freed by the destructor
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace attn
