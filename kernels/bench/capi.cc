// A tiny C ABI over attn::kernels::cuda for ctypes (kernels/bench/bench_vs_torch.py,
// kernels/bench/bench_decode.py). All pointers are device pointers; `stream` is a cudaStream_t
// passed as an integer (0: legacy). Functions that run return 0 on success, a cudaError_t (> 0)
// from the launch, or -(StatusCode) when CanImplement rejects the arguments.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attn/kernels/attention.h"
#include "attn/kernels/cuda_attention.h"

namespace {

attn::kernels::AttentionArgs MakeArgs(int dtype, const void* q, const void* k, const void* v,
                                      void* o, float* lse, const int32_t* cu_seqlens_q,
                                      const int32_t* cu_seqlens_k, int batch, int total_q,
                                      int total_k, int max_seqlen_q, int max_seqlen_k,
                                      int num_heads, int num_kv_heads, int head_dim,
                                      float softmax_scale, int causal, int window_left,
                                      int window_right) {
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
  return a;
}

void SetPaged(attn::kernels::AttentionArgs* a, int page_size, int num_pages,
              const int32_t* page_indptr, const int32_t* page_indices, const int32_t* seqlens_k) {
  a->paged.page_size = page_size;
  a->paged.num_pages = num_pages;
  a->paged.page_indptr = page_indptr;
  a->paged.page_indices = page_indices;
  a->paged.seqlens_k = seqlens_k;
}

}  // namespace

extern "C" {

// dtype: 1 = fp16, 2 = bf16 (attn::kernels::DType values). Contiguous K/V. When the arguments need
// a workspace (decode-shaped: split-KV partials), a buffer kept by this library is used (grown on
// demand, outside any timed region once warmed up). gen: 0 = the kernel Run picks, 1 / 2 = force
// forward generation 1 / 2 (attn::kernels::cuda::FwdGeneration).
int attn_flash_fwd_gen(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                       const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch,
                       int total_q, int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads,
                       int num_kv_heads, int head_dim, float softmax_scale, int causal,
                       int window_left, int window_right, uintptr_t stream, int gen) {
  const attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  const auto g = static_cast<attn::kernels::cuda::FwdGeneration>(gen);
  const attn::kernels::Status st = g == attn::kernels::cuda::FwdGeneration::kGen2
                                       ? attn::kernels::cuda::CanImplementGen2(a)
                                       : attn::kernels::cuda::CanImplement(a);
  if (!st.ok()) return -static_cast<int>(st.code());
  static void* ws = nullptr;
  static size_t ws_size = 0;
  const size_t need = attn::kernels::cuda::WorkspaceBytes(a);
  if (need > ws_size) {
    if (ws != nullptr) cudaFree(ws);
    ws = nullptr;
    ws_size = 0;
    const cudaError_t err = cudaMalloc(&ws, need);
    if (err != cudaSuccess) return static_cast<int>(err);
    ws_size = need;
  }
  return static_cast<int>(
      attn::kernels::cuda::Run(a, ws, reinterpret_cast<cudaStream_t>(stream), g));
}

int attn_flash_fwd(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                   const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch,
                   int total_q, int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads,
                   int num_kv_heads, int head_dim, float softmax_scale, int causal,
                   int window_left, int window_right, uintptr_t stream) {
  return attn_flash_fwd_gen(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q,
                            total_k, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim,
                            softmax_scale, causal, window_left, window_right, stream, 0);
}

// The general entry: contiguous K/V when page_size == 0, else K/V page pools read through the CSR
// page table (page_indptr [batch + 1], page_indices, seqlens_k [batch]; see PagedKv). workspace
// must hold attn_workspace_bytes(...) bytes of the same arguments.
int attn_run(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
             const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch, int total_q,
             int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_kv_heads,
             int head_dim, float softmax_scale, int causal, int window_left, int window_right,
             int page_size, int num_pages, const int32_t* page_indptr, const int32_t* page_indices,
             const int32_t* seqlens_k, void* workspace, uintptr_t stream) {
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  SetPaged(&a, page_size, num_pages, page_indptr, page_indices, seqlens_k);
  const attn::kernels::Status st = attn::kernels::cuda::CanImplement(a);
  if (!st.ok()) return -static_cast<int>(st.code());
  return static_cast<int>(
      attn::kernels::cuda::Run(a, workspace, reinterpret_cast<cudaStream_t>(stream)));
}

// attn_run with the forward kernel's generation forced: gen 1 / 2 (FwdGeneration; 0 = Run's own
// choice, as attn_run). -(StatusCode) when that generation cannot run the arguments.
int attn_run_gen(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                 const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch, int total_q,
                 int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_kv_heads,
                 int head_dim, float softmax_scale, int causal, int window_left, int window_right,
                 int page_size, int num_pages, const int32_t* page_indptr,
                 const int32_t* page_indices, const int32_t* seqlens_k, void* workspace,
                 uintptr_t stream, int gen) {
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  SetPaged(&a, page_size, num_pages, page_indptr, page_indices, seqlens_k);
  const auto g = static_cast<attn::kernels::cuda::FwdGeneration>(gen);
  const attn::kernels::Status st = g == attn::kernels::cuda::FwdGeneration::kGen2
                                       ? attn::kernels::cuda::CanImplementGen2(a)
                                       : attn::kernels::cuda::CanImplement(a);
  if (!st.ok()) return -static_cast<int>(st.code());
  return static_cast<int>(
      attn::kernels::cuda::Run(a, workspace, reinterpret_cast<cudaStream_t>(stream), g));
}

// WorkspaceBytes of the attn_run arguments (pointers may be any non-null value); and whether Run
// picks the decode kernel for them (1) or the forward kernel (0).
size_t attn_workspace_bytes(int dtype, int batch, int total_q, int total_k, int max_seqlen_q,
                            int max_seqlen_k, int num_heads, int num_kv_heads, int head_dim,
                            int page_size, int num_pages) {
  static int dummy = 0;
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, &dummy, &dummy, &dummy, &dummy, nullptr, &dummy, &dummy, batch, total_q,
               total_k, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, 0.0f, 0, -1,
               -1);
  if (page_size > 0) SetPaged(&a, page_size, num_pages, &dummy, &dummy, &dummy);
  return attn::kernels::cuda::WorkspaceBytes(a);
}

int attn_uses_decode(int max_seqlen_q) {
  static int dummy = 0;
  attn::kernels::AttentionArgs a = MakeArgs(2, &dummy, &dummy, &dummy, &dummy, nullptr, &dummy,
                                            &dummy, 1, 1, 1, max_seqlen_q, 1, 1, 1, 128, 0.0f, 0,
                                            -1, -1);
  return attn::kernels::cuda::UsesDecodeKernel(a) ? 1 : 0;
}

}  // extern "C"
