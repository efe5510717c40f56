#include "engine/attend_job.h"

#include <algorithm>

namespace attn {

kernels::AttentionArgs LaunchShapeArgs(const BatchKey& key, kernels::DType dtype, int32_t num_seqs,
                                       int32_t total_q, int32_t total_k, int32_t max_seqlen_q,
                                       int32_t max_seqlen_k) {
  kernels::AttentionArgs a;
  a.dtype = dtype;
  a.batch = num_seqs;
  a.total_q = total_q;
  a.total_k = total_k;
  a.max_seqlen_q = std::max(max_seqlen_q, 1);
  a.max_seqlen_k = std::max(max_seqlen_k, 1);
  a.num_heads = key.num_heads;
  a.num_kv_heads = key.num_kv_heads;
  a.head_dim = key.head_dim;
  a.softmax_scale = key.softmax_scale;
  a.causal = key.causal;
  a.window_left = key.window_left;
  a.window_right = key.window_right;
  return a;
}

kernels::AttentionArgs AttendJob::HostArgs() const {
  kernels::AttentionArgs a =
      LaunchShapeArgs(key, key.wire_dtype, static_cast<int32_t>(cu_seqlens_q.size()) - 1, total_q,
                      total_k, max_seqlen_q, max_seqlen_k);
  a.q = q_bytes.data();
  a.k = k_bytes.data();
  a.v = v_bytes.data();
  a.o = o_out;
  a.lse = return_lse ? reinterpret_cast<float*>(lse_out) : nullptr;
  a.cu_seqlens_q = cu_seqlens_q.data();
  a.cu_seqlens_k = cu_seqlens_k.data();
  if (key.fp8_kv) {
    a.kv_dtype = kernels::DType::kFloat8E4M3;
    a.kv_scales = {k_descales.data(), v_descales.data()};
  }
  return a;
}

}  // namespace attn
