#include "sessions/step_launch.h"

#include <algorithm>

namespace attn {

kernels::AttentionArgs StepLaunch::HostArgs() const {
  kernels::AttentionArgs a;
  a.dtype = key.wire_dtype;
  a.cu_seqlens_q = cu_seqlens_q();
  a.batch = static_cast<int32_t>(members.size());
  a.total_q = total_q;
  a.total_k = 0;
  a.max_seqlen_q = std::max(max_q, 1);
  a.max_seqlen_k = std::max(max_k, 1);
  a.num_heads = key.num_heads;
  a.num_kv_heads = key.num_kv_heads;
  a.head_dim = key.head_dim;
  a.softmax_scale = key.softmax_scale;
  a.causal = true;
  a.window_left = key.window_left;
  a.window_right = key.window_right;
  a.paged.page_size = key.page_tokens;
  a.paged.num_pages = num_pages;
  a.paged.page_indptr = At<int32_t>(layout.indptr);
  a.paged.page_indices = At<int32_t>(layout.indices);
  a.paged.seqlens_k = At<int32_t>(layout.seqlens);
  if (key.fp8_cache) {
    a.kv_dtype = kernels::DType::kFloat8E4M3;
    a.kv_scales.k = At<float>(layout.k_scales);
    a.kv_scales.v = At<float>(layout.v_scales);
  }
  return a;
}

}  // namespace attn
