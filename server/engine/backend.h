// The compute backend behind the batcher for Attend requests (CpuBackend or CudaBackend), and what
// it offers the rest of the server: its description, memory imports for shared-memory regions,
// its health. Session steps run through the step pipeline instead (sessions/step_pipeline.h),
// over the step device the backend's folder supplies (backends/).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attend_job.h"
#include "engine/batch_runner.h"
#include "engine/wire_tensors.h"
#include "memory/memory_bytes.h"

namespace attn {

struct BackendInfo {
  std::string name;         // "cpu" or "cuda"
  std::string device_name;  // GPU or CPU model
  int32_t compute_units = 0;
  int64_t device_memory_bytes = 0;
  int32_t compute_capability = 0;
  std::vector<int32_t> head_dims;
  std::string build_info;
  Fp8Features fp8;
};

// A client's GPU memory imported into the backend's device context (shared-memory regions).
struct GpuImport {
  char* data = nullptr;  // device address
  uint64_t bytes = 0;
  std::function<void()> release;  // closes the import; called once no request uses it
};

// Memory a backend holds, for metrics; zeros where it has none of a kind.
struct BackendMemory {
  MemoryBytes device_pool;
  MemoryBytes pinned_pool;
  int64_t gpu_used = 0;
  int64_t gpu_free = 0;
  int64_t gpu_total = 0;
};

// RunBatch (BatchRunner's) takes batches of AttendJobs.
class Backend : public BatchRunner {
 public:
  virtual const BackendInfo& Info() const = 0;

  // Runs on the submitting (gRPC) thread before the job is queued, so that per-request host
  // work such as staging the inputs into pinned memory runs in parallel across callers. Sees to
  // it that every output the job does not write into a region has a place (job.o_out, lse_out)
  // or will be handed back in job.o and job.lse. An error fails this request only; the job is
  // then not queued. Default: outputs into buffers of the job's own (PrepareHostOutputs).
  virtual absl::Status Prepare(AttendJob& job);

  // The wire path of Attend, before Prepare: q, k and v arrive as pieces of gRPC's received
  // slices instead of in a request message. Copies each inline one (a tensor in a region has no
  // pieces) to where the backend computes or stages from and points job.q_bytes, k_bytes and
  // v_bytes there: the one host copy of the request. The pieces are not used after it returns.
  // An error fails this request only. Default: into host memory the job owns (host_inputs).
  virtual absl::Status StageWireInputs(AttendJob& job, const WireTensors& in);

  virtual BackendMemory Memory() const { return {}; }

  // Imports GPU memory another process shared with a legacy CUDA IPC handle (the 64 bytes of a
  // cudaIpcMemHandle_t) on device device_id; bytes from its start must lie inside the
  // allocation. FAILED_PRECONDITION on backends without a GPU.
  virtual absl::StatusOr<GpuImport> ImportIpcMemory(const std::string& /*handle*/,
                                                    int32_t /*device_id*/, uint64_t /*bytes*/) {
    return absl::FailedPreconditionError("GPU regions need attnd's CUDA backend");
  }
  // Imports GPU memory another process allocated with the CUDA virtual memory API, from the
  // POSIX file descriptor it exported (borrowed: the caller closes it), on device device_id;
  // maps its first `bytes`. FAILED_PRECONDITION on backends without a GPU.
  virtual absl::StatusOr<GpuImport> ImportVmmMemory(int /*fd*/, int32_t /*device_id*/,
                                                    uint64_t /*bytes*/) {
    return absl::FailedPreconditionError("GPU regions need attnd's CUDA backend");
  }
  virtual bool HasGpu() const { return false; }
  // Registers host memory (a shared-memory region's mapping in attnd) with the backend's device,
  // so that requests whose tensors lie in it are copied straight between it and the device
  // without staging (Job::host_registered). Returns what undoes the registration: the caller
  // runs it once, before unmapping the memory and once no request uses it. The memory must stay
  // mapped and the same size until then. An error leaves the memory unregistered (it is then
  // served through staging). FAILED_PRECONDITION on backends without a device: the CPU backend
  // computes on host regions in place.
  virtual absl::StatusOr<std::function<void()>> RegisterHostMemory(char* /*data*/,
                                                                   uint64_t /*bytes*/) {
    return absl::FailedPreconditionError("this backend has no device to register memory with");
  }

  // OK while the backend can compute; an error once it cannot without a restart (a sticky CUDA
  // error leaves the device context unusable). attnd then reports NOT_SERVING.
  virtual absl::Status Health() const { return absl::OkStatus(); }
};

// Backend::StageWireInputs' default: copies in's inline tensors back to back into host memory
// the job owns (host_inputs) and points job's q_bytes, k_bytes and v_bytes there.
void StageWireInputsOnHost(const WireTensors& in, AttendJob* job);

// Backend::Prepare's default: each output the job writes neither into a region nor elsewhere
// already gets a buffer of its own (job.o, job.lse), which o_out and lse_out then point into.
void PrepareHostOutputs(AttendJob& job);

}  // namespace attn
