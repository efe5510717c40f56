// A tiny C ABI over attn::kernels::cuda::Run for ctypes (kernels/bench/bench_vs_torch.py).
// All pointers are device pointers; `stream` is a cudaStream_t passed as an integer (0: legacy).
// Returns 0 on success, a cudaError_t (> 0) from the launch, or -(StatusCode) when CanImplement
// rejects the arguments.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "attn/kernels/attention.h"
#include "attn/kernels/cuda_attention.h"

extern "C" {

// dtype: 1 = fp16, 2 = bf16 (attn::kernels::DType values).
int attn_flash_fwd(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                   const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch,
                   int total_q, int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads,
                   int num_kv_heads, int head_dim, float softmax_scale, int causal,
                   int window_left, int window_right, uintptr_t stream) {
  attn::kernels::AttentionArgs a;
  a.dtype = static_cast<attn::kernels::DType>(dtype);
  a.q = q;
  a.k = k;
  a.v = v;
  a.o = o;
  a.lse = lse;
  a.cu_seqlens_q = cu_seqlens_q;
  a.cu_seqlens_k = cu_seqlens_k;
  a.batch = batch;
  a.total_q = total_q;
  a.total_k = total_k;
  a.max_seqlen_q = max_seqlen_q;
  a.max_seqlen_k = max_seqlen_k;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.softmax_scale = softmax_scale;
  a.causal = causal != 0;
  a.window_left = window_left;
  a.window_right = window_right;
  const attn::kernels::Status st = attn::kernels::cuda::CanImplement(a);
  if (!st.ok()) return -static_cast<int>(st.code());
  return static_cast<int>(
      attn::kernels::cuda::Run(a, nullptr, reinterpret_cast<cudaStream_t>(stream)));
}

}  // extern "C"
