// A tiny C ABI over attn::kernels::cuda for ctypes (kernels/bench/bench_vs_torch.py,
// kernels/bench/bench_decode.py). All pointers are device pointers; `stream` is a cudaStream_t
// passed as an integer (0: legacy). Functions that run return 0 on success, a cudaError_t (> 0)
// from the launch, or -(StatusCode) when the arguments are rejected (CanImplement, MakePlan).
// Every run plans with this library's current plan options (attn_set_plan_option), the defaults
// until one is set.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

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

// The plan options of every run (attn_set_plan_option): one process times variants side by side.
attn::kernels::cuda::PlanOptions g_options;

// MakePlan with g_options and generation gen, then Run; a workspace of the plan's size from this
// library when `workspace` is null and the plan needs one (grown on demand, outside any timed region
// once warmed up). That workspace keeps a decode plan's split counters zero as a step lane does:
// set once when they grow past what is known to be zero (decode_fused_combine). A caller's
// workspace with such a plan must hold zeroed counters.
int PlanAndRun(const attn::kernels::AttentionArgs& a, int gen, void* workspace, cudaStream_t stream) {
  attn::kernels::cuda::PlanOptions o = g_options;
  o.generation = static_cast<attn::kernels::cuda::FwdGeneration>(gen);
  attn::kernels::cuda::Plan plan;
  const attn::kernels::Status st = attn::kernels::cuda::MakePlan(a, o, &plan);
  if (!st.ok()) return -static_cast<int>(st.code());
  static void* own = nullptr;
  static size_t own_size = 0;
  static size_t own_zeroed = 0;  // leading bytes of `own` that are zero
  if (workspace == nullptr && plan.workspace_bytes > 0) {
    if (plan.workspace_bytes > own_size) {
      if (own != nullptr) cudaFree(own);
      own = nullptr;
      own_size = 0;
      own_zeroed = 0;
      const cudaError_t err = cudaMalloc(&own, plan.workspace_bytes);
      if (err != cudaSuccess) return static_cast<int>(err);
      own_size = plan.workspace_bytes;
    }
    workspace = own;
    if (plan.decode_counter_bytes > own_zeroed) {
      const cudaError_t err = cudaMemsetAsync(own, 0, plan.decode_counter_bytes, stream);
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    own_zeroed = plan.decode_counter_bytes;
  }
  return static_cast<int>(attn::kernels::cuda::Run(a, plan, workspace, stream));
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

// dtype: 1 = fp16, 2 = bf16 (attn::kernels::DType values). Contiguous K/V; the workspace is this
// library's. gen: 0 = the kernel the plan picks, 1 / 2 = force forward generation 1 / 2
// (attn::kernels::cuda::FwdGeneration).
int attn_flash_fwd_gen(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                       const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch,
                       int total_q, int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads,
                       int num_kv_heads, int head_dim, float softmax_scale, int causal,
                       int window_left, int window_right, uintptr_t stream, int gen) {
  const attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  return PlanAndRun(a, gen, nullptr, reinterpret_cast<cudaStream_t>(stream));
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
// must hold attn_workspace_bytes(...) bytes of the same arguments (null: this library's).
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
  return PlanAndRun(a, 0, workspace, reinterpret_cast<cudaStream_t>(stream));
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
  return PlanAndRun(a, gen, workspace, reinterpret_cast<cudaStream_t>(stream));
}

// attn_run over FP8 (e4m3) K/V: k and v hold e4m3 codes (contiguous or page pools), k_scale and
// v_scale the float32 scales of [batch, num_kv_heads] (device memory); q and o of dtype. The
// library's workspace when `workspace` is null.
int attn_run_fp8kv(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                   const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch, int total_q,
                   int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_kv_heads,
                   int head_dim, float softmax_scale, int causal, int window_left, int window_right,
                   int page_size, int num_pages, const int32_t* page_indptr,
                   const int32_t* page_indices, const int32_t* seqlens_k, const float* k_scale,
                   const float* v_scale, void* workspace, uintptr_t stream) {
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  SetPaged(&a, page_size, num_pages, page_indptr, page_indices, seqlens_k);
  a.kv_dtype = attn::kernels::DType::kFloat8E4M3;
  a.kv_scales = {k_scale, v_scale};
  return PlanAndRun(a, 0, workspace, reinterpret_cast<cudaStream_t>(stream));
}

// attn_run_fp8kv with the forward kernel's generation forced (gen 1 / 2; 0: Run's own choice):
// for FP8 K/V with more than 16 queries per sequence, the 16-bit kernel that runs after the
// conversion of K/V into the workspace.
int attn_run_fp8kv_gen(int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                       const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int batch,
                       int total_q, int total_k, int max_seqlen_q, int max_seqlen_k, int num_heads,
                       int num_kv_heads, int head_dim, float softmax_scale, int causal,
                       int window_left, int window_right, int page_size, int num_pages,
                       const int32_t* page_indptr, const int32_t* page_indices,
                       const int32_t* seqlens_k, const float* k_scale, const float* v_scale,
                       void* workspace, uintptr_t stream, int gen) {
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  SetPaged(&a, page_size, num_pages, page_indptr, page_indices, seqlens_k);
  a.kv_dtype = attn::kernels::DType::kFloat8E4M3;
  a.kv_scales = {k_scale, v_scale};
  return PlanAndRun(a, gen, workspace, reinterpret_cast<cudaStream_t>(stream));
}

// All-FP8 attention on FP8 tensor cores (attn::kernels::cuda::RunFp8Attention): q, k and v e4m3
// codes (contiguous K/V), q_scale / k_scale / v_scale [batch, num_kv_heads], o of dtype. The
// library's workspace (V transposed) when `workspace` is null.
int attn_run_fp8_attention(int dtype, const void* q, const void* k, const void* v, void* o,
                           float* lse, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                           int batch, int total_q, int total_k, int max_seqlen_q, int max_seqlen_k,
                           int num_heads, int num_kv_heads, int head_dim, float softmax_scale,
                           int causal, int window_left, int window_right, const float* q_scale,
                           const float* k_scale, const float* v_scale, void* workspace,
                           uintptr_t stream) {
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k,
               max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, softmax_scale,
               causal, window_left, window_right);
  a.kv_dtype = attn::kernels::DType::kFloat8E4M3;
  a.kv_scales = {k_scale, v_scale};
  const attn::kernels::Status st = attn::kernels::cuda::CanImplementFp8Attention(a);
  if (!st.ok()) return -static_cast<int>(st.code());
  static void* own = nullptr;
  static size_t own_size = 0;
  const size_t need = attn::kernels::cuda::Fp8AttentionWorkspaceBytes(a);
  if (workspace == nullptr) {
    if (need > own_size) {
      if (own != nullptr) cudaFree(own);
      own = nullptr;
      own_size = 0;
      const cudaError_t err = cudaMalloc(&own, need);
      if (err != cudaSuccess) return static_cast<int>(err);
      own_size = need;
    }
    workspace = own;
  }
  return static_cast<int>(attn::kernels::cuda::RunFp8Attention(a, q_scale, workspace,
                                                               reinterpret_cast<cudaStream_t>(stream)));
}

// All-FP8 attention's q step (attn::kernels::cuda::DequantizeFp8Q): q_out [total_q, num_heads,
// head_dim] of dtype = E4M3(q_codes) * q_scale[b, kv head]; cu_seqlens_q on the device.
int attn_dequantize_fp8_q(int dtype, const void* q_codes, const float* q_scale, void* q_out,
                          const int32_t* cu_seqlens_q, int batch, int total_q, int num_heads,
                          int num_kv_heads, int head_dim, uintptr_t stream) {
  static int dummy = 0;
  const attn::kernels::AttentionArgs a =
      MakeArgs(dtype, &dummy, &dummy, &dummy, &dummy, nullptr, cu_seqlens_q, &dummy, batch,
               total_q, 1, 1, 1, num_heads, num_kv_heads, head_dim, 0.0f, 0, -1, -1);
  return static_cast<int>(attn::kernels::cuda::DequantizeFp8Q(
      a, q_codes, q_scale, q_out, reinterpret_cast<cudaStream_t>(stream)));
}

// The KV splits the decode plan (with this library's plan options) gives a decode shape of batch
// sequences with max_seqlen_q queries each over max_seqlen_k keys (fp8_kv: FP8 K/V); -(StatusCode)
// when the plan is refused, 0 when the shape goes to the forward kernel.
int attn_plan_decode_splits(int dtype, int fp8_kv, int batch, int max_seqlen_q, int max_seqlen_k,
                            int num_heads, int num_kv_heads, int head_dim) {
  static int dummy = 0;
  static const float scale = 1.0f;
  attn::kernels::AttentionArgs a =
      MakeArgs(dtype, &dummy, &dummy, &dummy, &dummy, nullptr, &dummy, &dummy, batch,
               batch * max_seqlen_q, batch * max_seqlen_k, max_seqlen_q, max_seqlen_k, num_heads,
               num_kv_heads, head_dim, 0.0f, 0, -1, -1);
  if (fp8_kv) {
    a.kv_dtype = attn::kernels::DType::kFloat8E4M3;
    a.kv_scales = {&scale, &scale};
  }
  attn::kernels::cuda::Plan plan;
  const attn::kernels::Status st = attn::kernels::cuda::MakePlan(a, g_options, &plan);
  if (!st.ok()) return -static_cast<int>(st.code());
  return plan.kernel == attn::kernels::cuda::Plan::Kernel::kDecode ? plan.decode_splits : 0;
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

// Sets one plan option of every later run (attn::kernels::cuda::PlanOptions) by name: decode_splits,
// decode_fused_combine, tiling, row_cut, l2_mib, l2_phases, tile_counter, dynamic, tma_o,
// fp8_tensor_cores, fp8_tile_rows; "reset" restores the defaults.
// Returns 0, or -1 for an unknown name.
int attn_set_plan_option(const char* name, int value) {
  const std::string n = name;
  attn::kernels::cuda::PlanOptions& o = g_options;
  if (n == "reset") o = attn::kernels::cuda::PlanOptions{};
  else if (n == "decode_splits") o.decode_splits = value;
  else if (n == "decode_fused_combine") o.decode_fused_combine = value != 0;
  else if (n == "tiling") o.gen2_tiling = value;
  else if (n == "row_cut") o.gen2_row_cut = value;
  else if (n == "l2_mib") o.gen2_l2_group_mib = value;
  else if (n == "l2_phases") o.gen2_l2_phases = value;
  else if (n == "tile_counter") o.gen2_tile_counter = value != 0;
  else if (n == "dynamic") o.gen2_dynamic = value != 0;
  else if (n == "tma_o") o.gen2_tma_store_o = value != 0;
  else if (n == "fp8_tensor_cores") o.fp8_tensor_cores = value != 0;
  else if (n == "fp8_tile_rows") o.fp8_tile_rows = value;
  else return -1;
  return 0;
}

int attn_uses_decode(int max_seqlen_q) {
  static int dummy = 0;
  attn::kernels::AttentionArgs a = MakeArgs(2, &dummy, &dummy, &dummy, &dummy, nullptr, &dummy,
                                            &dummy, 1, 1, 1, max_seqlen_q, 1, 1, 1, 128, 0.0f, 0,
                                            -1, -1);
  return attn::kernels::cuda::UsesDecodeKernel(a) ? 1 : 0;
}

}  // extern "C"
