// The split-KV decode kernel's split rule (decode_plan.h, what MakePlan asks for its plan), checked
// on the host: batch-1 decode fills the GPU (every CTA slot, or every SM once splits are long), full batches stay unsplit, each split
// gets whole work (at least two key tiles per warp, none left nearly empty), and the rule keeps to
// its bounds over a grid of shapes.
#include "decode_plan.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace attn::kernels::cuda {
namespace {

// GQA 32/8 at head dim 128 on an H200 (132 SMs): the 16-bit kernel's tiles of 16 keys, two CTAs
// per SM.
DecodeSplitShape H200(int64_t batch, int64_t cache, int warp_n = 16, int ctas_per_sm = 2) {
  DecodeSplitShape s;
  s.batch = batch;
  s.num_kv_heads = 8;
  s.m_blocks = 1;  // 1 query x 4 heads per KV head: one row block of 16
  s.max_seqlen_k = cache;
  s.warp_n = warp_n;
  s.ctas_per_sm = ctas_per_sm;
  s.sms = 132;
  return s;
}

TEST(DecodeSplits, OneSequenceFillsEveryCtaSlot) {
  // 4k keys: 256 tiles of 16; 33 splits would fill the 264 slots, but the last would be empty:
  // 32 splits of 8 tiles (two per warp), 256 CTAs.
  EXPECT_EQ(DecodeSplits(H200(1, 4096)), 32);
  // 8k and more: splits of 32 tiles and more, so one CTA per SM: 16 splits x 8 KV heads = 128
  // CTAs on 132 SMs.
  EXPECT_EQ(DecodeSplits(H200(1, 32768)), 16);
  EXPECT_EQ(DecodeSplits(H200(1, 131072)), 16);
  EXPECT_EQ(DecodeSplits(H200(1, 8192)), 16);
  EXPECT_EQ(DecodeSplits(H200(1, 16384)), 16);
  // d=256 runs one CTA per SM: 16 splits x 8 heads = 128 CTAs of 132 slots.
  EXPECT_EQ(DecodeSplits(H200(1, 32768, 16, 1)), 16);
  // The FP8 kernel's 32-key tiles: 4k is 128 tiles, at most 16 splits of 8 tiles; 32k is 1024
  // tiles, 64 per split at one CTA per SM: long splits, 16.
  EXPECT_EQ(DecodeSplits(H200(1, 4096, 32)), 16);
  EXPECT_EQ(DecodeSplits(H200(1, 32768, 32)), 16);
}

TEST(DecodeSplits, SmallBatchesShareTheSlots) {
  EXPECT_EQ(DecodeSplits(H200(2, 2048)), 16);   // 16 sequence-heads x 16 = 256 CTAs
  EXPECT_EQ(DecodeSplits(H200(2, 4096)), 8);    // 16 x 8 of 32 tiles: one CTA per SM
  EXPECT_EQ(DecodeSplits(H200(4, 4096)), 4);    // 32 x 4
  EXPECT_EQ(DecodeSplits(H200(8, 512)), 4);     // 64 x 4: 16 tiles each at one CTA per SM
  EXPECT_EQ(DecodeSplits(H200(8, 4096)), 2);    // 64 x 2, one CTA per SM: 128 tiles each
  EXPECT_EQ(DecodeSplits(H200(8, 32768)), 2);   // 64 x 2, one CTA per SM: 1024 tiles each
  EXPECT_EQ(DecodeSplits(H200(14, 4096)), 2);   // 112 x 2 = 224
}

TEST(DecodeSplits, FullBatchesStayUnsplit) {
  // 15 x 8 = 120 CTAs >= 90% of 132 SMs: one CTA per SM streams its whole cache.
  EXPECT_EQ(DecodeSplits(H200(15, 4096)), 1);
  EXPECT_EQ(DecodeSplits(H200(16, 32768)), 1);
  EXPECT_EQ(DecodeSplits(H200(64, 4096)), 1);
  // Multi-token steps of 16 queries x 4 heads: 4 row blocks per KV head. 4 sequences give 128
  // CTAs unsplit; 2 sequences 64, which 2 long splits (256 tiles each) take to 128.
  DecodeSplitShape steps = H200(4, 8192);
  steps.m_blocks = 4;
  EXPECT_EQ(DecodeSplits(steps), 1);
  steps.batch = 2;
  EXPECT_EQ(DecodeSplits(steps), 2);
  steps.max_seqlen_k = 512;  // 16 tiles each at one CTA per SM, not long: both slots, 4 splits
  EXPECT_EQ(DecodeSplits(steps), 4);
}

TEST(DecodeSplits, ShortCachesStayUnsplit) {
  // Fewer than 16 tiles: no split would give each warp two tiles.
  EXPECT_EQ(DecodeSplits(H200(1, 200)), 1);
  EXPECT_EQ(DecodeSplits(H200(1, 1)), 1);
  EXPECT_EQ(DecodeSplits(H200(1, 256)), 2);  // 16 tiles: two splits of 8
}

TEST(DecodeSplits, BoundsOverManyShapes) {
  for (int64_t batch : {1, 2, 3, 5, 7, 9, 13, 20, 100}) {
    for (int64_t heads : {1, 2, 8, 32}) {
      for (int64_t m_blocks : {1, 2, 8}) {
        for (int64_t cache : {1, 17, 100, 129, 1000, 4097, 8191, 65536, 1 << 20}) {
          for (int warp_n : {16, 32}) {
            for (int ctas : {1, 2}) {
              for (int sms : {1, 16, 108, 132}) {
                DecodeSplitShape s = H200(batch, cache, warp_n, ctas);
                s.num_kv_heads = heads;
                s.m_blocks = m_blocks;
                s.sms = sms;
                const int splits = DecodeSplits(s);
                SCOPED_TRACE(::testing::Message() << "b=" << batch << " heads=" << heads << " m="
                                                  << m_blocks << " cache=" << cache << " n="
                                                  << warp_n << " ctas/SM=" << ctas << " SMs=" << sms
                                                  << " -> " << splits);
                ASSERT_GE(splits, 1);
                ASSERT_LE(splits, s.max_splits);
                const int64_t base = batch * heads * m_blocks;
                const int64_t tiles = (cache + warp_n - 1) / warp_n;
                if (10 * base >= 9 * sms) ASSERT_EQ(splits, 1);
                if (splits > 1) {
                  // No more CTAs than slots, two tiles per warp, the last split not empty.
                  EXPECT_LE(base * splits, int64_t(ctas) * sms);
                  const int64_t per_split = (tiles + splits - 1) / splits;
                  EXPECT_GE(per_split, 2 * s.warps);
                  EXPECT_LT((splits - 1) * per_split, tiles);
                }
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attn::kernels::cuda
