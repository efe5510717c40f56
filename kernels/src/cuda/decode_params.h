// Plain parameters and the tile configuration of the split-KV decode kernel (no device code), so
// that the host-side planner (cuda_attention.cu) and the kernel agree on tile sizes and shared
// memory without including device code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention_params.h"

namespace attn::kernels::cuda {

// One CTA = kDecodeWarps warps over kDecodeRows packed query rows of one (sequence, KV head, split).
// The packed rows are (query token, query head of the group) pairs, token-major:
// row = i * group + g, so every K/V byte a CTA reads serves all the query heads of its KV head.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeRows = 16;  // one m16 tile of mma.m16n8k16
// Queries per sequence up to which Run picks the decode kernel (forward kernel above).
constexpr int kDecodeMaxSeqlenQ = 16;
// At most this many KV splits per (sequence, KV head, row block); the combine reads them all.
constexpr int kDecodeMaxSplits = 64;

// Keys per warp tile (each warp streams its own tiles through its own shared-memory ring) and ring
// depth, per head dim. A stage is one K tile and one V tile.
constexpr int DecodeWarpN(int d) { return d <= 64 ? 32 : 16; }
constexpr int DecodeStages(int d) { return d >= 256 ? 2 : (d <= 32 ? 4 : 3); }
constexpr int DecodeMergeStride(int d) { return d + 8; }  // floats per row of the merge buffer
constexpr int DecodeSmemBytes(int d) {
  const int q = kDecodeRows * d * 2;
  const int ring = kDecodeWarps * DecodeStages(d) * 2 * DecodeWarpN(d) * d * 2;
  const int merge = kDecodeWarps * kDecodeRows * (DecodeMergeStride(d) + 2) * 4;
  return q + (ring > merge ? ring : merge);
}
// CTAs per SM the launch bounds ask for (registers allow it; shared memory is checked by the
// planner against the device).
constexpr int DecodeMinBlocks(int d) { return d >= 256 ? 1 : 2; }

// The FP8 K/V kernel (decode_fp8_kernel.cuh, head dims 64, 128, 256): tiles of 32 keys (e4m3
// codes: the bytes of a 16-bit tile of 16 keys at d=128), ring depth per head dim (d=64: five
// stages of 4 KiB keep four in flight, as many bytes as the 16-bit kernel's two of 8 KiB), q rows
// padded by 16 bytes, and at d=256 each warp's q fragments in shared memory.
constexpr int kDecodeFp8HeadDims[] = {64, 128, 256};
constexpr int DecodeFp8WarpN(int) { return 32; }
constexpr int DecodeFp8Stages(int d) { return d >= 256 ? 2 : (d <= 64 ? 5 : 3); }
constexpr bool DecodeFp8QInRegs(int d) { return d <= 128; }
constexpr int DecodeFp8QRowBytes(int d) { return d * 2 + 16; }
constexpr int DecodeFp8SmemBytes(int d) {
  const int q = kDecodeRows * DecodeFp8QRowBytes(d);
  const int ring = kDecodeWarps * DecodeFp8Stages(d) * 2 * DecodeFp8WarpN(d) * d;
  const int q_frags = DecodeFp8QInRegs(d) ? 0 : kDecodeWarps * (d / 16) * 32 * 16;
  const int merge = kDecodeWarps * kDecodeRows * (DecodeMergeStride(d) + 2) * 4;
  return q + (ring + q_frags > merge ? ring + q_frags : merge);
}
constexpr int DecodeFp8MinBlocks(int d) { return d >= 256 ? 1 : 2; }

// The decode kernels' parameters: the common ones (k_row_stride serves k and v alike; FP8 K/V:
// k_descale and v_descale) and what only they read.
struct DecodeParams : AttentionParams {
  // Rows the call appends (PagedKv::append_k / append_v; 16-bit paged K/V only): key j >= s_k - s_q
  // of sequence b is read from row cu_seqlens_q[b] + j - (s_k - s_q) of these ([total_q,
  // num_kv_heads, head_dim], row stride k_row_stride), and CTA (0, KV head, b) writes those rows
  // into their page rows.
  const void* append_k = nullptr;
  const void* append_v = nullptr;

  int32_t m_blocks = 1;    // ceil(max_seqlen_q * heads_per_kv / kDecodeRows)
  int32_t num_splits = 1;  // KV splits per (sequence, KV head, row block); grid.x = m_blocks * splits

  // Workspace when num_splits > 1: partial O (normalised, fp32) and partial LSE (log2 units) per
  // split, of the (token, head) row t * num_heads + h:
  //   part_o   [num_splits, total_q * num_heads, head_dim]
  //   part_lse [num_splits, total_q * num_heads]
  float* part_o = nullptr;
  float* part_lse = nullptr;
  // With splits, non-null: one word per (sequence, KV head, row block), zero at launch. Each CTA
  // counts itself in after writing its partial; the group's last CTA merges the group's partials
  // into o and lse and sets the word back to zero, so no combine kernel runs and the words are
  // zero again for the next launch on the stream. Null: the combine kernel merges.
  uint32_t* split_counters = nullptr;

  // Host only: launch the combine kernel as a programmatic dependent of the split kernel (sm_90+),
  // so that its launch overlaps the split kernel's work.
  bool pdl = false;
};

// Implemented per (dtype, head dim) in instantiations/decode_*.cu: the split kernel and, when
// num_splits > 1, the combine kernel, both on stream.
template <typename T, int D>
cudaError_t RunDecode(const DecodeParams& params, bool paged, cudaStream_t stream);

// The FP8 K/V kernel (q and o of T; instantiations/decode_fp8_*.cu, head dims kDecodeFp8HeadDims)
// and, when num_splits > 1, the same combine kernel.
template <typename T, int D>
cudaError_t RunDecodeFp8(const DecodeParams& params, bool paged, cudaStream_t stream);

}  // namespace attn::kernels::cuda
