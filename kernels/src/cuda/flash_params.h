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

  // FP8 forward (RunFlashFwdSm90Fp8): q, k and v hold e4m3 codes (row strides in codes), o is
  // fp16/bf16; the descales are [batch, num_kv_heads] (query head h uses its KV head's), finite and
  // > 0. vt: the workspace V is transposed into (Fp8VtBytes, flash_fwd_sm90_fp8_layout.h),
  // 256-byte aligned.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  void* vt = nullptr;
};

// Choices of a generation-2 plan that its rules would otherwise make: the gen2_* fields of
// PlanOptions (cuda_attention.h); the defaults are the rules.
struct Sm90Choices {
  int tiling = 0;         // 0 the rule; 1 wide; 2 narrow; 3 narrow for causal problems <= 1k queries
  int row_cut = -1;       // -1 the rule; else an Sm90RowCut (three-warpgroup tilings only)
  int l2_group_mib = -1;  // -1 the rule (Sm90L2GroupPairs); 0 one group of all; N MiB per group
  int l2_phases = -1;     // -1 the rule (Sm90PhasedOrder); 0 off; 1 on under the counter
  bool counter = true;    // the launches will have a tile counter (FlashParams::tile_counter)
  bool dynamic = true;    // false: the fixed tile order even with a counter
  bool tma_o = true;      // false: O stored from registers
};

// One generation-2 launch as its plan fixed it (PlanFlashFwdSm90): which tiling, how its tiles are
// cut and ordered, and the SM count its persistent grid is sized by. Plain values, computed once
// per batch shape.
struct Sm90Launch {
  bool narrow = false;     // the tiling with two consumer warpgroups (or d=256's 64-key one)
  int row_cut = 0;         // Sm90RowCut
  int hb_group = 1;        // (sequence, head) pairs per L2 group of the cost-ordered schedule
  bool l2_phases = false;  // Sm90Schedule::phased
  bool dynamic = false;    // tiles from FlashParams::tile_counter (the fixed order without one)
  bool tma_o = true;       // O through shared memory and TMA stores where its rows allow
  int sms = 0;
};

// Implemented per (dtype, head dim) in instantiations/flash_fwd_*.cu.
template <typename T, int D>
cudaError_t RunFlashFwd(const FlashParams& params, cudaStream_t stream);
// The same kernel reading K/V through the page table (instantiations/flash_fwd_paged_*.cu).
template <typename T, int D>
cudaError_t RunFlashFwdPaged(const FlashParams& params, cudaStream_t stream);
// The sm_90a kernel (wgmma + TMA, instantiations/flash_fwd_sm90_*.cu), head dims 64, 128 and 256;
// rows of q, k and v 16-byte aligned: the plan of a launch from the values of params the host knows
// (sizes, mask; no pointer is read), then the launch.
template <typename T, int D>
Sm90Launch PlanFlashFwdSm90(const FlashParams& params, const Sm90Choices& choices, int sms);
template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, const Sm90Launch& launch, cudaStream_t stream);
// The same kernel reading K/V through the page table (instantiations/flash_fwd_sm90_paged_*.cu);
// page_size a multiple of 8.
template <typename T, int D>
Sm90Launch PlanFlashFwdSm90Paged(const FlashParams& params, const Sm90Choices& choices, int sms);
template <typename T, int D>
cudaError_t RunFlashFwdSm90Paged(const FlashParams& params, const Sm90Launch& launch,
                                 cudaStream_t stream);

// The FP8 forward kernel (instantiations/flash_fwd_sm90_fp8_*.cu; T is o's type), head dims 128
// and 256, contiguous K/V, rows 16-byte aligned: V transposed into params.vt, then the kernel on a
// persistent grid of `sms` CTAs.
template <typename T, int D>
cudaError_t RunFlashFwdSm90Fp8(const FlashParams& params, int sms, cudaStream_t stream);

}  // namespace attn::kernels::cuda
