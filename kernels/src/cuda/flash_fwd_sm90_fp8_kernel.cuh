// FP8 forward attention for sm_90a (device code): q, k and v as e4m3 codes, both products on FP8
// tensor cores (wgmma m64nNk32 e4m3), o in fp16/bf16.
//
// The structure is generation 2's (flash_fwd_sm90_kernel.cuh), whose tile, ring and barrier types
// it uses: a persistent CTA of one producer warpgroup (one thread issuing every TMA load) and two
// consumer warpgroups of 64 query rows each, K/V tiles of 128 keys in a ring of stages, tiles in
// the fixed snake order (cost order for causal launches). What differs:
//  - a Q or K row of D codes is D bytes: its tile lies in 128-code slabs of 128-byte swizzled rows,
//    and a k32 step of S = Q K^T is +32 bytes inside the row, as a k16 step of 16-bit codes is;
//  - V is read transposed (Vt, flash_fwd_sm90_fp8_layout.h; written by Fp8TransposeVKernel before
//    the launch), since FP8 wgmma takes B K-major only: a Vt tile is D rows of 128 keys;
//  - P goes to the P V product as e4m3 of p * 2^kFp8PBias, packed in the accumulator's order (the
//    Vt columns are permuted to match, so no shuffle is needed);
//  - the descales: q's and k's scale the scores (folded into the exp2 argument), v's the output.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "flash_fwd_sm90_fp8_layout.h"
#include "flash_fwd_sm90_fp8_phases.h"
#include "flash_fwd_sm90_kernel.cuh"
#include "flash_params.h"
#include "ptx.cuh"
#include "ptx_sm90.cuh"

namespace attn::kernels::cuda {

// kExpFmaEveryV: Sm90Softmax's kFmaEvery. Each warpgroup's softmax sits between its two products,
// and its 8192 exp2 per 128-key tile take the MUFU pipe (16 a clock per SM; the e4m3 packs run
// on another pipe: kernels/bench/pipe_rates), so a share of them on the FMA pipe shortens it
// (docs/PERF.md: a quarter, 4-8% faster on the H200).
// kConsumerWGsV: consumer warpgroups of 64 query rows (3 only where their registers fit 160).
// kOverlapV: S of the next key tile issued with P V of this one, its softmax run while that P V is
// on the tensor cores (generation 2's kOverlap; Sm90Fp8Consume).
// kTcRowSumV: each row's sum of a key tile's P taken on the tensor cores, as P times a block of
// e4m3 ones (one m64n8k32 product beside each 32 keys' P V, 4 accumulators a thread), added to
// the row's float sum once P V is complete, instead of 64 FADDs a thread and key tile in the
// softmax's chain (fp8_variants float_sum, tc_sum, wg2_tc_sum; docs/PERF.md). The sum is then of
// the e4m3 P that P V used, not of the unrounded p, so O is normalised by its own weights and LSE
// is the log of their sum: a row whose weight sits on a few keys moves its LSE by a share of an
// e4m3 step (up to 0.04 in the GPU tests) against the unrounded sums'. 1.04-1.05x at d=128 with
// three warpgroups (H100), shipped there (Fp8SumsRoundedP); d=256 and the 128-row tiles ran 1-6%
// slower. A tile's products start from zero: summed on the tensor cores over the whole row, whose
// FP8 sums keep ~13 bits, the sums of positive terms lost so much that O moved 6-15% (relative
// L2) at s = 4k-8k.
// kStamps: false here; kernels/bench/fp8_variants derives traits that set it and give
// AddClocks(sums, key_tiles, producer), to time each phase (Sm90Fp8Clocks), and TraceSlot(role),
// where one CTA's roles write their timeline.
template <int D, typename TO, int kExpFmaEveryV, int kConsumerWGsV = 2, bool kOverlapV = false,
          bool kTcRowSumV = false, int kRescaleSlack8V = 0>
struct Sm90Fp8Traits {
  using T = TO;  // o's type
  static constexpr int kExpFmaEvery = kExpFmaEveryV;
  static constexpr bool kOverlap = kOverlapV;
  static constexpr bool kTcRowSum = kTcRowSumV;
  static constexpr bool kStamps = false;
  // Sm90Softmax's kSlack8 (a lazy rescale: Fp8RescaleSlack8). P's codes are p * 2^kFp8PBias, so
  // a slack s keeps them below 2^(8 + s), inside e4m3's 448 for s <= 0.8 (kSlack8 <= 6).
  static constexpr int kRescaleSlack8 = kRescaleSlack8V;
  // Whether a key tile needs its mask is read off bounds computed once per Q tile (two integer
  // compares) rather than worked out again after each S product (~20 uniform instructions and
  // two branches, ~5% of a d=128 warp's stall samples under ncu). The bounds against the per-tile
  // test on an H100 (fp8_variants, s=4k/8k): d=128 at three warpgroups 1.008-1.015x, d=256
  // 0.95-0.97x (non-causal; causal 1.00), so d=256 and the 128-row tiles (not measured) keep the
  // test. fp8_variants' mask_flipped builds the other choice.
  static constexpr bool kHoistedMask = D == 128 && kConsumerWGsV == 3;
  static constexpr int kHeadDim = D;
  static constexpr int kConsumerWGs = kConsumerWGsV;
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kBlockN = kFp8BlockN;
  static constexpr int kStages = D <= 128 ? 4 : 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kSlabs = D / 128;  // 128-code slabs of a Q or K row
  static constexpr int kPvN = 128;        // P V in products of 128 output columns
  static constexpr int kPvChunks = D / kPvN;

  static constexpr uint32_t kQBytes = uint32_t(kBlockM) * D;
  static constexpr uint32_t kKBytes = uint32_t(kBlockN) * D;
  static constexpr uint32_t kVBytes = uint32_t(D) * kBlockN;  // D rows of 128 key codes
  // Q full/empty per Q buffer, then per stage K full, V full, K empty, V empty (Sm90Bars).
  static constexpr uint32_t kBarBytes = 8 * (2 * 2 + 4 * kStages);
  static constexpr uint32_t kOnesBytes = kTcRowSum ? 1024 : 0;  // 8 rows of 128 e4m3 ones
  static constexpr int kQBufs =
      2 * kQBytes + kStages * (kKBytes + kVBytes) + kBarBytes + kOnesBytes + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr uint32_t kQOff = 0;
  static constexpr uint32_t kKOff = kQBufs * kQBytes;
  static constexpr uint32_t kVOff = kKOff + kStages * kKBytes;
  static constexpr uint32_t kBarOff = kVOff + kStages * kVBytes;
  static constexpr uint32_t kOnesOff = (kBarOff + kBarBytes + 1023) / 1024 * 1024;
  static constexpr uint32_t kSmemBytes = kTcRowSum ? kOnesOff + kOnesBytes : kBarOff + kBarBytes;
  static constexpr uint32_t kSmemAlloc = kSmemBytes + 1024;

  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : 240;
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= kThreads * kLaunchRegs,
                "register split above the launch allocation");
  static_assert(D == 128 || D == 256, "FP8 head dims: whole 128-code slabs, P V in 128-column products");
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory per block");
  static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0,
                "tiles keep 1024-byte alignment");
};

// The traits RunFlashFwdSm90Fp8 launches (kernels/bench/fp8_variants times the others). d=128:
// three consumer warpgroups (192-row tiles), 1.13-1.14x two warpgroups at s=4k/8k although ptxas
// spills 84 bytes under the 160-register split, every exp2 on the MUFU pipe (with three
// warpgroups the FMA pipe's share no longer pays: every exp2 on MUFU 1.007-1.016x every 4th group
// on FMA, H100), and two (128-row tiles) where they take fewer rounds of the grid (Fp8TileRows),
// with every 4th group on FMA (4-8% on the H200); d=256: two warpgroups (their registers do not
// fit three), every 8th group on FMA, 1.05x every 4th.
template <int D>
inline constexpr int kSm90Fp8ShippedWGs = D == 128 ? 3 : 2;
template <int D, int kWGs>
inline constexpr int kSm90Fp8ExpFmaEveryOf = D == 128 ? (kWGs == 3 ? 0 : 4) : 8;
template <int D, typename T, int kWGs>
using Sm90Fp8ShippedWith = Sm90Fp8Traits<D, T, kSm90Fp8ExpFmaEveryOf<D, kWGs>, kWGs, false, Fp8SumsRoundedP(D, 64 * kWGs),
                                         Fp8RescaleSlack8(D, 64 * kWGs)>;
template <int D, typename T>
using Sm90Fp8Shipped = Sm90Fp8ShippedWith<D, T, kSm90Fp8ShippedWGs<D>>;
template <int D, typename T>
using Sm90Fp8ShippedNarrow = Sm90Fp8ShippedWith<D, T, 2>;

// Kernel parameters: the plain ones plus the TMA maps. tq and tk view their tensors [rows, heads,
// D] as {128 codes, rows, D/128 slabs, heads}; tvt views Vt as {columns, D, num_kv_heads}.
struct Sm90Fp8Params {
  FlashParams p;
  CUtensorMap tq;
  CUtensorMap tk;
  CUtensorMap tvt;
};

// SM clocks per phase (flash_fwd_sm90_fp8_phases.h) of the calling thread, for the stamped build;
// without stamps every call compiles to nothing.
template <bool kOn>
struct Sm90Fp8Clocks {
  __device__ __forceinline__ void Start() {}
  __device__ __forceinline__ void Mark(int) {}
};
// With trace set (one thread of each role in one CTA: the traits' TraceSlot), each mark's phase
// and clock are also written there in order, kFp8TraceMarks at most: a timeline of the roles.
template <>
struct Sm90Fp8Clocks<true> {
  uint32_t last = 0;
  uint32_t sum[kFp8Phases] = {};
  uint32_t* trace = nullptr;
  int marks = 0;
  __device__ __forceinline__ static uint32_t Now() {
    uint32_t c;
    asm volatile("mov.u32 %0, %%clock;\n" : "=r"(c));
    return c;
  }
  __device__ __forceinline__ void Record(int phase, uint32_t now) {
    if (trace != nullptr && marks < kFp8TraceMarks) {
      trace[2 * marks] = uint32_t(phase);
      trace[2 * marks + 1] = now;
      ++marks;
    }
  }
  __device__ __forceinline__ void Start() {
    last = Now();
    Record(kFp8Phases, last);
  }
  __device__ __forceinline__ void Mark(int phase) {
    const uint32_t now = Now();
    sum[phase] += now - last;
    last = now;
    Record(phase, now);
  }
};

// Four floats -> one register of four e4m3 codes (a in the low byte), rounded to nearest and
// saturated at +-448.
__device__ __forceinline__ uint32_t PackE4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  // cvt's first source lands in the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(lo) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(hi) : "f"(c), "f"(d));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// P (biased p of one 128-key tile, in the S accumulator) as the e4m3 A fragments of P V, 32 keys
// per fragment (Fp8PackSource).
template <int BN>
__device__ __forceinline__ void Sm90Fp8PackP(uint32_t (&pa)[BN / 32][4], const float (&s)[BN / 2]) {
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      pa[kk][r] = PackE4m3x4(s[Fp8PackSource(kk, r, 0)], s[Fp8PackSource(kk, r, 1)],
                             s[Fp8PackSource(kk, r, 2)], s[Fp8PackSource(kk, r, 3)]);
    }
}

// Normalises O (times v's descale), writes LSE (natural units) and O rows r0 and r0 + 8 of this
// thread (those inside the sequence).
template <typename Tr>
__device__ __forceinline__ void Sm90Fp8Epilogue(const FlashParams& p, const Sm90Tile& t, int h, int r0,
                                                int lane, float (&o)[Tr::kPvChunks][Tr::kPvN / 2],
                                                const float (&row_max)[2], float (&row_sum)[2],
                                                float v_descale, float score_scale) {
  using T = typename Tr::T;
  T* go = reinterpret_cast<T*>(p.o) + int64_t(t.q_start) * p.o_row_stride + h * Tr::kHeadDim;
  constexpr float kBiasLn = float(kFp8PBias) * 0.6931471805599453f;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = row_sum[hf];
    if constexpr (!Tr::kTcRowSum) {  // this thread's share of the row's keys (else the whole row's)
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    }
    const bool any = sum > 0.0f;
    const float inv = any ? v_descale / sum : 0.0f;
    const int row = r0 + 8 * hf;
    if (row >= t.s_q) continue;
    if (p.lse != nullptr && (lane & 3) == 0) {
      p.lse[int64_t(h) * p.total_q + t.q_start + row] =
          any ? row_max[hf] * score_scale + __logf(sum) - kBiasLn : -INFINITY;
    }
    T* orow = go + int64_t(row) * p.o_row_stride + 2 * (lane & 3);
#pragma unroll
    for (int nc = 0; nc < Tr::kPvChunks; ++nc)
#pragma unroll
      for (int c = 0; c < Tr::kPvN / 8; ++c) {
        *reinterpret_cast<uint32_t*>(orow + nc * Tr::kPvN + 8 * c) =
            ptx::Pack2<T>(o[nc][4 * c + 2 * hf] * inv, o[nc][4 * c + 2 * hf + 1] * inv);
      }
  }
}

// Producer, one tile of sequence b: Q into buffer q (free: its "empty" phase waited for), then
// each key tile's K rows and Vt columns into the stage ring.
template <typename Tr>
__device__ __forceinline__ void Sm90Fp8Produce(const Sm90Fp8Params& P, const Sm90Tile& t, int b, int h,
                                               uint8_t* smem, const Sm90Bars<Tr::kStages>& bars,
                                               Sm90Ring<Tr::kStages>& ring, const Sm90QSlot& q) {
  const int hk = h / P.p.heads_per_kv;
  const int vt0 = int(Fp8VtSeqStart(t.k_start, b));
  Sm90Fp8Clocks<Tr::kStamps> clk;
  if constexpr (Tr::kStamps) clk.trace = Tr::TraceSlot(Tr::kConsumerWGs);
  clk.Start();
  ptx::MbarArriveExpectTx(bars.FullQ(q.buf), Tr::kQBytes);
  ptx::TmaLoad4d(smem + Tr::kQOff + q.buf * Tr::kQBytes, &P.tq, 0, t.q_start + t.m0, 0, h,
                 bars.FullQ(q.buf));
  for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
    const int st = ring.st;
    ptx::MbarWait(bars.EmptyK(st), ring.phase ^ 1);
    clk.Mark(kFp8WaitEmpty);
    ptx::MbarArriveExpectTx(bars.FullK(st), Tr::kKBytes);
    ptx::TmaLoad4d(smem + Tr::kKOff + st * Tr::kKBytes, &P.tk, 0, t.k_start + nb * Tr::kBlockN, 0, hk,
                   bars.FullK(st));
    clk.Mark(kFp8Issue);
    ptx::MbarWait(bars.EmptyV(st), ring.phase ^ 1);
    clk.Mark(kFp8WaitEmpty);
    ptx::MbarArriveExpectTx(bars.FullV(st), Tr::kVBytes);
    ptx::TmaLoad3d(smem + Tr::kVOff + st * Tr::kVBytes, &P.tvt, vt0 + nb * Tr::kBlockN, 0, hk,
                   bars.FullV(st));
    clk.Mark(kFp8Issue);
    ring.Advance();
  }
  if constexpr (Tr::kStamps) Tr::AddClocks(clk.sum, uint32_t(t.nb_max - t.nb_min), true);
}

// Consumer warpgroup `cw` (0-based): rows m0 + 64 * cw .. + 63 of the tile, one key tile at a
// time (S, mask, softmax, P V, each product waited for at once: the two warpgroups' interleaving
// keeps the tensor cores busy during each one's softmax; turns imposed between them by named
// barriers, or P V issued with the next S and both waited for, measured slower: docs/PERF.md), or,
// with Tr::kOverlap, the softmax of each tile under the previous tile's P V.
template <typename Tr>
__device__ __forceinline__ void Sm90Fp8Consume(const Sm90Fp8Params& P, const Sm90Tile& t, int b, int h,
                                               int cw, uint8_t* smem, const Sm90Bars<Tr::kStages>& bars,
                                               Sm90Ring<Tr::kStages>& ring, uint32_t q_loads) {
  constexpr int D = Tr::kHeadDim;
  constexpr int BN = Tr::kBlockN;
  const FlashParams& p = P.p;
  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const int r0 = t.m0 + 64 * cw + 16 * (tid / 32) + lane / 4;  // this thread's first row
  const Sm90QSlot q(q_loads, Tr::kQBufs);
  const uint32_t sq = ptx::SmemAddr(smem + Tr::kQOff + q.buf * Tr::kQBytes) + cw * 64 * 128;
  const uint32_t sk = ptx::SmemAddr(smem + Tr::kKOff);
  const uint32_t sv = ptx::SmemAddr(smem + Tr::kVOff);
  const uint32_t sones = ptx::SmemAddr(smem + Tr::kOnesOff);
  const int di = b * p.num_kv_heads + h / p.heads_per_kv;
  const float qk_descale = __ldg(p.q_descale + di) * __ldg(p.k_descale + di);
  const float sl2 = p.scale_log2 * qk_descale;
  const int m_last = t.m_end - 1;
  int nb_plain_lo = INT_MIN, nb_plain_hi = INT_MAX;  // Tr::kHoistedMask: Sm90PlainKeyTiles
  if constexpr (Tr::kHoistedMask) Sm90PlainKeyTiles<BN>(p, t, &nb_plain_lo, &nb_plain_hi);

  float o[Tr::kPvChunks][Tr::kPvN / 2];
#pragma unroll
  for (int nc = 0; nc < Tr::kPvChunks; ++nc)
#pragma unroll
    for (int i = 0; i < Tr::kPvN / 2; ++i) o[nc][i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  // Tr::kTcRowSum: a key tile's P times ones (the sums of rows r0 and r0 + 8 in lsum[0], lsum[2]).
  float lsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float corr[2];
  bool moved = true;  // whether O needs corr (Tr::kRescaleSlack8)
  // A warp holding rows past the sequence's end (the next sequence's queries, or none) rescales on
  // every key tile: its lazy choices then depend on its own rows alone, which the tests' model
  // follows. (Leaving those rows out of the vote instead cost the lazy rescale's gain.)
  const bool eager = r0 - lane / 4 + 15 >= t.s_q;
  static_assert(Tr::kRescaleSlack8 >= 0 && Tr::kRescaleSlack8 <= 6, "P's codes stay below e4m3's 448");
  float s[BN / 2];
  uint32_t pa[BN / 32][4];
  Sm90Fp8Clocks<Tr::kStamps> clk;  // (the stamped build's non-overlapped loop only)
  if constexpr (Tr::kStamps) {
    if (tid == 0) clk.trace = Tr::TraceSlot(cw);
  }
  clk.Start();

  // S of key tile stage st into s; P V of stage st into o (not committed or waited for).
  auto issue_s = [&](int st) {
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks) {
      const uint32_t kofs = (ks % 4) * 32;  // 32 codes = 32 bytes inside the swizzled row
      const uint64_t da = ptx::SmemDesc(sq + (ks / 4) * Tr::kBlockM * 128 + kofs, 16);
      const uint64_t db = ptx::SmemDesc(sk + st * Tr::kKBytes + (ks / 4) * BN * 128 + kofs, 16);
      ptx::WgmmaSSFp8<BN>(s, da, db, ks > 0);
    }
  };
  auto issue_pv = [&](int st) {
#pragma unroll
    for (int kk = 0; kk < BN / 32; ++kk)
#pragma unroll
      for (int nc = 0; nc < Tr::kPvChunks; ++nc) {
        // Rows nc * 128.. of the Vt tile (head-dim columns of O), keys 32 kk.. (+32 bytes).
        const uint32_t addr = sv + st * Tr::kVBytes + nc * Tr::kPvN * 128 + kk * 32;
        ptx::WgmmaRSFp8<Tr::kPvN>(o[nc], pa[kk], ptx::SmemDesc(addr, 16));
      }
    if constexpr (Tr::kTcRowSum) {
#pragma unroll
      for (int kk = 0; kk < BN / 32; ++kk) {
        ptx::WgmmaRSFp8Scaled<8>(lsum, pa[kk], ptx::SmemDesc(sones + kk * 32, 16), kk > 0);
      }
    }
  };
  // P V waited for: O complete (and, Tr::kTcRowSum, the tile's row sums added).
  auto fence_o = [&] {
#pragma unroll
    for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
    if constexpr (Tr::kTcRowSum) {
      ptx::RegFence(lsum);
      row_sum[0] += lsum[0];
      row_sum[1] += lsum[2];
    }
  };
  // Scores of tile nb (complete, in s) -> the tile's p in s and O's factor in corr; K's stage
  // (and Q, after the last S) released. Then (pack_p, once no P V is in flight) O rescaled and P
  // packed into pa.
  auto softmax = [&](int nb, int st) {
    if (lane == 0) {
      ptx::MbarArrive(bars.EmptyK(st));
      if (nb == t.nb_min) ptx::MbarArrive(bars.EmptyQ(q.buf));
    }
    const int n0 = nb * BN;
    bool masked;
    if constexpr (Tr::kHoistedMask) {
      masked = nb > nb_plain_hi || nb < nb_plain_lo;
    } else {
      masked = (n0 + BN > t.s_k) || (p.has_right && n0 + BN - 1 > t.m0 + t.off + p.right) ||
               (p.has_left && n0 < m_last + t.off - p.left);
    }
    if (masked) Sm90Mask<BN>(s, p, t, r0, n0, lane);
    // Scores in code units: sl2 = softmax scale * q descale * k descale * log2 e.
    moved = Sm90Softmax<BN, kFp8PBias, Tr::kExpFmaEvery, !Tr::kTcRowSum, Tr::kRescaleSlack8>(s, row_max, row_sum,
                                                                                            corr, sl2, eager);
  };
  auto pack_p = [&] {
    if (moved) {
      Sm90Rescale<Tr>(o, corr);
      if constexpr (Tr::kTcRowSum) {
        row_sum[0] *= corr[0];
        row_sum[1] *= corr[1];
      }
    }
    Sm90Fp8PackP<BN>(pa, s);
  };
  // S of key tile nb (stage st) on its own, then its P; returns once the stage's V is loaded.
  auto s_to_p = [&](int nb, int st) {
    ptx::MbarWait(bars.FullK(st), ring.phase);
    clk.Mark(kFp8WaitK);
    ptx::WgmmaFence();
    issue_s(st);
    ptx::WgmmaCommit();
    ptx::WgmmaWait<0>();
    ptx::RegFence(s);
    clk.Mark(kFp8S);
    softmax(nb, st);
    clk.Mark(kFp8Softmax);
    pack_p();
    clk.Mark(kFp8Pack);
    ptx::MbarWait(bars.FullV(st), ring.phase);
    clk.Mark(kFp8WaitV);
  };
  // P V of stage st on its own, waited for; then the stage's V released.
  auto pv_alone = [&](int st) {
    ptx::WgmmaFence();
    issue_pv(st);
    ptx::WgmmaCommit();
    ptx::WgmmaWait<0>();
    fence_o();
    if (lane == 0) ptx::MbarArrive(bars.EmptyV(st));
    clk.Mark(kFp8Pv);
  };
  if (t.nb_max > t.nb_min) {  // else no key tile: Q is not loaded, O = 0 and LSE = -inf
    ptx::MbarWait(bars.FullQ(q.buf), q.phase);
    clk.Mark(kFp8WaitQ);
    if constexpr (Tr::kOverlap) {
      // As generation 2's kOverlap loop: each tile's V is waited for right after its softmax,
      // before the wait for the previous P V (an mbarrier poll ends a basic block; ptxas hoists a
      // wgmma wait to the top of its block).
      int st = ring.st;
      int nb = t.nb_max - 1;
      s_to_p(nb, st);
      for (;;) {
        const int st_prev = st;
        ring.Advance();
        if (--nb < t.nb_min) {
          pv_alone(st_prev);
          break;
        }
        st = ring.st;
        ptx::MbarWait(bars.FullK(st), ring.phase);
        ptx::WgmmaFence();
        issue_s(st);
        ptx::WgmmaCommit();
        issue_pv(st_prev);
        ptx::WgmmaCommit();
        ptx::WgmmaWait<1>();  // S complete; P V may still run
        ptx::RegFence(s);
        softmax(nb, st);
        ptx::MbarWait(bars.FullV(st), ring.phase);
        ptx::WgmmaWait<0>();
        fence_o();
        if (lane == 0) ptx::MbarArrive(bars.EmptyV(st_prev));
        pack_p();
      }
    } else {
      for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
        const int st = ring.st;
        s_to_p(nb, st);
        pv_alone(st);
        ring.Advance();
      }
    }
  }
  Sm90Fp8Epilogue<Tr>(p, t, h, r0, lane, o, row_max, row_sum, __ldg(p.v_descale + di),
                      p.scale * qk_descale);
  clk.Mark(kFp8Epilogue);
  if constexpr (Tr::kStamps) {
    if (tid == 0) Tr::AddClocks(clk.sum, uint32_t(t.nb_max - t.nb_min), false);
  }
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) FlashFwdSm90Fp8Kernel(const __grid_constant__ Sm90Fp8Params P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int S = Tr::kStages;
  const Sm90Bars<S> bars{reinterpret_cast<uint64_t*>(smem + Tr::kBarOff)};
  constexpr uint32_t kConsumerWarps = Tr::kConsumerWGs * 4;  // each arrives once per release

  if (threadIdx.x == 0) {
    bars.Init(kConsumerWarps);
    ptx::FenceMbarInit();
  }
  if constexpr (Tr::kTcRowSum) {  // the B operand of the row sums' products: e4m3 1.0 everywhere
    if (threadIdx.x < 256) {
      reinterpret_cast<uint32_t*>(smem + Tr::kOnesOff)[threadIdx.x] = 0x38383838u;
      ptx::FenceProxyAsyncShared();
    }
  }
  __syncthreads();

  // One L2 group of all (sequence, head) pairs: the plain cost order (causal) or round-robin.
  const Sm90Schedule sched{(P.p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, P.p.num_heads,
                           P.p.batch, P.p.has_right, P.p.num_heads * P.p.batch, false};
  // Each role walks the CTA's tiles with rows; fn(tile, sequence, head, Q tiles loaded before).
  auto for_each_tile = [&](auto&& fn) {
    uint32_t q_loads = 0;
    for (int r = 0; r * int(gridDim.x) < sched.Total(); ++r) {
      const int j = sched.Tile(r, int(blockIdx.x), int(gridDim.x));
      if (j >= sched.Total()) continue;
      int m_block, h, b;
      sched.Decode(j, &m_block, &h, &b);
      Sm90Tile t;
      if (!MakeSm90Tile<Tr::kBlockM, Tr::kBlockN>(P.p, m_block, b, kSm90CutPlain, &t)) continue;
      fn(t, b, h, q_loads);
      q_loads += t.nb_max > t.nb_min;
    }
  };
  Sm90Ring<S> ring;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (wg == 0) {
    ptx::SetMaxNRegDec<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      for_each_tile([&](const Sm90Tile& t, int b, int h, uint32_t q_loads) {
        if (t.nb_max == t.nb_min) return;
        const Sm90QSlot q(q_loads, Tr::kQBufs);
        ptx::MbarWait(bars.EmptyQ(q.buf), q.phase ^ 1);  // a fresh barrier passes parity 1 at once
        Sm90Fp8Produce<Tr>(P, t, b, h, smem, bars, ring, q);
      });
    }
  } else {
    ptx::SetMaxNRegInc<Tr::kConsumerRegs>();
    for_each_tile([&](const Sm90Tile& t, int b, int h, uint32_t q_loads) {
      Sm90Fp8Consume<Tr>(P, t, b, h, wg - 1, smem, bars, ring, q_loads);
    });
  }
#endif
}

// V [total_k, num_kv_heads, D] e4m3 codes -> Vt [num_kv_heads][D][vt_cols] (layout of
// flash_fwd_sm90_fp8_layout.h). Block (chunk, KV head, sequence) writes 128 columns of the
// sequence's Vt range [Fp8VtSeqStart(cu_k[b], b), the next sequence's start), zeros for the
// columns past its keys: every column a key tile may read is written.
template <int D>
__global__ void __launch_bounds__(256) Fp8TransposeVKernel(const uint8_t* __restrict__ v, int64_t v_row_stride,
                                                           const int32_t* __restrict__ cu_k, int batch,
                                                           uint8_t* __restrict__ vt, int64_t vt_cols) {
  constexpr int kCols = kFp8VtAlign;
  constexpr int kPitch = D + 16;  // bytes per staged key row (16-byte aligned, banks spread)
  __shared__ __align__(16) uint8_t tile[kCols * kPitch];
  const int b = blockIdx.z, hk = blockIdx.y;
  const int64_t k0 = cu_k[b];
  const int s_k = cu_k[b + 1] - int(k0);
  const int64_t start = Fp8VtSeqStart(k0, b);
  const int64_t end = b + 1 < batch ? Fp8VtSeqStart(cu_k[b + 1], b + 1) : vt_cols;
  const int c0 = int(blockIdx.x) * kCols;
  if (start + c0 >= end) return;
  constexpr int kPieces = D / 16;
  for (int i = threadIdx.x; i < kCols * kPieces; i += blockDim.x) {
    const int j = i / kPieces, piece = i % kPieces;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (c0 + j < s_k) {
      val = *reinterpret_cast<const uint4*>(v + (k0 + c0 + j) * v_row_stride + int64_t(hk) * D + piece * 16);
    }
    *reinterpret_cast<uint4*>(tile + j * kPitch + piece * 16) = val;
  }
  __syncthreads();
  uint8_t* out = vt + int64_t(hk) * D * vt_cols + start + c0;
  const int64_t room = end - (start + c0);  // columns of this block inside the sequence's range
  for (int i = threadIdx.x; i < D * (kCols / 4); i += blockDim.x) {
    const int d = i / (kCols / 4), col = 4 * (i % (kCols / 4));
    if (col >= room) continue;
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = col + e;
      const int key = (c & ~31) + Fp8VtKeyOfColumn(c & 31);
      word |= uint32_t(tile[key * kPitch + d]) << (8 * e);
    }
    *reinterpret_cast<uint32_t*>(out + int64_t(d) * vt_cols + col) = word;
  }
}

}  // namespace attn::kernels::cuda
