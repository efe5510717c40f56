// Persistent tile order of the sm_90a forward kernel (flash_fwd_sm90_kernel.cuh), shared by the
// kernel, its launcher's cost model and the host tests: plain C++ where no CUDA compiler is.
#pragma once

#if defined(__CUDACC__)
#define ATTN_SM90_HD __host__ __device__ __forceinline__
#else
#define ATTN_SM90_HD inline
#endif

namespace attn::kernels::cuda {

// Without a causal/right window all tiles cost the same: global tile j has its row block fastest
// (the CTAs working at one time share the K/V of a few heads in L2) and CTA c takes j = c, c + G,
// c + 2G, ... (G CTAs). With one, a row block's cost grows with its index, so tiles are ordered by
// cost instead (row blocks slowest, from the last) and handed out longest-first in a snake (round
// r takes j = rG + c, or rG + G-1-c when r is odd), which evens out the CTAs' sums; a plain
// round-robin over row-block-fastest tiles would give some CTAs only the long row blocks (when G
// is close to a multiple of the row-block count). With a tile counter (Tr::kDynamicSchedule,
// Sm90ProduceDynamic) the CTAs take the cost-ordered tiles one at a time as they finish instead:
// longest first to whichever CTA is free.
//
// L2 groups (hb_group < all pairs, Sm90L2GroupPairs): the cost order over all (sequence, head)
// pairs reads each K/V tile from memory about once per row block when the K/V of all pairs
// overflows L2 (at causal 1k, d=128 on the H200: 650 MB per launch against 192 MB of Q, K and V).
// The order then runs over groups of hb_group pairs in turn, longest first within each group, so
// the CTAs at work share one group's K/V. Each group's longest tiles then come last, though, when
// the CTAs finish the group before it; for the last group nothing is left to even out the CTAs'
// ends. Phased (under the counter with enough row blocks, Sm90PhasedOrder): phase p holds the row
// blocks [hi / 2, hi) of every pair, hi = m_blocks >> p, in groups of hb_group << p pairs (those
// row blocks see about half the keys of the phase before). K/V is read about twice instead of
// once, and the launch ends on the shortest tiles of every pair, as the plain cost order does.
struct Sm90Schedule {
  int m_blocks, heads, batch;
  bool by_cost;
  int hb_group;
  bool phased;
  ATTN_SM90_HD int Total() const { return m_blocks * heads * batch; }
  // Global index of CTA c's tile in round r of a grid of g CTAs (may be >= Total() in the last
  // round).
  ATTN_SM90_HD int Tile(int r, int c, int g) const {
    return r * g + ((by_cost && (r & 1)) ? g - 1 - c : c);
  }
  ATTN_SM90_HD void Decode(int j, int* m_block, int* h, int* b) const {
    int hb;
    if (by_cost) {
      const int hbs = heads * batch;
      int hi = m_blocks, group_hbs = hb_group, first = 0;
      if (phased) {
        while ((hi >> 1) > 0 && j - first >= (hi - (hi >> 1)) * hbs) {
          first += (hi - (hi >> 1)) * hbs;
          hi >>= 1;
          group_hbs = 2 * group_hbs < hbs ? 2 * group_hbs : hbs;
        }
      }
      const int rows = phased ? hi - (hi >> 1) : m_blocks;  // row blocks per pair in the phase
      const int local = j - first;
      const int group = local / (group_hbs * rows);
      const int in_group = local - group * group_hbs * rows;
      const int this_hbs = hbs - group * group_hbs < group_hbs ? hbs - group * group_hbs : group_hbs;
      *m_block = hi - 1 - in_group / this_hbs;
      hb = group * group_hbs + in_group % this_hbs;
    } else {
      *m_block = j % m_blocks;
      hb = j / m_blocks;
    }
    *h = hb % heads;
    *b = hb / heads;
  }
};

// How a sequence's rows are cut into row blocks of block_m rows (64 per consumer warpgroup), by
// Sm90RowBlock. Plain: m_block * block_m on, the last block cut at s_q. The other two leave no
// block with rows for only one of three warpgroups where a plain cut would, so that the tile's
// other warpgroups need not compute rows past the sequence: a warpgroup whose rows lie past the
// block's end sits the tile out (Sm90SitOut). Three-warpgroup tilings only.
//  - Narrow tail (unmasked launches): where the last block would hold at most 64 rows, it and the
//    block before share their rows as two blocks of at most block_m - 64 (at s_q = 1024 with
//    192-row blocks: 4 x 192 + 2 x 128 instead of 5 x 192 + 64).
//  - Short head (causal launches of the trimmed tiling, whose first rows see the fewest keys): where
//    the last block would hold at most block_m - 64 rows, those rows, rounded up to whole
//    warpgroups, form block 0 instead, and full blocks follow (at s_q = 1024: 64 + 5 x 192). The
//    sit-out then falls on the cheapest tile, not on the two most expensive.
enum Sm90RowCut : int { kSm90CutPlain = 0, kSm90CutNarrowTail = 1, kSm90CutShortHead = 2 };

// Rows [*m0, *m_end) of row block m_block of a sequence of s_q queries, cut as `cut` says
// (Sm90RowCut); each block starts on a multiple of 64 rows. The block count is ceil(s_q /
// block_m) either way. False past the sequence.
ATTN_SM90_HD bool Sm90RowBlock(int m_block, int s_q, int block_m, int cut, int* m0, int* m_end) {
  *m0 = m_block * block_m;
  if (*m0 >= s_q) return false;
  *m_end = *m0 + block_m < s_q ? *m0 + block_m : s_q;
  const int full = s_q / block_m, rem = s_q - full * block_m;
  if (full < 1 || rem == 0) return true;
  if (cut == kSm90CutNarrowTail && rem <= 64 && m_block >= full - 1) {
    const int base = (full - 1) * block_m, first = block_m - 64;  // the two blocks' rows from base
    *m0 = m_block == full - 1 ? base : base + first;
    *m_end = m_block == full - 1 ? base + first : s_q;
  } else if (cut == kSm90CutShortHead && rem <= block_m - 64) {
    const int head = (rem + 63) / 64 * 64;
    *m0 = m_block == 0 ? 0 : head + (m_block - 1) * block_m;
    *m_end = m_block == 0 ? head : (*m0 + block_m < s_q ? *m0 + block_m : s_q);
  }
  return true;
}

// (sequence, head) pairs per L2 group of the cost-ordered schedule, given `hbs` pairs whose K and
// V take `kv_bytes` each. Where the K/V of all pairs overflows L2, the plain cost order reads each
// K/V tile from memory about once per row block; groups of pairs whose K/V fits in
// kSm90L2GroupBytes are visited one after the other instead, so each K/V is read about once (H200,
// d=128 causal 1k: 202 MB read per launch against 650 MB; cuDNN 201 MB). The board's power limit
// makes that traffic cost clock: sustained, the groups ran d=128 causal 1k 19% faster at a 12%
// higher clock, and 4-19% faster at every causal shape from 1k to 8k where they form,
// d=64/128/256. Groups of fewer than kSm90MinL2Group pairs are not formed (long sequences: the CTAs
// working at one time share a few pairs' K/V anyway). `knob_mib` (PlanOptions::gen2_l2_group_mib,
// -1 for the rule) overrides the rule: 0, one group of all; N, groups whose K/V fits in N MiB.
constexpr long long kSm90L2GroupBytes = 12ll << 20;
constexpr int kSm90MinL2Group = 4;
inline int Sm90L2GroupPairs(int hbs, long long kv_bytes, int knob_mib) {
  if (hbs <= 0) return 1;
  if (knob_mib == 0) return hbs;
  if (kv_bytes < 1) kv_bytes = 1;
  const long long budget = knob_mib > 0 ? (long long)knob_mib << 20 : kSm90L2GroupBytes;
  long long group = budget / kv_bytes;
  group = group < 1 ? 1 : (group > hbs ? hbs : group);
  if (knob_mib < 0 && (group < kSm90MinL2Group || hbs * kv_bytes <= 2 * kSm90L2GroupBytes)) return hbs;
  return int(group);
}

// Whether the grouped cost order runs in phases (Sm90Schedule::phased): under the tile counter,
// with at least kSm90PhasedMinRowBlocks row blocks. H200, causal, against groups without phases:
// d=128 4k +3% sustained and +8% interleaved, 2k +1% and +4%; with 8 row blocks (1k), where the
// last group's tail is short, 3% slower sustained (K/V is read about twice); under the fixed snake
// (d=256) 1-3% slower, so the fixed order has no phases. `knob` (PlanOptions::gen2_l2_phases, -1
// for the rule): 0 off, 1 on under the counter.
constexpr int kSm90PhasedMinRowBlocks = 10;
inline bool Sm90PhasedOrder(int m_blocks, bool counter, int knob) {
  return counter && (knob >= 0 ? knob != 0 : m_blocks >= kSm90PhasedMinRowBlocks);
}

}  // namespace attn::kernels::cuda
