// Plain parameters of the flash forward kernel (no templates, no device code).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention_params.h"

namespace attn::kernels::cuda {

// The forward kernels' parameters: the common ones and what only the forward kernels read.
struct FlashParams : AttentionParams {
  // The sm_90a kernel's tile counter (4 bytes of the caller's workspace, zeroed by its launch):
  // causal and right-windowed problems then deal tiles longest first to whichever CTA is free.
  // nullptr: the CTAs' tiles are fixed in advance.
  unsigned int* tile_counter = nullptr;

  // FP8 forward (RunFlashFwdSm90Fp8): q, k and v hold e4m3 codes, o is fp16/bf16; q's descales
  // are [batch, num_kv_heads] as k's and v's. vt: the workspace V is transposed into
  // (Fp8VtBytes, flash_fwd_sm90_fp8_layout.h), 256-byte aligned.
  const float* q_descale = nullptr;
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
// persistent grid of `sms` CTAs, in query tiles of tile_rows (128, or at d=128 192: FP8 tile rules,
// Fp8TileRows; cudaErrorInvalidValue for others).
template <typename T, int D>
cudaError_t RunFlashFwdSm90Fp8(const FlashParams& params, int tile_rows, int sms, cudaStream_t stream);

}  // namespace attn::kernels::cuda
