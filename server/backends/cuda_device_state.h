// What the parts of the CUDA backend share (the Attend lanes, the step device, the memory
// imports): the device, its memory pools, and whether its context is still usable. Shared by
// them (shared_ptr): outputs sent from pinned memory keep the pinned pool alive until gRPC has
// let go of them, which may be after the backend is gone.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/output_bytes.h"
#include "memory/device_pool.h"
#include "memory/pinned_pool.h"

namespace attn {

class CudaDeviceState {
 public:
  // Creates the pools on device (which must be current).
  static absl::StatusOr<std::shared_ptr<CudaDeviceState>> Create(int device,
                                                                 int64_t device_pool_bytes,
                                                                 int64_t pinned_pool_bytes);

  int device() const { return device_; }
  DevicePool& device_pool() const { return *device_pool_; }
  PinnedPool& pinned_pool() const { return *pinned_pool_; }

  // Pinned memory handed on as an output (OutputBytes): it returns to the pool once the last
  // holder lets go of it. RESOURCE_EXHAUSTED when the pool is full.
  absl::StatusOr<OutputBytes> AcquireOutput(size_t bytes) const;
  // A loaned buffer as an output, owner included.
  OutputBytes AsOutput(PinnedBuffer buffer) const;

  // UNAVAILABLE once a sticky CUDA error has made the device context unusable.
  absl::Status Health() const;
  // After a failed launch on stream: records the error if it left the context unusable.
  void NoteIfDeviceLost(cudaStream_t stream);

 private:
  CudaDeviceState(int device) : device_(device) {}

  const int device_;
  std::unique_ptr<DevicePool> device_pool_;
  std::shared_ptr<PinnedPool> pinned_pool_;
  std::atomic<int> sticky_error_{cudaSuccess};  // cudaError_t that made the context unusable
};

}  // namespace attn
