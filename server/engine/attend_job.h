// One Attend request (unary, or an AttendStream item) on its way through the server: a Job with
// its sequence lengths and what the backend keeps for it between Prepare and its completion.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attn/kernels/attention.h"
#include "engine/job.h"

namespace attn {

// What a backend keeps for one job between Prepare and the job's completion (pinned staging).
struct BackendJobState {
  virtual ~BackendJobState() = default;
};

struct AttendJob : Job {
  AttendJob() : Job(JobKind::kAttend) {}

  // Sequence lengths of this request (host), [batch + 1] each.
  std::vector<int32_t> cu_seqlens_q;
  std::vector<int32_t> cu_seqlens_k;
  int32_t total_k = 0;
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_k = 0;

  // FP8 descales (key.fp8_kv), expanded to [batch, num_kv_heads] each; q_descales only with
  // key.fp8_q.
  std::vector<float> q_descales;
  std::vector<float> k_descales;
  std::vector<float> v_descales;

  // Owned by the job; released with it, after done has run.
  std::unique_ptr<BackendJobState> backend_state;
  // q, k and v as copied from the received message (Backend::StageWireInputs), where the backend
  // keeps no staging of its own for them; q_bytes.. point into it.
  std::unique_ptr<char[]> host_inputs;

  // The argument struct for this request alone: pointers into its inputs and its outputs (o_out
  // and lse_out, which must be set: a region, or the buffers of `o` and `lse`), device addresses
  // when device_tensors.
  kernels::AttentionArgs HostArgs() const;
};

using AttendBatch = std::vector<std::unique_ptr<AttendJob>>;

// The kernel arguments of one launch over `key`'s packed requests computed in `dtype`, less every
// address.
kernels::AttentionArgs LaunchShapeArgs(const BatchKey& key, kernels::DType dtype, int32_t num_seqs,
                                       int32_t total_q, int32_t total_k, int32_t max_seqlen_q,
                                       int32_t max_seqlen_k);

}  // namespace attn
