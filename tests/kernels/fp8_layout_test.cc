// The FP8 forward kernel's layouts (flash_fwd_sm90_fp8_layout.h), checked on the host against the
// wgmma fragment layouts as the PTX ISA states them: P packed from the S accumulator into e4m3 A
// fragments, times Vt's permuted columns, gives P V over the right keys; and the sequences' Vt
// column ranges hold all their key tiles without meeting.
#include "flash_fwd_sm90_fp8_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

namespace attn::kernels::cuda {
namespace {

// The m64nN f32 accumulator of one warp, per the PTX ISA: register i of lane l holds row
// l / 4 + 8 * ((i >> 1) & 1), column 8 * (i >> 2) + 2 * (l % 4) + (i & 1).
int AccRow(int lane, int i) { return lane / 4 + 8 * ((i >> 1) & 1); }
int AccCol(int lane, int i) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }

// The e4m3 A fragment of wgmma m64nNk32 (per warp, as mma.m16n8k32's): byte j of register r of
// lane l is row l / 4 + 8 * (r & 1), column 4 * (l % 4) + 16 * (r >> 1) + j.
int FragRow(int lane, int r) { return lane / 4 + 8 * (r & 1); }
int FragCol(int lane, int r, int j) { return 4 * (lane % 4) + 16 * (r >> 1) + j; }

TEST(Fp8Layout, VtColumnsPermuteEachGroupOfKeys) {
  std::set<int> keys;
  for (int c = 0; c < 32; ++c) keys.insert(Fp8VtKeyOfColumn(c));
  EXPECT_EQ(keys.size(), 32u);
  EXPECT_EQ(*keys.begin(), 0);
  EXPECT_EQ(*keys.rbegin(), 31);
}

// Every byte of every A fragment of a 128-key tile holds, for its own row, the score of the key
// whose V row its column of Vt holds; and every score of the accumulator is used exactly once.
TEST(Fp8Layout, PackedPMeetsTheVRowOfItsKey) {
  constexpr int kBN = kFp8BlockN;
  for (int lane = 0; lane < 32; ++lane) {
    std::set<int> used;
    for (int kk = 0; kk < kBN / 32; ++kk) {
      for (int r = 0; r < 4; ++r) {
        for (int j = 0; j < 4; ++j) {
          const int i = Fp8PackSource(kk, r, j);
          ASSERT_GE(i, 0);
          ASSERT_LT(i, kBN / 2);
          used.insert(i);
          EXPECT_EQ(AccRow(lane, i), FragRow(lane, r)) << "lane " << lane << " kk " << kk << " r " << r;
          // Column c of the A fragment (key group kk) multiplies Vt column 32 kk + c, which holds
          // the V row of key 32 kk + Fp8VtKeyOfColumn(c).
          const int vt_key = 32 * kk + Fp8VtKeyOfColumn(FragCol(lane, r, j));
          EXPECT_EQ(AccCol(lane, i), vt_key) << "lane " << lane << " kk " << kk << " r " << r << " byte " << j;
        }
      }
    }
    EXPECT_EQ(used.size(), size_t(kBN / 2));
  }
}

// A product computed through the layouts equals P V: a lane-level simulation of one 16-row slice
// of the tile with random P and V.
TEST(Fp8Layout, SimulatedPvEqualsTheDirectProduct) {
  constexpr int kBN = kFp8BlockN, kRows = 16, kCols = 8;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> val(-8, 8);
  std::vector<int> p(kRows * kBN), v(kBN * kCols);
  for (int& x : p) x = val(rng);
  for (int& x : v) x = val(rng);
  // Vt[d][col] as the transposition writes it.
  std::vector<int> vt(kCols * kBN);
  for (int d = 0; d < kCols; ++d)
    for (int c = 0; c < kBN; ++c) vt[d * kBN + c] = v[((c & ~31) + Fp8VtKeyOfColumn(c & 31)) * kCols + d];
  // Each lane's accumulator registers of S (= P here), then its A fragments, then O = A Vt^T.
  std::vector<long> o(kRows * kCols, 0);
  for (int lane = 0; lane < 32; ++lane) {
    std::vector<int> acc(kBN / 2);
    for (int i = 0; i < kBN / 2; ++i) acc[i] = p[AccRow(lane, i) * kBN + AccCol(lane, i)];
    for (int kk = 0; kk < kBN / 32; ++kk)
      for (int r = 0; r < 4; ++r)
        for (int j = 0; j < 4; ++j) {
          const int a = acc[Fp8PackSource(kk, r, j)];
          const int row = FragRow(lane, r), col = 32 * kk + FragCol(lane, r, j);
          for (int d = 0; d < kCols; ++d) o[row * kCols + d] += long(a) * vt[d * kBN + col];
        }
  }
  for (int row = 0; row < kRows; ++row)
    for (int d = 0; d < kCols; ++d) {
      long want = 0;
      for (int key = 0; key < kBN; ++key) want += long(p[row * kBN + key]) * v[key * kCols + d];
      EXPECT_EQ(o[row * kCols + d], want) << "row " << row << " col " << d;
    }
}

// Sequence b's key tiles read columns [start, start + round_up(s_k, 128)): inside its own range,
// which ends at or before the next sequence's start, and the last range ends at Fp8VtColumns.
TEST(Fp8Layout, SequencesVtRangesHoldTheirTilesApart) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> len(0, 700);
  for (int trial = 0; trial < 200; ++trial) {
    const int batch = 1 + trial % 9;
    std::vector<int64_t> cu(batch + 1, 0);
    for (int b = 0; b < batch; ++b) cu[b + 1] = cu[b] + len(rng);
    for (int b = 0; b < batch; ++b) {
      const int64_t start = Fp8VtSeqStart(cu[b], b);
      const int64_t next = b + 1 < batch ? Fp8VtSeqStart(cu[b + 1], b + 1) : Fp8VtColumns(cu[batch], batch);
      const int64_t s_k = cu[b + 1] - cu[b];
      EXPECT_EQ(start % kFp8VtAlign, 0);
      EXPECT_LE(start + (s_k + kFp8BlockN - 1) / kFp8BlockN * kFp8BlockN, next);
      // The transposition's blocks per sequence (RunFlashFwdSm90Fp8) cover the whole range.
      const int64_t max_blocks = (s_k + 2 * kFp8VtAlign - 1) / kFp8VtAlign + 1;
      EXPECT_LE(next - start, max_blocks * kFp8VtAlign);
    }
    EXPECT_EQ(Fp8VtBytes(cu[batch], batch, 2, 128), Fp8VtColumns(cu[batch], batch) * 2 * 128);
  }
}

// The FP8 tile rules on the GPU's 132 SMs: 192-row tiles where launches fill several rounds of
// the grid, 128-row tiles where a launch has fewer tiles than SMs on them (and d=256 always).
TEST(Fp8TileRules, FewTilesTakeNarrowRows) {
  // The standard sweep (16k tokens, 16 heads at d=128): 192.
  for (int s : {1024, 4096, 8192, 16384}) EXPECT_EQ(Fp8TileRows(128, s, 16, 16384 / s, 132), 192) << s;
  // A prefill chunk of 512 at batch 1, 32 heads: 96 tiles of 192 rows or 128 of 128, one round
  // each.
  EXPECT_EQ(Fp8TileRows(128, 512, 32, 1, 132), 128);
  EXPECT_EQ(Fp8TileRounds(192, 512, 32, 1, 132), 1);
  EXPECT_EQ(Fp8TileRounds(128, 512, 32, 1, 132), 1);
  // A chunk of 2048: 352 tiles in 3 rounds (396) against 512 in 4 (400).
  EXPECT_EQ(Fp8TileRows(128, 2048, 32, 1, 132), 192);
  // 129 rows at batch 2, 8 heads: 16 tiles of 192 rows and 32 of 128, one round either way.
  EXPECT_EQ(Fp8TileRows(128, 129, 8, 2, 132), 128);
  for (int s : {128, 512, 4096}) EXPECT_EQ(Fp8TileRows(256, s, 8, 4, 132), 128) << s;
  EXPECT_EQ(Fp8TileRows(128, 4096, 16, 4, 0), 128);  // no SM count: the tile both head dims have
}

}  // namespace
}  // namespace attn::kernels::cuda
