#include "backends/cuda_device_state.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "backends/cuda_util.h"
#include "common/status_util.h"

namespace attn {
namespace {

// A pinned buffer handed on as an output; the pool outlives it (the buffer is destroyed first).
struct PinnedOwner {
  std::shared_ptr<PinnedPool> pool;
  PinnedBuffer buffer;
};

}  // namespace

absl::StatusOr<std::shared_ptr<CudaDeviceState>> CudaDeviceState::Create(
    int device, int64_t device_pool_bytes, int64_t pinned_pool_bytes) {
  std::shared_ptr<CudaDeviceState> s(new CudaDeviceState(device));
  ASSIGN_OR_RETURN(s->device_pool_, DevicePool::Create(device, device_pool_bytes));
  PinnedPool::Allocator host_alloc{
      [](size_t bytes) -> void* {
        void* p = nullptr;
        return cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) == cudaSuccess ? p : nullptr;
      },
      [](void* p) { cudaFreeHost(p); }};
  ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pinned,
                   PinnedPool::Create(pinned_pool_bytes, host_alloc));
  s->pinned_pool_ = std::move(pinned);
  return s;
}

OutputBytes CudaDeviceState::AsOutput(PinnedBuffer buffer) const {
  auto owner = std::make_shared<PinnedOwner>();
  owner->pool = pinned_pool_;
  owner->buffer = std::move(buffer);
  char* data = static_cast<char*>(owner->buffer.data());
  const size_t size = owner->buffer.size();
  return {data, size, std::move(owner)};
}

absl::StatusOr<OutputBytes> CudaDeviceState::AcquireOutput(size_t bytes) const {
  ASSIGN_OR_RETURN(PinnedBuffer buffer, pinned_pool_->Acquire(bytes));
  return AsOutput(std::move(buffer));
}

absl::Status CudaDeviceState::Health() const {
  const auto e = static_cast<cudaError_t>(sticky_error_.load());
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "the GPU context of this attnd is unusable after ", cudaGetErrorName(e), " (",
      cudaGetErrorString(e), "); retry on another replica, this one must be restarted"));
}

void CudaDeviceState::NoteIfDeviceLost(cudaStream_t stream) {
  const cudaError_t e = cudaStreamQuery(stream);
  if (!IsStickyCudaError(e)) return;
  int expected = cudaSuccess;
  if (sticky_error_.compare_exchange_strong(expected, e)) {
    std::fprintf(stderr, "attnd: the GPU context is unusable after %s: %s; restart attnd\n",
                 cudaGetErrorName(e), cudaGetErrorString(e));
  }
}

}  // namespace attn
