// Layouts of the FP8 forward kernel (flash_fwd_sm90_fp8_kernel.cuh) that its host side, its device
// code and the host tests share: plain C++ where no CUDA compiler is.
//
// FP8 wgmma reads both operands K-major. For O += P V the K of the product is the key, so V must
// sit in shared memory with keys contiguous: the launch first writes V transposed ("Vt") into the
// workspace, [num_kv_heads][head_dim][columns] bytes, each sequence's keys from a column that is a
// multiple of the key tile (kFp8VtAlign), so that a key tile of one sequence never reads another's
// columns (their codes may be NaN, and 0 * NaN is NaN even where P is 0).
//
// P reaches the P V product from the S accumulator without shuffles: thread t of a quad holds, of
// each 32-key group, the scores of keys {2t, 2t+1, 8+2t, 9+2t} (and those + 16) in its row, while
// the e4m3 A fragment wants the codes of columns {4t .. 4t+3} (and those + 16). The transposition
// therefore stores key Fp8VtKeyOfColumn(c) in column c of each 32-column group, and P's codes are
// packed in the accumulator's order (Fp8PackSource): column c of P then multiplies the V row of
// the key whose score it holds.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTN_FP8_HD __host__ __device__ __forceinline__
#else
#define ATTN_FP8_HD inline
#endif

namespace attn::kernels::cuda {

// Keys per tile of the FP8 kernel, and the column alignment of each sequence in Vt.
constexpr int kFp8BlockN = 128;
constexpr int kFp8VtAlign = kFp8BlockN;

// P is packed as e4m3 of (p * 2^kFp8PBias), p in [0, 1]: the codes then span [2^-9, 448] x
// 2^-kFp8PBias of p instead of e4m3's subnormal range, and the bias cancels in O / rowsum (both
// are summed from the biased p).
constexpr int kFp8PBias = 8;

// The key (within its 32-key group) whose V row column c (0..31) of a Vt group holds.
ATTN_FP8_HD constexpr int Fp8VtKeyOfColumn(int c) {
  const int half = c & 16, quad = (c & 15) >> 2, byte = c & 3;
  return half + 2 * quad + (byte & 1) + 8 * (byte >> 1);
}

// The S accumulator index (of a thread's BN / 2 scores: index i is row half (i >> 1) & 1, key
// 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)) whose p goes into byte `byte` of A register `reg` of
// the 32-key group kk (register reg: rows g (even) or g + 8 (odd), columns 4t.. (reg < 2) or
// 16 + 4t.. (reg >= 2)).
ATTN_FP8_HD constexpr int Fp8PackSource(int kk, int reg, int byte) {
  return 16 * kk + 8 * (reg >> 1) + 4 * (byte >> 1) + 2 * (reg & 1) + (byte & 1);
}

// First Vt column of sequence b, whose keys start at packed row cu_k (cu_seqlens_k[b]): rounded up
// to kFp8VtAlign, plus kFp8VtAlign per sequence before it, so that sequence b's columns
// [start, start + round_up(s_k, kFp8VtAlign)) end at or before sequence b + 1's start.
ATTN_FP8_HD constexpr int64_t Fp8VtSeqStart(int64_t cu_k, int b) {
  return (cu_k + kFp8VtAlign - 1) / kFp8VtAlign * kFp8VtAlign + int64_t(kFp8VtAlign) * b;
}

// Columns of Vt for a batch of total_k keys: the start of a sequence past the last.
ATTN_FP8_HD constexpr int64_t Fp8VtColumns(int64_t total_k, int batch) {
  return Fp8VtSeqStart(total_k, batch);
}

// Workspace bytes of Vt.
constexpr int64_t Fp8VtBytes(int64_t total_k, int batch, int num_kv_heads, int head_dim) {
  return Fp8VtColumns(total_k, batch) * num_kv_heads * head_dim;
}

// Query rows of the kernel's tiles for a launch (FP8 tile rules): d=256 has 128 (two consumer
// warpgroups; three do not fit); d=128 has 192 (three warpgroups, each row 1.13-1.14x faster than
// with two at s = 4k-8k, so a tile takes ~1.32x a 128-row tile's time) or 128. The persistent
// grid takes the tiles in rounds of `sms`, so a launch of few tiles (a prefill chunk of 512 at
// batch 1: 96 tiles of 192 rows against 128 of 128, one round either way) is quicker on 128-row
// tiles: the rows whose rounds times tile time is the smaller, 192 on a tie.
constexpr int64_t Fp8TileRounds(int64_t tile_rows, int max_seqlen_q, int heads, int batch, int sms) {
  const int64_t tiles = (max_seqlen_q + tile_rows - 1) / tile_rows * heads * batch;
  return (tiles + sms - 1) / sms;
}
constexpr int Fp8TileRows(int head_dim, int max_seqlen_q, int heads, int batch, int sms) {
  if (head_dim != 128 || sms < 1) return 128;
  const int64_t wide = 132 * Fp8TileRounds(192, max_seqlen_q, heads, batch, sms);
  const int64_t narrow = 100 * Fp8TileRounds(128, max_seqlen_q, heads, batch, sms);
  return narrow < wide ? 128 : 192;
}

// Whether the shipped kernel on tile_rows-row query tiles takes each key tile's row sums of P on
// the tensor cores (Sm90Fp8Traits' kTcRowSumV), i.e. sums P after its rounding to e4m3: d=128's
// three warpgroups (192 rows), 1.03-1.06x there (H100); d=256 and the 128-row tiles ran 1-6% slower.
constexpr bool Fp8SumsRoundedP(int head_dim, int tile_rows) { return head_dim == 128 && tile_rows == 192; }
// The lazy rescale of the shipped kernel on tile_rows-row query tiles (Sm90Softmax's kSlack8, in
// eighths of log2 units; 0: none): a warp's 16 rows keep the max P is scaled to until one of them
// grows past it by more than 0.75, so O's rescale is skipped on most key tiles; a warp holding
// rows past the sequence's end (which the tests' model cannot see) rescales on every key tile.
// d=128's three warpgroups: 1.03-1.04x non-causal at s=4k/8k, level causal (H100); d=256 ran
// 0.90x, and the 128-row tiles keep the eager rescale.
constexpr int Fp8RescaleSlack8(int head_dim, int tile_rows) { return head_dim == 128 && tile_rows == 192 ? 6 : 0; }

}  // namespace attn::kernels::cuda
