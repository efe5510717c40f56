// Small helpers the parts of the CUDA backend share: CUDA errors as absl::Status, device memory of
// one launch from the device pool, a guard that waits for a stream on an error path, and the
// wait for a launch's last event.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "memory/device_pool.h"

namespace attn {

inline absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

#define RETURN_IF_CUDA_ERROR(what, expr)                                        \
  do {                                                                          \
    if (cudaError_t _e = (expr); _e != cudaSuccess) return CudaError(what, _e); \
  } while (0)

// A lane's stream and its four timing events. The lane waits on the last: that one blocks in the
// driver until the device is done (a default event would spin there on a busy host).
absl::Status CreateLaneStream(cudaStream_t* stream, cudaEvent_t (&events)[4]);
void DestroyLaneStream(cudaStream_t stream, cudaEvent_t (&events)[4]);

// Errors after which every later call in the context fails: only a new process recovers.
bool IsStickyCudaError(cudaError_t e);

constexpr size_t kCudaAlign = 256;
inline size_t AlignUp(size_t n) { return (n + kCudaAlign - 1) / kCudaAlign * kCudaAlign; }
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline float ElapsedMs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms;
}

// Device memory of one launch, returned to the pool (stream-ordered) when it goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer(DevicePool* pool, cudaStream_t stream) : pool_(pool), stream_(stream) {}
  ~DeviceBuffer() { pool_->Free(ptr_, bytes_, stream_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    auto p = pool_->Allocate(bytes, stream_);
    if (!p.ok()) return p.status();
    ptr_ = static_cast<char*>(*p);
    bytes_ = bytes;
    return absl::OkStatus();
  }
  char* get() const { return ptr_; }

 private:
  DevicePool* pool_;
  cudaStream_t stream_;
  char* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Waits for the stream when it goes out of scope on an error path, so that no buffer is handed
// back (pinned staging to its pool, a job to its caller) while an enqueued copy may still use it.
class SyncStreamUnlessDone {
 public:
  explicit SyncStreamUnlessDone(cudaStream_t s) : s_(s) {}
  ~SyncStreamUnlessDone() {
    if (!done_) cudaStreamSynchronize(s_);
  }
  void Done() { done_ = true; }

 private:
  cudaStream_t s_;
  bool done_ = false;
};

// Waits for event without a blocking wait, whose interrupt-driven wake-up costs tens of
// microseconds: sleeps through sleep_us (most of a large launch's expected time, leaving the core
// to the transport), then polls, yielding the core, for up to poll_for; then blocks.
cudaError_t PollEvent(cudaEvent_t event, double sleep_us, std::chrono::microseconds poll_for);

}  // namespace attn
