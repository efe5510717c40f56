// The sm_90a kernel's persistent tile order (flash_fwd_sm90_schedule.h), checked on the host: every
// order visits each (row block, sequence, head) tile exactly once, the cost orders go longest
// first, and the L2-grouped orders keep the pairs at work within their groups.
#include "flash_fwd_sm90_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>
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

}  // namespace
}  // namespace attn::kernels::cuda
