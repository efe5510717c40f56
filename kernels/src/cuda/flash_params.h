// Plain parameters of the flash forward kernel (no templates, no device code).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attn::kernels::cuda {

struct FlashParams {
  const void* q = nullptr;  // [total_q, num_heads, head_dim]
  const void* k = nullptr;  // [total_k, num_kv_heads, head_dim]
  const void* v = nullptr;
  void* o = nullptr;        // [total_q, num_heads, head_dim]
  float* lse = nullptr;     // [num_heads, total_q] or nullptr

  const int32_t* cu_seqlens_q = nullptr;  // device, [batch + 1]
  const int32_t* cu_seqlens_k = nullptr;  // contiguous K/V only

  // Paged K/V (RunFlashFwdPaged): k and v are page pools [num_pages, page_size, num_kv_heads,
  // head_dim]; see PagedKv in attention.h.
  const int32_t* page_indptr = nullptr;
  const int32_t* page_indices = nullptr;
  const int32_t* seqlens_k = nullptr;
  int32_t page_size = 0;
  int32_t page_shift = -1;  // log2(page_size) when it is a power of two, else -1

  int32_t batch = 0;
  int32_t total_q = 0;
  int32_t total_k = 0;  // paged K/V: rows of each page pool (num_pages * page_size)
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_k = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t heads_per_kv = 1;  // num_heads / num_kv_heads

  // Row strides in elements (row = one token).
  int64_t q_row_stride = 0;
  int64_t k_row_stride = 0;
  int64_t v_row_stride = 0;
  int64_t o_row_stride = 0;

  float scale = 0.0f;       // softmax scale (natural units)
  float scale_log2 = 0.0f;  // scale * log2(e)

  // Mask, in the bottom-right aligned form of attention.h: query i sees key j when
  //   (!has_left || j >= i + (s_k - s_q) - left) && (!has_right || j <= i + (s_k - s_q) + right).
  // causal folds into has_right with right = min(window_right, 0).
  bool has_left = false;
  bool has_right = false;
  int32_t left = 0;
  int32_t right = 0;

  // The sm_90a kernel's tile counter (4 bytes of the caller's workspace, zeroed by its launch):
  // causal and right-windowed problems then deal tiles longest first to whichever CTA is free.
  // nullptr: the CTAs' tiles are fixed in advance.
  unsigned int* tile_counter = nullptr;
};

// Implemented per (dtype, head dim) in instantiations/flash_fwd_*.cu.
template <typename T, int D>
cudaError_t RunFlashFwd(const FlashParams& params, cudaStream_t stream);
// The same kernel reading K/V through the page table (instantiations/flash_fwd_paged_*.cu).
template <typename T, int D>
cudaError_t RunFlashFwdPaged(const FlashParams& params, cudaStream_t stream);
// The sm_90a kernel (wgmma + TMA, instantiations/flash_fwd_sm90_*.cu), head dims 64, 128 and 256;
// rows of q, k and v 16-byte aligned.
template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, cudaStream_t stream);
// The same kernel reading K/V through the page table (instantiations/flash_fwd_sm90_paged_*.cu);
// page_size a multiple of 8.
template <typename T, int D>
cudaError_t RunFlashFwdSm90Paged(const FlashParams& params, cudaStream_t stream);

}  // namespace attn::kernels::cuda
