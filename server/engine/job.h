// What every request's work has in common on its way through the server, whatever its kind (an
// Attend request, or one step of a KV-cache session): its batch key, its deadline, where its
// tensors are and its outputs go, its timings, and how its caller is told. Knows no protobuf: the
// service (rpc/) decodes a call into a job and encodes the job's outcome into the answer.
//
// Ownership: created by the service, owned by the batcher while queued, then by the runner of
// its kind (the backend for Attend, the step pipeline for steps) until `done` is called, exactly
// once. Destroyed after done has returned.
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
#include "engine/output_bytes.h"

namespace attn {

using Clock = std::chrono::steady_clock;

inline double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}
inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Jobs that share a key can be packed into one launch.
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
  // Attend with FP8 codes for k and v (with descales), and for q too (then wire_dtype is the
  // output's type, which q's codes are widened to before the kernel runs). Session steps: fp8_kv
  // says k_new/v_new are FP8 codes (stored as they are) rather than 16-bit values to quantize.
  bool fp8_kv = false;
  bool fp8_q = false;
  // Session steps over an FP8 (E4M3) KV cache: the launch stages the new keys and values as
  // codes (quantized from 16 bits, or as sent) and reads the cache with each session's scales.
  bool fp8_cache = false;
  bool operator==(const BatchKey&) const = default;
};

// The FP8 (E4M3) features a backend implements; what GetServerInfo reports and what validation
// admits (FAILED_PRECONDITION for a feature the backend lacks).
struct Fp8Features {
  bool attend_kv = false;      // Attend with FP8 k and v
  bool attend_q = false;       // Attend with FP8 q, k and v
  bool session_cache = false;  // sessions with an FP8 KV cache
  // Most new tokens a step of an FP8-cache session may append (the FP8 kernel's limit); 0: none.
  int32_t session_max_step_tokens = 0;
  // Head dims FP8-cache sessions may have; empty: every head dim the backend serves.
  std::vector<int32_t> session_head_dims;
  // Head dims whose all-FP8 Attend runs on FP8 tensor cores (P rounded to e4m3).
  std::vector<int32_t> attend_tensor_core_head_dims;
};

enum class JobKind { kAttend, kStep };

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

struct Job {
  explicit Job(JobKind k) : kind(k) {}
  virtual ~Job() = default;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Declared first, so destroyed last: tells the batcher that the job and all it holds (session
  // pages, region holds, staging buffers) are gone. Batcher::Drain waits for that, so a server
  // may free those owners once it has drained.
  ReleaseNotice released;

  const JobKind kind;
  BatchKey key;
  // Query tokens (a step's are the tokens it appends to its layer's cache).
  int32_t total_q = 0;
  bool return_lse = false;
  bool high_priority = false;
  // Set by Backend::Prepare: the backend runs this job by a launch of its own, so that company
  // gains it nothing; the batcher sends it on at once, in a batch by itself.
  bool runs_alone = false;

  Clock::time_point arrival;
  // When it was decoded, validated and ready to queue (its inputs staged): where its queueing
  // time (queue_us) starts. Unset: from arrival.
  Clock::time_point ready;
  Clock::time_point deadline = Clock::time_point::max();
  // True once the caller has gone away; queued work is then dropped.
  std::function<bool()> is_cancelled;

  // Filled by the batcher and the runner; the service reports them in the answer's timing.
  double queue_us = 0;
  double transfer_us = 0;
  double compute_us = 0;
  double host_copy_us = 0;
  int32_t batch_requests = 0;
  int64_t batch_tokens = 0;

  // Tensor bytes the job holds in the server (inputs and outputs not in regions), for the
  // batcher's in-flight bound.
  int64_t bytes = 0;

  // Where q, k and v are read from (empty when they are still to be copied out of the received
  // message), and where o and lse are written: a region slice, or null for an output that comes
  // back in `o` and `lse` below.
  std::string_view q_bytes, k_bytes, v_bytes;
  char* o_out = nullptr;
  char* lse_out = nullptr;
  // q_bytes..lse_out are device addresses (GPU regions): never read or written on the host.
  bool device_tensors = false;
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

  // The outputs not written into a region, once the job has succeeded: o as
  // [total_q, num_heads, head_dim] in the wire dtype, lse as [num_heads, total_q] float32.
  OutputBytes o, lse;

  // Completes the request. Called exactly once, from any thread, never while a lock of the
  // batcher, backend or pipeline is held.
  std::function<void(absl::Status)> done;

  int64_t Tokens() const { return total_q; }
  // Bytes of o and lse.
  size_t OBytes() const {
    return size_t(total_q) * key.num_heads * key.head_dim * kernels::DTypeSize(key.wire_dtype);
  }
  size_t LseBytes() const {
    return return_lse ? sizeof(float) * size_t(key.num_heads) * total_q : 0;
  }
};

using JobBatch = std::vector<std::unique_ptr<Job>>;

// The jobs of a batch of one kind as that kind (each job's kind must be T's).
template <typename T>
std::vector<std::unique_ptr<T>> JobsAs(JobBatch batch) {
  std::vector<std::unique_ptr<T>> out;
  out.reserve(batch.size());
  for (auto& job : batch) out.emplace_back(static_cast<T*>(job.release()));
  return out;
}

}  // namespace attn
