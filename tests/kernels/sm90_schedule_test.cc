// The sm_90a kernel's persistent tile order (flash_fwd_sm90_schedule.h), checked on the host: every
// order visits each (row block, sequence, head) tile exactly once, the cost orders go longest
// first, the L2-grouped orders keep the pairs at work within their groups, the groups and phases
// form where the rules say, and the row blocks (plain, narrow tail or short head) cover each sequence.
#include "flash_fwd_sm90_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace attn::kernels::cuda {
namespace {

struct Decoded {
  int m, h, b;
};

std::vector<Decoded> Walk(const Sm90Schedule& s) {
  std::vector<Decoded> out;
  for (int j = 0; j < s.Total(); ++j) {
    Decoded d{};
    s.Decode(j, &d.m, &d.h, &d.b);
    out.push_back(d);
  }
  return out;
}

// (m_blocks, heads, batch) shapes: one row block, one pair, odd counts, more pairs than a group.
const std::vector<std::tuple<int, int, int>> kShapes = {
    {1, 1, 1}, {1, 7, 3}, {2, 1, 1}, {3, 5, 1}, {8, 16, 16}, {11, 16, 8}, {22, 8, 8}, {13, 3, 7}, {86, 16, 1}};

TEST(Sm90Schedule, EveryOrderVisitsEachTileOnce) {
  for (const auto& [m_blocks, heads, batch] : kShapes) {
    const int hbs = heads * batch;
    for (const bool by_cost : {false, true}) {
      for (const bool phased : {false, true}) {
        for (const int group : {1, 2, 3, 5, hbs}) {
          if (group > hbs) continue;
          const Sm90Schedule s{m_blocks, heads, batch, by_cost, group, phased};
          std::set<std::tuple<int, int, int>> seen;
          for (const Decoded& d : Walk(s)) {
            ASSERT_GE(d.m, 0);
            ASSERT_LT(d.m, m_blocks);
            ASSERT_GE(d.h, 0);
            ASSERT_LT(d.h, heads);
            ASSERT_GE(d.b, 0);
            ASSERT_LT(d.b, batch);
            ASSERT_TRUE(seen.insert({d.m, d.h, d.b}).second)
                << "tile visited twice: m_blocks " << m_blocks << " pairs " << hbs << " group " << group
                << " by_cost " << by_cost << " phased " << phased;
          }
          EXPECT_EQ(int(seen.size()), s.Total());
        }
      }
    }
  }
}

TEST(Sm90Schedule, UngroupedCostOrderGoesLongestFirst) {
  for (const auto& [m_blocks, heads, batch] : kShapes) {
    for (const bool phased : {false, true}) {
      const Sm90Schedule s{m_blocks, heads, batch, true, heads * batch, phased};
      const std::vector<Decoded> w = Walk(s);
      for (size_t j = 1; j < w.size(); ++j) ASSERT_LE(w[j].m, w[j - 1].m) << "at tile " << j;
    }
  }
}

// Grouped orders: the tiles of one group come together, longest first within it, and touch only the
// group's pairs. Phased: phase p takes the row blocks [hi / 2, hi) of every pair (hi = m_blocks >>
// p, the whole range in the last phase, hi = 1), in groups of group << p pairs; so the order ends
// on the first row block of every pair.
TEST(Sm90Schedule, GroupedOrdersStayWithinTheirGroups) {
  for (const auto& [m_blocks, heads, batch] : kShapes) {
    const int hbs = heads * batch;
    for (const bool phased : {false, true}) {
      for (const int group : {1, 2, 3, 5}) {
        if (group >= hbs) continue;
        const Sm90Schedule s{m_blocks, heads, batch, true, group, phased};
        const std::vector<Decoded> w = Walk(s);
        int first = 0, hi = m_blocks, lo = phased ? m_blocks / 2 : 0, pairs_per_group = group;
        for (int j = 0; j < int(w.size()); ++j) {
          if (j - first == (hi - lo) * hbs) {  // next phase
            first = j;
            hi = lo;
            lo = hi / 2;
            pairs_per_group = std::min(2 * pairs_per_group, hbs);
          }
          const int pair = w[j].b * heads + w[j].h;
          const int local = j - first;
          ASSERT_LT(w[j].m, hi) << "tile " << j;
          ASSERT_GE(w[j].m, lo) << "tile " << j;
          ASSERT_EQ(pair / pairs_per_group, local / (pairs_per_group * (hi - lo))) << "tile " << j;
          if (local % (pairs_per_group * (hi - lo)) != 0) ASSERT_LE(w[j].m, w[j - 1].m) << "tile " << j;
        }
        if (phased) {
          for (int i = int(w.size()) - hbs; i < int(w.size()); ++i) ASSERT_EQ(w[i].m, 0) << "tile " << i;
        }
      }
    }
  }
}

// The standard sweep's problems (16k tokens, H * D = 2048): K and V of one (sequence, head) pair.
long long KvBytes(int s, int d) { return (long long)s * d * 2 * 2; }

TEST(Sm90L2Groups, FormWhereAllKvOverflowsL2AndAGroupHoldsFourPairs) {
  constexpr long long kMiB = 1ll << 20;
  // d=128 causal 1k: 256 pairs of 0.5 MiB -> 24 per group (12 MiB); 2k: 128 of 1 MiB -> 12.
  EXPECT_EQ(Sm90L2GroupPairs(256, KvBytes(1024, 128), -1), 24);
  EXPECT_EQ(Sm90L2GroupPairs(128, KvBytes(2048, 128), -1), 12);
  // d=64 8k: 64 pairs of 2 MiB -> 6; d=128 8k: 32 of 4 MiB -> 3 would be too few: one group.
  EXPECT_EQ(Sm90L2GroupPairs(64, KvBytes(8192, 64), -1), 6);
  EXPECT_EQ(Sm90L2GroupPairs(32, KvBytes(8192, 128), -1), 32);
  // All K/V within 24 MiB: it stays in L2 anyway, one group.
  EXPECT_EQ(Sm90L2GroupPairs(24, 1 * kMiB, -1), 24);
  EXPECT_EQ(Sm90L2GroupPairs(25, 1 * kMiB, -1), 12);
  // The knob: 0 turns the groups off; N MiB forms them whatever the rule says, at least one pair.
  EXPECT_EQ(Sm90L2GroupPairs(256, KvBytes(1024, 128), 0), 256);
  EXPECT_EQ(Sm90L2GroupPairs(8, KvBytes(1024, 128), 1), 2);
  EXPECT_EQ(Sm90L2GroupPairs(8, 3 * kMiB, 1), 1);
  EXPECT_EQ(Sm90L2GroupPairs(8, 1, 1), 8);
  EXPECT_EQ(Sm90L2GroupPairs(0, 1, -1), 1);
  // Wherever groups form, a group's K/V fits in the budget and holds at least kSm90MinL2Group.
  for (int hbs : {1, 3, 16, 64, 256, 4096}) {
    for (long long kv = 1024; kv <= 64 * kMiB; kv *= 2) {
      const int g = Sm90L2GroupPairs(hbs, kv, -1);
      ASSERT_GE(g, 1);
      ASSERT_LE(g, hbs);
      if (g < hbs) {
        EXPECT_LE(g * kv, kSm90L2GroupBytes) << hbs << " pairs of " << kv;
        EXPECT_GE(g, kSm90MinL2Group) << hbs << " pairs of " << kv;
      }
    }
  }
}

TEST(Sm90L2Groups, PhasesOnlyUnderTheCounterWithTenRowBlocks) {
  EXPECT_FALSE(Sm90PhasedOrder(8, true, -1));  // causal 1k, 128-row tiles
  EXPECT_TRUE(Sm90PhasedOrder(11, true, -1));  // causal 2k, 192-row tiles
  EXPECT_FALSE(Sm90PhasedOrder(22, false, -1));  // the fixed snake never
  EXPECT_TRUE(Sm90PhasedOrder(8, true, 1));
  EXPECT_FALSE(Sm90PhasedOrder(22, true, 0));
  EXPECT_FALSE(Sm90PhasedOrder(22, false, 1));
}

// Row blocks cover [0, s_q) exactly, in order, each within block_m rows and starting on a whole
// warpgroup (64 rows), so no warpgroup's rows reach into another block; the count is ceil(s_q /
// block_m) under every cut. Narrow tail: no block has at most 64 rows unless the sequence does,
// and only the last two blocks differ from the plain cut. Short head: where the plain cut's last
// block would leave a warpgroup without rows, block 0 holds those rows rounded up to whole
// warpgroups and every later block but the last is full; elsewhere it is the plain cut.
TEST(Sm90RowBlocks, PartitionTheSequenceOnWholeWarpgroups) {
  for (const int block_m : {128, 192}) {
    for (int s_q = 1; s_q <= 5 * block_m + 1; ++s_q) {
      for (const int cut : {kSm90CutPlain, kSm90CutNarrowTail, kSm90CutShortHead}) {
        if (cut != kSm90CutPlain && block_m != 192) continue;  // three-warpgroup tilings only
        const int blocks = (s_q + block_m - 1) / block_m;
        const int rem = s_q % block_m;
        const bool short_head =
            cut == kSm90CutShortHead && s_q > block_m && rem > 0 && rem <= block_m - 64;
        int next = 0;
        for (int m = 0; m < blocks; ++m) {
          int m0 = -1, m_end = -1, p0 = -1, p_end = -1;
          ASSERT_TRUE(Sm90RowBlock(m, s_q, block_m, cut, &m0, &m_end)) << s_q << " block " << m;
          ASSERT_TRUE(Sm90RowBlock(m, s_q, block_m, kSm90CutPlain, &p0, &p_end));
          ASSERT_EQ(m0, next) << "s_q " << s_q << " block " << m << " cut " << cut;
          ASSERT_EQ(m0 % 64, 0) << "s_q " << s_q << " block " << m << " cut " << cut;
          ASSERT_GT(m_end, m0);
          ASSERT_LE(m_end - m0, block_m);
          if (cut == kSm90CutNarrowTail && s_q > 64) {
            ASSERT_GT(m_end - m0, 64) << "s_q " << s_q << " block " << m;
          }
          if (short_head) {
            if (m == 0) ASSERT_EQ(m_end, (rem + 63) / 64 * 64) << "s_q " << s_q;
            if (m > 0 && m < blocks - 1) {
              ASSERT_EQ(m_end - m0, block_m) << "s_q " << s_q << " block " << m;
            }
          } else if (cut == kSm90CutPlain || cut == kSm90CutShortHead || m < blocks - 2) {
            ASSERT_EQ(m0, p0);
            ASSERT_EQ(m_end, p_end);
          }
          next = m_end;
        }
        ASSERT_EQ(next, s_q) << "s_q " << s_q << " cut " << cut;
        int m0 = 0, m_end = 0;
        EXPECT_FALSE(Sm90RowBlock(blocks, s_q, block_m, cut, &m0, &m_end));
      }
    }
  }
  // Rows {m0, m_end} of block m (the block exists).
  auto rows = [](int m, int s_q, int cut) {
    int m0 = -1, m_end = -1;
    EXPECT_TRUE(Sm90RowBlock(m, s_q, 192, cut, &m0, &m_end)) << "s_q " << s_q << " block " << m;
    return std::pair{m0, m_end};
  };
  // The standard sweep's s = 1024 with 192-row blocks. Narrow tail: 4 x 192, then 2 x 128.
  EXPECT_EQ(rows(4, 1024, kSm90CutNarrowTail), std::pair(768, 896));
  EXPECT_EQ(rows(5, 1024, kSm90CutNarrowTail), std::pair(896, 1024));
  // Short head: 64, then 5 x 192.
  EXPECT_EQ(rows(0, 1024, kSm90CutShortHead), std::pair(0, 64));
  EXPECT_EQ(rows(5, 1024, kSm90CutShortHead), std::pair(832, 1024));
  // s = 1000: a 64-row head, and the last block ends at the sequence (rows 1000.. of its third
  // warpgroup are computed, never stored).
  EXPECT_EQ(rows(5, 1000, kSm90CutShortHead), std::pair(832, 1000));
  // s = 2048: 128 rows left over, a head of two warpgroups.
  EXPECT_EQ(rows(0, 2048, kSm90CutShortHead).second, 128);
}

}  // namespace
}  // namespace attn::kernels::cuda
