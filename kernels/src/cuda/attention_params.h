// The plain parameters every attention kernel of this library reads (no templates, no device
// code): the tensors, the sequences, the paged K/V, the shape, the strides, the scale and the mask.
// Each kernel family's parameters (FlashParams, DecodeParams) extend it with their own fields, and
// one function (MakeAttentionParams in cuda_attention.cu) fills it from AttentionArgs.
#pragma once

#include <cstdint>

namespace attn::kernels::cuda {

struct AttentionParams {
  const void* q = nullptr;  // [total_q, num_heads, head_dim]
  const void* k = nullptr;  // contiguous [total_k, num_kv_heads, head_dim] or a page pool
  const void* v = nullptr;
  void* o = nullptr;        // [total_q, num_heads, head_dim]
  float* lse = nullptr;     // [num_heads, total_q] or nullptr

  const int32_t* cu_seqlens_q = nullptr;  // device, [batch + 1]
  const int32_t* cu_seqlens_k = nullptr;  // contiguous K/V only

  // Paged K/V: k and v are page pools [num_pages, page_size, num_kv_heads, head_dim]; see PagedKv
  // in attention.h.
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

  // Row strides in elements (row = one token; FP8 tensors: in codes).
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

  // FP8 (e4m3) K and V: the float32 factors of their codes, [batch, num_kv_heads] (query head h
  // uses its KV head's), finite and > 0.
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
};

}  // namespace attn::kernels::cuda
