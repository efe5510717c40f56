// One Attend request (or one Step of a KV-cache session) on its way through the server: the
// validated view of the request, where its answer goes, and when it must be done. Created by the
// service reactor, owned by the batcher while queued, then by the backend until `done` is
// called, exactly once.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "attn/kernels/attention.h"
#include "attn/v1/attention.pb.h"

namespace attn {

using Clock = std::chrono::steady_clock;

inline double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

// Requests that share a key can be packed into one varlen launch.
struct BatchKey {
  kernels::DType wire_dtype = kernels::DType::kBFloat16;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  bool causal = false;
  int32_t window_left = -1;
  int32_t window_right = -1;
  float softmax_scale = 0.0f;  // effective scale
  // The 16-bit type a backend staged the inputs in, where one wire dtype can compute in either
  // (the CUDA backend runs fp32 requests in fp16 when every value fits it, else in bf16). Set by
  // Backend::Prepare; unset on backends that compute in the wire dtype.
  std::optional<kernels::DType> staged_dtype;
  // Session steps (paged K/V): tokens per page of the sessions' KV row (0 for Attend), and
  // whether every step has one new token (decode), so that decode steps and chunked prefills
  // form separate launches.
  int32_t page_tokens = 0;
  bool decode = false;
  bool operator==(const BatchKey&) const = default;
};

struct StepWork;  // sessions/step_work.h

// What a backend keeps for one job between Prepare and the job's completion (pinned staging).
struct BackendJobState {
  virtual ~BackendJobState() = default;
};

// Calls a function when destroyed; move-only.
class ReleaseNotice {
 public:
  ReleaseNotice() = default;
  explicit ReleaseNotice(std::function<void()> on_release) : on_release_(std::move(on_release)) {}
  ReleaseNotice(ReleaseNotice&& other) noexcept : on_release_(std::exchange(other.on_release_, {})) {}
  ReleaseNotice& operator=(ReleaseNotice&& other) noexcept {
    if (this != &other) {
      if (on_release_) on_release_();
      on_release_ = std::exchange(other.on_release_, {});
    }
    return *this;
  }
  ~ReleaseNotice() {
    if (on_release_) on_release_();
  }

 private:
  std::function<void()> on_release_;
};

struct AttendJob {
  // Declared first, so destroyed last: tells the batcher that the job and all it holds (session
  // pages, region holds, staging buffers) are gone. Batcher::Drain waits for that, so a server
  // may free those owners once it has drained.
  ReleaseNotice released;

  // Borrowed from the call (the unary handler's or an AttendStream item's), which lives at least
  // until `done` has run; nothing reads them after that.
  const v1::AttendRequest* request = nullptr;
  v1::AttendResponse* response = nullptr;

  BatchKey key;
  // Sequence lengths of this request (host), [batch + 1] each.
  std::vector<int32_t> cu_seqlens_q;
  std::vector<int32_t> cu_seqlens_k;
  int32_t total_q = 0;
  int32_t total_k = 0;
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_k = 0;
  bool return_lse = false;
  bool high_priority = false;

  Clock::time_point arrival;
  Clock::time_point deadline = Clock::time_point::max();
  // True once the caller has gone away; queued work is then dropped.
  std::function<bool()> is_cancelled;

  // Filled by the batcher and the backend, then copied into response->timing.
  double queue_us = 0;
  double transfer_us = 0;
  double compute_us = 0;
  double host_copy_us = 0;
  int32_t batch_requests = 0;
  int64_t batch_tokens = 0;

  // Owned by the job; released with it, after done has run.
  std::unique_ptr<BackendJobState> backend_state;
  // Set for a session step (then request and response are null): its session, layer, tensors.
  std::shared_ptr<StepWork> step;
  // Tensor bytes the job holds in the server (inputs and sized outputs); for the batcher's
  // in-flight bound.
  int64_t bytes = 0;

  // Where q, k and v are read from: the request's data fields (set by ValidateAttendRequest), or
  // slices of shared-memory regions (transport/tensor_source.h).
  std::string_view q_bytes, k_bytes, v_bytes;
  // q, k and v as copied from the received message (Backend::StageWireInputs), where the backend
  // keeps no staging of its own for them; q_bytes.. point into it.
  std::unique_ptr<char[]> host_inputs;
  // Where o and lse are written: null means the response's data fields; else a region slice, or
  // the buffer the wire path sends the output from (rpc/attend_response_encoder.h).
  char* o_out = nullptr;
  char* lse_out = nullptr;
  // q_bytes..lse_out are device addresses (GPU regions): never read or written on the host.
  bool device_tensors = false;
  // Set by Backend::Prepare: the backend runs this job by a launch of its own, so that company
  // gains it nothing; the batcher sends it on at once, in a batch by itself.
  bool runs_alone = false;
  // Which of q, k, v (read) and o, lse (written) lie in host regions registered with the
  // backend's device (SharedRegion::device_registered): a device backend may copy those
  // straight between the region and the device, without staging. Each stays valid while
  // region_holds holds its region.
  struct HostRegistered {
    bool q = false, k = false, v = false, o = false, lse = false;
  };
  HostRegistered host_registered;
  // Keeps the regions those point into mapped until the job is gone (even if unregistered).
  std::vector<std::shared_ptr<const void>> region_holds;
  // Tensor bytes read from and written into regions (for metrics once the job succeeds).
  int64_t region_bytes_read = 0;
  int64_t region_bytes_written = 0;

  // Completes the request. Called exactly once, from any thread, never while a lock of the
  // batcher or backend is held.
  std::function<void(absl::Status)> done;

  int64_t Tokens() const { return total_q; }
  // The argument struct for this request alone: pointers into the request's bytes and the
  // response's output buffers, which must already be sized (see PrepareAttendResponse), or into
  // its regions (device addresses when device_tensors).
  kernels::AttentionArgs HostArgs() const;
};

// The kernel arguments of one launch over `key`'s packed requests computed in `dtype`, less every
// address.
kernels::AttentionArgs LaunchShapeArgs(const BatchKey& key, kernels::DType dtype, int32_t num_seqs,
                                       int32_t total_q, int32_t total_k, int32_t max_seqlen_q,
                                       int32_t max_seqlen_k);

}  // namespace attn
