// What a backend supplies to the step pipeline (sessions/step_pipeline.h): the KV region, the
// memory a launch is staged in, and the copies and kernels of one launch. Everything else of a
// step (pages, the page table, staging, commit or rollback, answering) is the pipeline's, the
// same on every backend. backends/cpu_step_device.h and backends/cuda_step_device.h implement it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/output_bytes.h"
#include "sessions/step_job.h"
#include "sessions/step_launch.h"

namespace attn {

// The KV cache region of sessions, in the memory the device computes in (host for the CPU
// backend, device memory for CUDA): num_pages pool pages of page_bytes of keys from k, and the
// values of page p at the same offset from v. Owned by the step device.
struct KvRegion {
  char* k = nullptr;
  char* v = nullptr;
  int64_t num_pages = 0;
  int64_t page_bytes = 0;
};

// Device time of a launch's parts, for the steps' timings and metrics.
struct StepLaunchTimes {
  double in_us = 0;      // inputs onto the device, copy-on-write and appended rows
  double kernel_us = 0;  // attention
  double out_us = 0;     // outputs back
  // FP8 cache: elements of 16-bit k_new/v_new that saturated to +-448 as the device quantized them
  // into the cache (|x / scale| > 448, infinities included).
  int64_t fp8_saturations = 0;
};

class StepDevice {
 public:
  virtual ~StepDevice() = default;

  // Launches the device keeps in flight at once, each on a lane of its own: the pipeline runs
  // one launch per lane at a time, so that the host work of one overlaps another's device time.
  virtual int Lanes() const = 0;
  virtual KvRegion kv_region() const = 0;
  // Copies between the KV region and host memory, for moving a session to another replica
  // (sessions/session_transfer.h); they return once the bytes are in place, and a step launched
  // after sees them. A host region (the CPU backend's) is copied with memcpy.
  virtual absl::Status ReadKv(char* host, const char* kv, size_t bytes) const {
    std::memcpy(host, kv, bytes);
    return absl::OkStatus();
  }
  virtual absl::Status WriteKv(char* kv, const char* host, size_t bytes) const {
    std::memcpy(kv, host, bytes);
    return absl::OkStatus();
  }
  // An error once the device cannot compute any more (every step then fails with it).
  virtual absl::Status Health() const { return absl::OkStatus(); }

  // Which of job's tensors the device moves straight between where they lie and itself.
  virtual StepRoute RouteOf(const StepJob& /*job*/) const { return {}; }
  // True when a launch of these members runs over their tensors where they lie, copying none.
  virtual bool RunsInPlace(std::span<StepJob* const> /*members*/) const { return false; }

  // Host memory for the inputs of lane's next launch: at least `bytes`, valid until lane's next
  // call. RESOURCE_EXHAUSTED when there is none to be had.
  virtual absl::StatusOr<char*> InputStaging(int lane, size_t bytes) = 0;
  // Host memory the outputs of one launch come back into, handed on to the answers of its
  // steps (shared by them; returned to its pool once the last answer lets go of it).
  virtual absl::StatusOr<OutputBytes> OutputStaging(size_t bytes) = 0;

  // Starts the launch on lane: its staged and direct inputs onto the device, the copy-on-write
  // rows and the new rows into the KV region (for an FP8 cache with 16-bit k_new/v_new, each
  // quantized with its member's scales as it is written: launch.Fp8Quantizes()), the kernel, the outputs back (into launch.out, or
  // straight into direct outputs' regions). May return before the work is done. An error leaves
  // nothing of the launch running; RESOURCE_EXHAUSTED when device memory for it is short (the
  // pipeline then runs its members in smaller launches).
  virtual absl::Status Launch(int lane, const StepLaunch& launch) = 0;
  // Returns once lane's launch is done, with the device time of its parts.
  virtual absl::StatusOr<StepLaunchTimes> Wait(int lane, const StepLaunch& launch) = 0;
};

}  // namespace attn
