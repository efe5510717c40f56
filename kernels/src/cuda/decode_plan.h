// The split-KV decode kernel's split rule (DecodeSplits): plain C++ of host-known values, shared by
// the planner (cuda_attention.cu, MakePlan) and its host test (tests/kernels), which builds without
// a CUDA compiler.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::kernels::cuda {

// What the split rule looks at, all known on the host before a launch.
struct DecodeSplitShape {
  int64_t batch = 1;
  int64_t num_kv_heads = 1;
  int64_t m_blocks = 1;     // row blocks of 16 packed (query, head) rows per (sequence, KV head)
  int64_t max_seqlen_k = 0;
  int warp_n = 16;          // keys per warp tile of the kernel (DecodeWarpN, or the FP8 kernel's)
  int warps = 4;            // warps per CTA, each streaming its own key tiles
  int ctas_per_sm = 2;      // CTAs of the kernel resident per SM (launch bounds and shared memory)
  int sms = 132;
  int max_splits = 64;      // kDecodeMaxSplits
};

// Key tiles per split at and above which one CTA per SM beats two: a long split keeps enough
// bytes in flight by itself, and the second CTA only adds a partial result to combine (H200,
// GQA 32/8, d=128, one sequence, forced splits in one run: 8k keys in 16 splits of 32 tiles
// 14.9 us against 16.2 in 32 splits; 16k 23.3 against 24.6; 32k 38.4 against 39.4; 128k 127.2
// against 130.2; 4k, 16 tiles per split, 12.0 against 12.4, within the noise of runs, where an
// earlier run had 32 splits ahead: bench/results/2026-12-03-decode-splits-h200.md).
inline constexpr int64_t kDecodeLongSplitTiles = 32;

// KV splits per (sequence, KV head, row block):
//  - none when the unsplit CTAs number at least 90% of the SMs: one CTA per SM, each streaming its
//    whole cache (H200, GQA 32/8, d=128: 16 x 4k unsplit 4.21 TB/s against 3.97 with two splits
//    over two CTAs per SM; 16 x 32k 4.59 against 4.45);
//  - else, where one CTA per SM gives two or more splits of kDecodeLongSplitTiles or more each,
//    one CTA per SM;
//  - else enough splits to fill every CTA slot of the GPU (ctas_per_sm per SM) at once, so that
//    one sequence (batch-1 decode) has all SMs and all their bytes in flight;
//  - always at least two key tiles per warp in each split, and then the fewest splits that keep
//    the same tiles per split (the last split is not left nearly empty).
inline int DecodeSplits(const DecodeSplitShape& s) {
  const int64_t base = s.batch * s.num_kv_heads * s.m_blocks;
  if (base <= 0 || 10 * base >= 9 * int64_t(s.sms)) return 1;
  const int64_t tiles = (s.max_seqlen_k + s.warp_n - 1) / s.warp_n;
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(s.max_splits, tiles / (2 * s.warps)));
  const int64_t one_per_sm = std::max<int64_t>(1, s.sms / base);
  const bool long_splits = one_per_sm >= 2 && tiles >= one_per_sm * kDecodeLongSplitTiles;
  const int64_t slots = long_splits ? int64_t(s.sms) : int64_t(s.ctas_per_sm) * s.sms;
  int64_t splits = std::min<int64_t>(most, std::max<int64_t>(1, slots / base));
  const int64_t per_split = (tiles + splits - 1) / splits;
  splits = (tiles + per_split - 1) / per_split;
  return int(std::max<int64_t>(1, splits));
}

}  // namespace attn::kernels::cuda
