// The CPU backend's step device: the KV region in host memory, staging in plain host memory, and
// each launch computed at once on the backend's thread pool (its Launch returns when the work is
// done). One lane: the pool is the whole CPU.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/kernels/cpu_thread_pool.h"
#include "sessions/step_device.h"

namespace attn {

class CpuStepDevice : public StepDevice {
 public:
  struct Options {
    // The KV cache region of sessions (host memory, touched only as pages are used).
    int64_t kv_cache_bytes = int64_t{256} << 20;
    int64_t kv_page_bytes = int64_t{32} << 10;
  };
  // pool (the backend's) must outlive the device.
  static absl::StatusOr<std::unique_ptr<CpuStepDevice>> Create(const Options& options,
                                                               kernels::cpu::CpuThreadPool* pool);
  ~CpuStepDevice() override;

  int Lanes() const override { return 1; }
  KvRegion kv_region() const override { return kv_; }
  absl::StatusOr<char*> InputStaging(int lane, size_t bytes) override;
  absl::StatusOr<OutputBytes> OutputStaging(size_t bytes) override;
  absl::Status Launch(int lane, const StepLaunch& launch) override;
  absl::StatusOr<StepLaunchTimes> Wait(int lane, const StepLaunch& launch) override;

 private:
  CpuStepDevice(kernels::cpu::CpuThreadPool* pool) : pool_(pool) {}
  // The launch's 16-bit new rows (k, v in its staging) quantized into the FP8 cache's rows, each
  // with its member's scales; returns the elements that saturated.
  int64_t AppendQuantized(const StepLaunch& launch, const char* k, const char* v);

  kernels::cpu::CpuThreadPool* const pool_;
  KvRegion kv_;                 // mmap'ed at creation, unmapped by the destructor
  std::vector<char> staging_;   // the lane's input staging, grown on demand
  std::vector<char> workspace_;
  StepLaunchTimes last_;        // of the launch Launch computed
};

}  // namespace attn
