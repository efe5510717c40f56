// FlashAttention forward for sm_90a (device code): wgmma products, TMA loads, warp specialisation.
//
// A persistent CTA per SM computes tiles of kBlockM query rows of one (sequence, head) in turn
// (Sm90Schedule), with 1 + kConsumerWGs warpgroups (3 or 4, flash_fwd_sm90_traits.cuh):
//  - warpgroup 0, the producer, gives registers back (setmaxnreg.dec); one of its threads loads
//    the Q tile, then K and V tiles into a ring of kStages stages with TMA, running ahead into the
//    next tile (its Q into the second Q buffer where there is one, else as soon as the
//    consumers' last S of the current tile is done, so the next tile's loads overlap this one's
//    last products and epilogue). Each stage has a "full" mbarrier for K and one for V (the
//    TMA's transaction bytes complete them) and an "empty" one for each, which the consumer warps
//    arrive on once they are done with that tile (V once its P V is complete; K then too, or
//    once its S is complete in the overlapped loop, which holds two stages at a time).
//  - the other warpgroups, the consumers, take the registers (setmaxnreg.inc) and own 64 query
//    rows each: S = Q K^T (wgmma, both operands in shared memory), masking and the online softmax in
//    registers, then O += P V with P in registers (the accumulator layout of S is the A-fragment
//    layout) and V read MN-major, with no transpose.
// Key tiles run from the last to the first, so the only masked tiles (the sequence tail and the
// causal/window edges) come first, and tiles no row of the CTA can see are never loaded. Varlen
// batches use one tensor map over the packed rows: a tile may run into the next sequence's rows
// (masked for K/V, never stored for Q) or past the tensor's end (zero-filled by the TMA).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "exp2_on_fma.cuh"
#include "flash_fwd_sm90_schedule.h"
#include "flash_fwd_sm90_traits.cuh"
#include "flash_params.h"
#include "ptx.cuh"
#include "ptx_sm90.cuh"

namespace attn::kernels::cuda {

// Kernel parameters: the plain ones plus one TMA descriptor per tensor. Each map views its tensor
// [rows, heads, D] as the 4-D box space {64 columns, rows, D/64 slabs, heads}, so one box of
// {64, tile rows, D/64, 1} lands in shared memory slab by slab.
struct Sm90Params {
  FlashParams p;
  CUtensorMap tq;
  CUtensorMap tk;
  CUtensorMap tv;
  CUtensorMap to;  // O as {64, rows, D/64, heads}, boxes of {64, 64, 1, 1} (the TMA-store epilogue)
  int tma_o;   // 1: O leaves through shared memory and TMA stores (Sm90Launch::tma_o)
  int hb_group;  // the cost-ordered schedule's (sequence, head) pairs per L2 group (Sm90Schedule)
  int l2_phases;  // Sm90Schedule::phased
  int row_cut;  // Sm90RowCut: how Sm90RowBlock cuts the sequences (three-warpgroup tilings only)
  // The cost-ordered schedule's next-tile counter, zeroed before the launch: CTAs then take their
  // tiles one at a time as they finish (Sm90Schedule); nullptr: each CTA's tiles are fixed.
  unsigned int* tile_counter;
  // Paged K/V (Tr::kPaged): rows per TMA box of K and V (Sm90PagedBoxRows); tk and tv then view
  // the page pools as rows of num_pages * page_size (FlashParams::total_k) with boxes of
  // {64, kv_box_rows, 1, 1}.
  int kv_box_rows;
};

// Q buffer and mbarrier parity of the n-th Q tile a CTA loads.
struct Sm90QSlot {
  int buf;
  uint32_t phase;
  __device__ __forceinline__ Sm90QSlot(uint32_t n, int bufs)
      : buf(bufs == 2 ? int(n & 1) : 0), phase(bufs == 2 ? (n >> 1) & 1 : n & 1) {}
};

// The CTA's view of its work: sequence bounds, the key tiles it visits and its mask offsets.
struct Sm90Tile {
  int m0 = 0;        // first query row of the CTA within its sequence
  int m_end = 0;     // past its last row (Sm90RowBlock): at most m0 + kBlockM, at most s_q
  int q_start = 0;   // packed row of the sequence's first query
  int k_start = 0;   // packed row of its first key
  int s_q = 0;
  int s_k = 0;
  int off = 0;       // s_k - s_q: query i sits at key position i + off
  int nb_min = 0;    // key tiles [nb_min, nb_max), visited downwards
  int nb_max = 0;
};

// kPaged: k_start is the sequence's first entry of the page table (page_indices) instead.
template <int BM, int BN, bool kPaged = false>
__device__ __forceinline__ bool MakeSm90Tile(const FlashParams& p, int m_block, int b, int row_cut,
                                             Sm90Tile* t) {
  t->q_start = p.cu_seqlens_q[b];
  t->s_q = p.cu_seqlens_q[b + 1] - t->q_start;
  if (!Sm90RowBlock(m_block, t->s_q, BM, row_cut, &t->m0, &t->m_end)) return false;
  if constexpr (kPaged) {
    t->k_start = p.page_indptr[b];
    t->s_k = p.seqlens_k[b];
  } else {
    t->k_start = p.cu_seqlens_k[b];
    t->s_k = p.cu_seqlens_k[b + 1] - t->k_start;
  }
  t->off = t->s_k - t->s_q;
  const int m_last = t->m_end - 1;
  int n_lo = 0;
  int n_hi = t->s_k;
  if (p.has_left) n_lo = max(0, t->m0 + t->off - p.left);
  if (p.has_right) n_hi = min(t->s_k, m_last + t->off + p.right + 1);
  t->nb_min = n_lo / BN;
  t->nb_max = n_hi > n_lo ? (n_hi + BN - 1) / BN : t->nb_min;
  return true;
}

// How a launch cuts its row blocks (Sm90RowCut): plainly but for three-warpgroup tilings (plain
// at compile time for the others, whose code then stays as it was).
template <typename Tr>
__device__ __forceinline__ int Sm90CutOf(const Sm90Params& P) {
  return Tr::kConsumerWGs == 3 ? P.row_cut : int(kSm90CutPlain);
}

// Position in the K/V stage ring; producer and consumers step through it in the same order,
// across all the tiles a CTA computes.
template <int S>
struct Sm90Ring {
  int st = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void Advance() {
    if (++st == S) {
      st = 0;
      phase ^= 1;
    }
  }
};

// The tile a Q buffer holds under the dynamic schedule, as the producer hands it to the consumers
// (written before the arrival that completes the buffer's "full" phase): its head and its view
// of the sequence, so that the consumers read no global memory (cu_seqlens) after the Q wait;
// head -1 once there are no tiles left.
struct Sm90TileSlot {
  int h;
  int m0, m_end, q_start, k_start, s_q, s_k, off, nb_min, nb_max;
  __device__ __forceinline__ void Put(const Sm90Tile& t, int head) {
    m0 = t.m0;
    m_end = t.m_end;
    q_start = t.q_start;
    k_start = t.k_start;
    s_q = t.s_q;
    s_k = t.s_k;
    off = t.off;
    nb_min = t.nb_min;
    nb_max = t.nb_max;
    h = head;
  }
  // Each value is lane 0's, so that the compiler knows it is the same across the warp (as with
  // the warpgroup index in FlashFwdSm90Kernel): read by every lane, ptxas wrapped the consumers'
  // products in reconvergence barriers (27 BSSY and 12 WARPSYNC more at d=64), and the kernel ran
  // 5-10% slower on the H200, causal or not.
  __device__ __forceinline__ int Get(Sm90Tile* t) const {
    auto lane0 = [](int v) { return __shfl_sync(0xffffffffu, v, 0); };
    t->m0 = lane0(m0);
    t->m_end = lane0(m_end);
    t->q_start = lane0(q_start);
    t->k_start = lane0(k_start);
    t->s_q = lane0(s_q);
    t->s_k = lane0(s_k);
    t->off = lane0(off);
    t->nb_min = lane0(nb_min);
    t->nb_max = lane0(nb_max);
    return lane0(h);
  }
};

static_assert(sizeof(Sm90TileSlot) <= Sm90TraitsBase<64, __half, 64, 2>::kTileSlotBytes, "tile slot");

// The CTA's mbarriers: Q full/empty per Q buffer (two), then per stage K full, V full, K empty
// and V empty; after them, per Q buffer, the dynamic schedule's tile (Sm90TileSlot).
template <int S>
struct Sm90Bars {
  uint64_t* base;
  // Plain shared-memory accesses: the mbarrier arrive and wait around them are compiler fences.
  __device__ __forceinline__ Sm90TileSlot* TileOfQ(int b) const {
    return reinterpret_cast<Sm90TileSlot*>(base + 4 + 4 * S) + b;
  }
  __device__ __forceinline__ uint64_t* FullQ(int b) const { return base + b; }
  __device__ __forceinline__ uint64_t* EmptyQ(int b) const { return base + 2 + b; }
  __device__ __forceinline__ uint64_t* FullK(int st) const { return base + 4 + st; }
  __device__ __forceinline__ uint64_t* FullV(int st) const { return base + 4 + S + st; }
  __device__ __forceinline__ uint64_t* EmptyK(int st) const { return base + 4 + 2 * S + st; }
  __device__ __forceinline__ uint64_t* EmptyV(int st) const { return base + 4 + 3 * S + st; }
  // One thread: "full" barriers take the producer's one arrival (plus transaction bytes),
  // "empty" ones an arrival of each consumer warp.
  __device__ __forceinline__ void Init(uint32_t consumer_warps) const {
    for (int i = 0; i < 2; ++i) {
      ptx::MbarInit(FullQ(i), 1);
      ptx::MbarInit(EmptyQ(i), consumer_warps);
    }
    for (int i = 0; i < S; ++i) {
      ptx::MbarInit(FullK(i), 1);
      ptx::MbarInit(FullV(i), 1);
      ptx::MbarInit(EmptyK(i), consumer_warps);
      ptx::MbarInit(EmptyV(i), consumer_warps);
    }
  }
};

// The producer warp's own state under paged K/V (Tr::kPaged; unused otherwise): its lane, the
// tail barrier (Sm90PagedTraits::kTailBarOff) and that barrier's next phase.
struct Sm90PagedLoad {
  uint64_t* tail_bar = nullptr;
  uint32_t tail_phase = 0;
  int lane = 0;
};

// Paged K/V: the pool row where chunk `lane` (P.kv_box_rows rows, all in one page) of key tile nb
// starts, for a chunk that holds keys of the sequence (0 for the others, which are not loaded).
template <typename Tr>
__device__ __forceinline__ int Sm90PagedChunkRow(const FlashParams& p, const Sm90Tile& t, int nb,
                                                 int rows, int lane) {
  const int j0 = nb * Tr::kBlockN + lane * rows;
  if (lane * rows >= Tr::kBlockN || j0 >= t.s_k) return 0;
  const int page = p.page_shift >= 0 ? j0 >> p.page_shift : j0 / p.page_size;
  return __ldg(p.page_indices + t.k_start + page) * p.page_size + (j0 - page * p.page_size);
}

// Producer, one tile, paged K/V: all 32 lanes of the producer warp. Lane 0 loads Q; for each key
// tile, lane c loads chunk c of K and of V (one TMA box of P.kv_box_rows rows per 64-column slab;
// the chunk's page number was read a tile ahead), for the chunks that hold keys of the sequence.
// The tile holding the sequence's last key ("tail") ends in rows past it: in its last loaded
// chunk, the unused rows of the last page, whose bytes are anything (NaN too); past that chunk,
// whatever the stage held. K's are masked (their scores are set to -inf), but V's would meet
// P = 0 in P V, and 0 * NaN is NaN. So in a tail tile V's chunk with the last key lands on the
// tail barrier, the warp waits for it, writes zeros over every row past the last key, and only
// then arrives on V's "full" barrier (whose transaction bytes are those of the other chunks).
// No box is issued wholly outside the sequence's keys.
template <typename Tr>
__device__ __forceinline__ void Sm90ProducePaged(const Sm90Params& P, const Sm90Tile& t, int h,
                                                 uint8_t* smem, const Sm90Bars<Tr::kStages>& bars,
                                                 Sm90Ring<Tr::kStages>& ring, const Sm90QSlot& q,
                                                 Sm90PagedLoad& pl) {
  constexpr int BN = Tr::kBlockN;
  const int hk = h / P.p.heads_per_kv;
  const int lane = pl.lane;
  const int rows = P.kv_box_rows;
  const uint32_t chunk_bytes = uint32_t(rows) * 128 * Tr::kSlabs;
  if (lane == 0) {
    ptx::MbarArriveExpectTx(bars.FullQ(q.buf), Tr::kQBytes);
    ptx::TmaLoad4d(smem + Tr::kQOff + q.buf * Tr::kQBytes, &P.tq, 0, t.q_start + t.m0, 0, h,
                   bars.FullQ(q.buf));
  }
  int row = Sm90PagedChunkRow<Tr>(P.p, t, t.nb_max - 1, rows, lane);
  for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
    const int st = ring.st;
    const int row_next = nb > t.nb_min ? Sm90PagedChunkRow<Tr>(P.p, t, nb - 1, rows, lane) : 0;
    const int keys = t.s_k - nb * BN;  // > 0: a visited tile holds keys
    const bool tail = keys < BN;
    const int chunks = tail ? (keys + rows - 1) / rows : BN / rows;  // chunks with keys
    const int last_part = tail && keys % rows != 0 ? chunks - 1 : -1;  // the chunk on the tail barrier
    const bool loads = lane < chunks;
    uint8_t* k_dst = smem + Tr::kKOff + st * Tr::kKVBytes + lane * rows * 128;
    uint8_t* v_tile = smem + Tr::kVOff + st * Tr::kKVBytes;
    ptx::MbarWait(bars.EmptyK(st), ring.phase ^ 1);
    if (lane == 0) ptx::MbarArriveExpectTx(bars.FullK(st), uint32_t(chunks) * chunk_bytes);
    __syncwarp();
    if (loads) {
#pragma unroll
      for (int k = 0; k < Tr::kSlabs; ++k) {
        ptx::TmaLoad4d(k_dst + k * BN * 128, &P.tk, 0, row, k, hk, bars.FullK(st));
      }
    }
    ptx::MbarWait(bars.EmptyV(st), ring.phase ^ 1);
    if (lane == 0) {
      if (!tail) {
        ptx::MbarArriveExpectTx(bars.FullV(st), Tr::kKVBytes);
      } else {
        ptx::MbarExpectTx(bars.FullV(st), uint32_t(chunks - (last_part >= 0)) * chunk_bytes);
        if (last_part >= 0) ptx::MbarArriveExpectTx(pl.tail_bar, chunk_bytes);
      }
    }
    __syncwarp();
    if (loads) {
      uint64_t* bar = lane == last_part ? pl.tail_bar : bars.FullV(st);
#pragma unroll
      for (int k = 0; k < Tr::kSlabs; ++k) {
        ptx::TmaLoad4d(v_tile + lane * rows * 128 + k * BN * 128, &P.tv, 0, row, k, hk, bar);
      }
    }
    if (tail) {
      if (last_part >= 0) {
        ptx::MbarWait(pl.tail_bar, pl.tail_phase);
        pl.tail_phase ^= 1;
      }
      // 16-byte pieces of the rows [keys, BN), every slab (a zero row needs no swizzle).
      const int pieces = (BN - keys) * Tr::kSlabs * 8;
      for (int i = lane; i < pieces; i += 32) {
        const int rs = i >> 3;
        *reinterpret_cast<uint4*>(v_tile + (rs % Tr::kSlabs) * BN * 128 +
                                  (keys + rs / Tr::kSlabs) * 128 + (i & 7) * 16) = make_uint4(0, 0, 0, 0);
      }
      ptx::FenceProxyAsyncShared();
      __syncwarp();
      if (lane == 0) ptx::MbarArrive(bars.FullV(st));
    }
    row = row_next;
    ring.Advance();
  }
}

// Producer, one tile: Q into buffer q (free: its "empty" phase waited for), then K and V of
// each key tile into the stage ring.
template <typename Tr>
__device__ __forceinline__ void Sm90Produce(const Sm90Params& P, const Sm90Tile& t, int h,
                                            uint8_t* smem, const Sm90Bars<Tr::kStages>& bars,
                                            Sm90Ring<Tr::kStages>& ring, const Sm90QSlot& q,
                                            Sm90PagedLoad& pl) {
  if constexpr (Tr::kPaged) {
    Sm90ProducePaged<Tr>(P, t, h, smem, bars, ring, q, pl);
    return;
  }
  const int hk = h / P.p.heads_per_kv;
  ptx::MbarArriveExpectTx(bars.FullQ(q.buf), Tr::kQBytes);
  ptx::TmaLoad4d(smem + Tr::kQOff + q.buf * Tr::kQBytes, &P.tq, 0, t.q_start + t.m0, 0, h,
                 bars.FullQ(q.buf));
  for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
    const int st = ring.st;
    const int row = t.k_start + nb * Tr::kBlockN;
    ptx::MbarWait(bars.EmptyK(st), ring.phase ^ 1);
    ptx::MbarArriveExpectTx(bars.FullK(st), Tr::kKVBytes);
    ptx::TmaLoad4d(smem + Tr::kKOff + st * Tr::kKVBytes, &P.tk, 0, row, 0, hk, bars.FullK(st));
    ptx::MbarWait(bars.EmptyV(st), ring.phase ^ 1);
    ptx::MbarArriveExpectTx(bars.FullV(st), Tr::kKVBytes);
    ptx::TmaLoad4d(smem + Tr::kVOff + st * Tr::kKVBytes, &P.tv, 0, row, 0, hk, bars.FullV(st));
    ring.Advance();
  }
}

// The key tiles [*lo, *hi] of tile t need no mask: each of their keys lies inside the sequence
// and inside the window of every row of the tile (the per-tile test of the consumers' mask,
// solved once per tile for the key tile's index; the FP8 kernel's kHoistedMask).
template <int BN>
__device__ __forceinline__ void Sm90PlainKeyTiles(const FlashParams& p, const Sm90Tile& t, int* lo, int* hi) {
  auto floor_div = [](int a) { return a >= 0 ? a / BN : -((-a + BN - 1) / BN); };
  *hi = t.s_k / BN - 1;  // n0 + BN <= s_k
  if (p.has_right) *hi = min(*hi, floor_div(t.m0 + t.off + p.right - BN + 1));
  *lo = p.has_left ? -floor_div(-(t.m_end - 1 + t.off - p.left)) : INT_MIN;  // n0 >= the left edge
}

// Sets to -inf the scores this thread holds that its rows may not see (key tile from n0).
// s[i] is row r0 + 8 * ((i >> 1) & 1), key n0 + 8 * (i >> 2) + 2 * (lane & 3) + (i & 1).
template <int BN>
__device__ __forceinline__ void Sm90Mask(float (&s)[BN / 2], const FlashParams& p, const Sm90Tile& t,
                                         int r0, int n0, int lane) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = r0 + 8 * hf;
    const int lo = p.has_left ? row + t.off - p.left : INT_MIN;
    const int hi = p.has_right ? min(t.s_k - 1, row + t.off + p.right) : t.s_k - 1;
#pragma unroll
    for (int c = 0; c < BN / 8; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = n0 + 8 * c + 2 * (lane & 3) + e;
        if (col < lo || col > hi) s[4 * c + 2 * hf + e] = -INFINITY;
      }
  }
}

// Whether group c of 8 keys takes its exp2 on the FMA pipe (Sm90Softmax's kFmaEvery).
template <int kFmaEvery>
__device__ __forceinline__ constexpr bool ExpOnFma(int c) {
  if constexpr (kFmaEvery > 0) {
    return c % kFmaEvery == kFmaEvery - 1;
  } else {
    return false;
  }
}

// Online softmax of one score tile (log2 domain, scale folded in): updates the row max and sum,
// leaves P = exp2(s * scale - max + kBias) in s (and the row sum of those) and the factor O must be
// rescaled by in corr (applied separately, once no product writing O is in flight). kBias (the
// FP8 kernel's, which rounds P to e4m3) scales P by 2^kBias; the normalisation takes it back.
// kFmaEvery > 0: every kFmaEvery-th group of 8 keys takes its exp2 on the FMA pipe (Exp2OnFma),
// which lightens the MUFU pipe the FP8 kernel's softmax is bound by. !kSum: row_sum is left alone
// (the FP8 kernel's kTcRowSum sums P on the tensor cores).
// kSlack8 > 0 (a lazy rescale): the warp's rows keep the max they are scaled to unless one of them
// grew past it by more than kSlack8 / 8 (log2 units), or the warp is `eager` (warp-uniform), so P
// stays below 2^(kBias + kSlack8 / 8) and O's rescale can be skipped. Returns whether the max moved
// (warp-uniform; always with kSlack8 = 0), i.e. whether corr differs from 1.
template <int BN, int kBias = 0, int kFmaEvery = 0, bool kSum = true, int kSlack8 = 0>
__device__ __forceinline__ bool Sm90Softmax(float (&s)[BN / 2], float (&row_max)[2], float (&row_sum)[2],
                                            float (&corr)[2], float sl2, bool eager = false) {
  auto tile_max = [&](int hf) {
    float mx = row_max[hf];
#pragma unroll
    for (int c = 0; c < BN / 8; ++c) mx = fmaxf(mx, fmaxf(s[4 * c + 2 * hf], s[4 * c + 2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  };
  // Row half hf's p scaled to max mx, its corr and its sum.
  auto exp_row = [&](int hf, float mx) {
    const float ms = mx == -INFINITY ? 0.0f : mx * sl2;
    corr[hf] = exp2f(row_max[hf] * sl2 - ms);
    row_max[hf] = mx;
    float sum = kSum ? row_sum[hf] * corr[hf] : 0.0f;
#pragma unroll
    for (int c = 0; c < BN / 8; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = kBias == 0 ? fmaf(s[4 * c + 2 * hf + e], sl2, -ms)
                                   : fmaf(s[4 * c + 2 * hf + e], sl2, float(kBias) - ms);
        const float pe = ExpOnFma<kFmaEvery>(c) ? Exp2OnFma<kBias == 0>(x) : exp2f(x);
        s[4 * c + 2 * hf + e] = pe;
        if constexpr (kSum) sum += pe;
      }
    if constexpr (kSum) row_sum[hf] = sum;
  };
  if constexpr (kSlack8 == 0) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) exp_row(hf, tile_max(hf));
    return true;
  } else {
    const float mx[2] = {tile_max(0), tile_max(1)};
    // (-inf - -inf is NaN, not above: a row that has seen no key keeps -inf.)
    constexpr float kSlack = float(kSlack8) / 8.0f;
    const bool grew = (mx[0] - row_max[0]) * sl2 > kSlack || (mx[1] - row_max[1]) * sl2 > kSlack;
    const bool moved = __any_sync(0xffffffffu, grew) || eager;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) exp_row(hf, moved ? mx[hf] : row_max[hf]);
    return moved;
  }
}

template <typename Tr>
__device__ __forceinline__ void Sm90Rescale(float (&o)[Tr::kPvChunks][Tr::kPvN / 2], const float (&corr)[2]) {
#pragma unroll
  for (int nc = 0; nc < Tr::kPvChunks; ++nc)
#pragma unroll
    for (int i = 0; i < Tr::kPvN / 2; ++i) o[nc][i] *= corr[(i >> 1) & 1];
}

// Normalises O, writes LSE and O rows r0 and r0 + 8 of this thread (those inside the sequence).
template <typename Tr>
__device__ __forceinline__ void Sm90Epilogue(const FlashParams& p, const Sm90Tile& t, int h, int r0,
                                             int lane, float (&o)[Tr::kPvChunks][Tr::kPvN / 2],
                                             const float (&row_max)[2], float (&row_sum)[2]) {
  using T = typename Tr::T;
  T* go = reinterpret_cast<T*>(p.o) + int64_t(t.q_start) * p.o_row_stride + h * Tr::kHeadDim;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = row_sum[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const bool any = sum > 0.0f;
    const float inv = any ? 1.0f / sum : 0.0f;
    const int row = r0 + 8 * hf;
    if (row >= t.s_q) continue;
    if (p.lse != nullptr && (lane & 3) == 0) {
      p.lse[int64_t(h) * p.total_q + t.q_start + row] = any ? row_max[hf] * p.scale + __logf(sum) : -INFINITY;
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

// A consumer warpgroup's Q buffer release that waits on its O store (TMA-store epilogue): the
// store reads O from the warpgroup's rows of that Q buffer, so the buffer is handed back to the
// producer only once the store has read them, which one thread checks once its next tile's Q has
// arrived, before that tile's key loop: the loop then holds no branch of one thread's (inside it,
// after the first S issue, it measured the same within noise on the H200 and needed a
// reconvergence barrier).
struct Sm90OStore {
  int pending_buf = -1;  // Q buffer still being read by this warpgroup's last O store
};

template <int S>
__device__ __forceinline__ void Sm90ReleaseStoredQ(Sm90OStore& ost, const Sm90Bars<S>& bars, int tid) {
  if (ost.pending_buf >= 0 && tid == 0) {
    ptx::BulkWaitRead();
    for (int w = 0; w < 4; ++w) ptx::MbarArrive(bars.EmptyQ(ost.pending_buf));  // for the 4 warps
  }
  ost.pending_buf = -1;
}

// Epilogue through shared memory, for a warpgroup whose 64 rows all lie inside the sequence: O is
// normalised and written in the 128-byte-swizzled layout (each warp store hits 32 distinct banks)
// over the warpgroup's own rows of the Q buffer (its last S has completed), then one thread
// issues one TMA store per 64-column slab, so the warpgroup moves on without waiting for O's
// global writes.
template <typename Tr>
__device__ __forceinline__ void Sm90EpilogueTma(const Sm90Params& P, const Sm90Tile& t, int h, int cw,
                                                int tid, uint8_t* qrows,
                                                float (&o)[Tr::kPvChunks][Tr::kPvN / 2],
                                                const float (&row_max)[2], float (&row_sum)[2]) {
  using T = typename Tr::T;
  const FlashParams& p = P.p;
  const int lane = tid % 32;
  const int rl0 = 16 * (tid / 32) + lane / 4;  // row within the warpgroup's 64
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = row_sum[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const bool any = sum > 0.0f;
    const float inv = any ? 1.0f / sum : 0.0f;
    const int rl = rl0 + 8 * hf;
    if (p.lse != nullptr && (lane & 3) == 0) {
      p.lse[int64_t(h) * p.total_q + t.q_start + t.m0 + 64 * cw + rl] =
          any ? row_max[hf] * p.scale + __logf(sum) : -INFINITY;
    }
    uint8_t* row = qrows + rl * 128 + 4 * (lane & 3);
#pragma unroll
    for (int nc = 0; nc < Tr::kPvChunks; ++nc)
#pragma unroll
      for (int c = 0; c < Tr::kPvN / 8; ++c) {
        const int col8 = nc * (Tr::kPvN / 8) + c;  // 8-column chunk of the row
        const int slab = col8 / 8;
        *reinterpret_cast<uint32_t*>(row + slab * Tr::kBlockM * 128 + (((col8 % 8) ^ (rl & 7)) << 4)) =
            ptx::Pack2<T>(o[nc][4 * c + 2 * hf] * inv, o[nc][4 * c + 2 * hf + 1] * inv);
      }
  }
  ptx::FenceProxyAsyncShared();
  ptx::NamedBarSync(1 + cw, 128);  // one named barrier per consumer warpgroup
  if (tid == 0) {
#pragma unroll
    for (int k = 0; k < Tr::kSlabs; ++k) {
      ptx::TmaStore4d(&P.to, qrows + k * Tr::kBlockM * 128, 0, t.q_start + t.m0 + 64 * cw, k, h);
    }
    ptx::BulkCommit();
  }
}

// The products of one consumer warpgroup: rows sq.. of Q against the stage ring.
template <typename Tr>
struct Sm90Mma {
  using T = typename Tr::T;
  static constexpr int D = Tr::kHeadDim;
  static constexpr int BN = Tr::kBlockN;
  uint32_t sq, sk, sv;  // shared addresses: this warpgroup's Q rows, K stage 0, V stage 0

  // Issues S = Q K^T over D / 16 steps of 16 columns (4 per 128-byte slab row) and commits: for
  // the first kKeys keys of the stage's tile (all BN, or the first half, Tr::kTrimEdgeTiles).
  template <int kKeys = BN>
  __device__ __forceinline__ void IssueS(float (&s)[kKeys / 2], int st) const {
    ptx::WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t kofs = (ks % 4) * 32;  // 16 columns = 32 bytes inside the swizzled row
      const uint64_t da = ptx::SmemDesc(sq + (ks / 4) * Tr::kBlockM * 128 + kofs, 16);
      const uint64_t db = ptx::SmemDesc(sk + st * Tr::kKVBytes + (ks / 4) * BN * 128 + kofs, 16);
      ptx::WgmmaSS<T, kKeys>(s, da, db, ks > 0);
    }
    ptx::WgmmaCommit();
  }

  // Issues O += P V over the first kKeys keys of the stage's tile, 16 keys per step, and commits.
  template <int kKeys = BN>
  __device__ __forceinline__ void IssuePV(float (&o)[Tr::kPvChunks][Tr::kPvN / 2],
                                          const uint32_t (&pa)[kKeys / 16][4], int st) const {
    ptx::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
#pragma unroll
      for (int nc = 0; nc < Tr::kPvChunks; ++nc) {
        const uint32_t addr = sv + st * Tr::kKVBytes + nc * (Tr::kPvN / 64) * BN * 128 + kk * 2048;
        ptx::WgmmaRS<T, Tr::kPvN>(o[nc], pa[kk], ptx::SmemDesc(addr, BN * 128));
      }
    ptx::WgmmaCommit();
  }
};

// P packed to T as the A fragments of P V (the S accumulator layout is the A-fragment layout).
template <typename T, int BN>
__device__ __forceinline__ void Sm90PackP(uint32_t (&pa)[BN / 16][4], const float (&s)[BN / 2]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) pa[kk][e] = ptx::Pack2<T>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}

// Waits for the ring's current stage to be loaded and gives its K and V back unread (so that the
// arrivals count for this use of the stage), then moves the ring on: a key tile a consumer warp
// skips.
template <typename Tr>
__device__ __forceinline__ void Sm90PassStage(const Sm90Bars<Tr::kStages>& bars,
                                              Sm90Ring<Tr::kStages>& ring, bool lane0) {
  const int st = ring.st;
  ptx::MbarWait(bars.FullK(st), ring.phase);
  ptx::MbarWait(bars.FullV(st), ring.phase);
  if (lane0) {
    ptx::MbarArrive(bars.EmptyK(st));
    ptx::MbarArrive(bars.EmptyV(st));
  }
  ring.Advance();
}

// Consumer warpgroup `cw` (0-based): rows m0 + 64 * cw .. + 63 of the CTA. Two key loops:
//  - the plain one waits for every product at once; the warpgroups' interleaving keeps the tensor
//    cores busy during each one's softmax;
//  - Tr::kOverlap (d=256's 80-key tiling) issues S of the next key tile with P V of this one and
//    runs the softmax under that P V: 3-7% faster at d=256 on the H200; at d=128 its two
//    warpgroups are 8% slower than the plain loop's three, which have no registers for it
//    (docs/PERF.md).
template <typename Tr>
__device__ __forceinline__ void Sm90Consume(const Sm90Params& P, const Sm90Tile& t, int h, int cw,
                                            uint8_t* smem, const Sm90Bars<Tr::kStages>& bars,
                                            Sm90Ring<Tr::kStages>& ring, uint32_t q_loads,
                                            Sm90OStore& ost, bool q_ready) {
  using T = typename Tr::T;
  constexpr int BN = Tr::kBlockN;
  static_assert(!Tr::kTrimEdgeTiles || BN == 128, "half-width key tiles are m64n64 products");
  const FlashParams& p = P.p;
  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const int r0 = t.m0 + 64 * cw + 16 * (tid / 32) + lane / 4;  // this thread's first row
  const Sm90QSlot q(q_loads, Tr::kQBufs);
  const Sm90Mma<Tr> mma{ptx::SmemAddr(smem + Tr::kQOff + q.buf * Tr::kQBytes) + cw * 64 * 128,
                        ptx::SmemAddr(smem + Tr::kKOff), ptx::SmemAddr(smem + Tr::kVOff)};
  const int m_last = t.m_end - 1;
  // s: the scores of the tile's first 2 * extent(s) keys (all BN, or half of them). (The FP8
  // kernel's per-tile bounds, Sm90PlainKeyTiles, measured slower here: docs/PERF.md.)
  auto mask = [&](auto& s, int nb) {
    constexpr int kKeys = 2 * int(std::extent_v<std::remove_reference_t<decltype(s)>>);
    const int n0 = nb * BN;
    const bool need = (n0 + BN > t.s_k) || (p.has_right && n0 + BN - 1 > t.m0 + t.off + p.right) ||
                      (p.has_left && n0 < m_last + t.off - p.left);
    if (need) Sm90Mask<kKeys>(s, p, t, r0, n0, lane);
  };
  // TMA-store epilogue for warpgroups whose rows all lie in the sequence (others store directly).
  const bool tma_o = P.tma_o && t.m0 + 64 * cw + 64 <= t.s_q && t.nb_max > t.nb_min;
  // Once the last S of the tile is complete, Q may be overwritten by the next tile's (with the
  // TMA-store epilogue, once the O store has read the rows it reuses).
  auto release_q = [&] {
    if (!tma_o && lane == 0) ptx::MbarArrive(bars.EmptyQ(q.buf));
  };
  // A stage's K (once the S reading it is complete) and V (once the P V is) go back to the
  // producer.
  auto release = [&](uint64_t* bar) {
    if (lane == 0) ptx::MbarArrive(bar);
  };
  if (t.nb_max == t.nb_min) {
    Sm90ReleaseStoredQ(ost, bars, tid);
    // q_ready (the dynamic schedule): a tile without key tiles has its Q buffer too, unloaded.
    if (q_ready && lane == 0) ptx::MbarArrive(bars.EmptyQ(q.buf));
  }

  float o[Tr::kPvChunks][Tr::kPvN / 2];
#pragma unroll
  for (int nc = 0; nc < Tr::kPvChunks; ++nc)
#pragma unroll
    for (int i = 0; i < Tr::kPvN / 2; ++i) o[nc][i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float corr[2];
  float s[BN / 2];
  uint32_t pa[BN / 16][4];
  float s_half[BN / 4];  // Tr::kTrimEdgeTiles: a half-width key tile's
  uint32_t pa_half[BN / 32][4];

  if (t.nb_max > t.nb_min) {  // else no key tile: Q is not loaded, O = 0 and LSE = -inf
    if (!q_ready) ptx::MbarWait(bars.FullQ(q.buf), q.phase);
    Sm90ReleaseStoredQ(ost, bars, tid);  // the store had the Q wait to read its rows
    if constexpr (Tr::kOverlap) {
      // S of the next key tile is issued before P V of this one, and its softmax runs while that
      // P V is on the tensor cores; O is rescaled once the P V is complete. Each tile's V is
      // waited for right after its softmax, before the wait for the previous P V: the mbarrier
      // poll loop ends a basic block, and ptxas hoists a wgmma wait to the top of its block (with
      // the two waits in one block it ran the whole softmax after the P V wait).
      bool moved = true;  // whether O needs corr (Tr::kRescaleSlack8)
      auto softmax = [&](int nb) {
        if (nb == t.nb_min) release_q();
        mask(s, nb);
        moved = Sm90Softmax<BN, 0, Tr::kExpFmaEvery, true, Tr::kRescaleSlack8>(s, row_max, row_sum, corr,
                                                                               p.scale_log2);
      };
      int st = ring.st;
      int nb = t.nb_max - 1;
      ptx::MbarWait(bars.FullK(st), ring.phase);
      mma.IssueS(s, st);
      ptx::WgmmaWait<0>();
      ptx::RegFence(s);
      release(bars.EmptyK(st));
      softmax(nb);
      Sm90PackP<T, BN>(pa, s);
      ptx::MbarWait(bars.FullV(st), ring.phase);
      for (;;) {
        const int st_prev = st;
        ring.Advance();
        if (--nb < t.nb_min) {
          mma.IssuePV(o, pa, st_prev);
          ptx::WgmmaWait<0>();
#pragma unroll
          for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
          release(bars.EmptyV(st_prev));
          break;
        }
        st = ring.st;
        ptx::MbarWait(bars.FullK(st), ring.phase);
        mma.IssueS(s, st);
        mma.IssuePV(o, pa, st_prev);
          ptx::WgmmaWait<1>();  // S complete; P V may still run
        ptx::RegFence(s);
        release(bars.EmptyK(st));
        softmax(nb);
        ptx::MbarWait(bars.FullV(st), ring.phase);
        ptx::WgmmaWait<0>();
#pragma unroll
        for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
        release(bars.EmptyV(st_prev));
        if (moved) Sm90Rescale<Tr>(o, corr);
        Sm90PackP<T, BN>(pa, s);
      }
    } else {
      // Tr::kTrimEdgeTiles: the key tiles none of this warpgroup's rows may see (beyond their
      // causal or window edge) lie at either end of the CTA's range; the warpgroup computes only
      // [wnb_min, wnb_max), and the highest of them only in its first half when its rows see no
      // key beyond (the causal diagonal where it crosses the middle of a key tile, a sequence
      // ending in the first half of its last tile). For each skipped tile it waits for the stage
      // to be loaded (so that its release counts for this use of the stage) and gives it back;
      // the softmax state is what the all-masked tile leaves. A warpgroup whose rows all lie past
      // the sequence end computes every tile all the same: left alone, one warpgroup's S, softmax
      // and P V run one after the other with nothing to fill the tensor cores between them
      // (H200, d=64/128 s=1k: 2-5% slower than computing the rows that are never stored).
      int wnb_min = t.nb_min, wnb_max = t.nb_max;
      bool half_top = false;  // tile wnb_max - 1 in its first half only
      if constexpr (Tr::kTrimEdgeTiles) {
        const int wg_first = t.m0 + 64 * cw;
        const int wg_last = min(wg_first + 63, t.m_end - 1);
        if (wg_last >= wg_first) {
          const int vis_hi = p.has_right ? min(t.s_k - 1, wg_last + t.off + p.right) : t.s_k - 1;
          wnb_max = min(wnb_max, (vis_hi + 1 + BN - 1) / BN);
          if (p.has_left) wnb_min = max(wnb_min, max(0, wg_first + t.off - p.left) / BN);
          wnb_max = max(wnb_max, wnb_min);
          half_top = wnb_max > wnb_min && vis_hi < (wnb_max - 1) * BN + BN / 2;
        }
      }
      auto idle = [&](int nb) {
        Sm90PassStage<Tr>(bars, ring, lane == 0);
        if (nb == t.nb_min) release_q();
      };
      // One key tile; `masked` (a std::bool_constant) compiles the mask in or out. s and pa hold
      // the scores and P of the keys computed: all the tile's (BN) or its first half.
      auto step = [&](int nb, auto masked, auto& s, auto& pa) {
        constexpr int kKeys = 2 * int(std::extent_v<std::remove_reference_t<decltype(s)>>);
        const int st = ring.st;
        ptx::MbarWait(bars.FullK(st), ring.phase);
        mma.template IssueS<kKeys>(s, st);
        ptx::WgmmaWait<0>();
        ptx::RegFence(s);
        if (nb == t.nb_min) release_q();
        if constexpr (decltype(masked)::value) {
          mask(s, nb);
        }
        if (Sm90Softmax<kKeys, 0, Tr::kExpFmaEvery, true, Tr::kRescaleSlack8>(s, row_max, row_sum, corr,
                                                                              p.scale_log2)) {
          Sm90Rescale<Tr>(o, corr);
        }
        Sm90PackP<T, kKeys>(pa, s);
        ptx::MbarWait(bars.FullV(st), ring.phase);
        mma.template IssuePV<kKeys>(o, pa, st);
        ptx::WgmmaWait<0>();
#pragma unroll
        for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
        release(bars.EmptyK(st));
        release(bars.EmptyV(st));
        ring.Advance();
      };
      for (int nb = t.nb_max - 1; nb >= wnb_max; --nb) idle(nb);
      int nb_top = wnb_max - 1;  // the first key tile the loops below compute
      if constexpr (Tr::kTrimEdgeTiles) {
        if (half_top) step(nb_top--, std::true_type{}, s_half, pa_half);
      }
      if constexpr (Tr::kSplitMaskLoop) {
        // The tiles that need a mask (the sequence end and the causal diagonal: the highest; a
        // left window's edge: the lowest) run a copy of the step with it, the rest one without:
        // the mask's registers then stay out of the loop that does most of the work.
        auto need_mask = [&](int nb) {
          const int n0 = nb * BN;
          return (n0 + BN > t.s_k) || (p.has_right && n0 + BN - 1 > t.m0 + t.off + p.right) ||
                 (p.has_left && n0 < m_last + t.off - p.left);
        };
        int nb = nb_top;
        while (nb >= wnb_min) {
          if (need_mask(nb)) {
            step(nb--, std::true_type{}, s, pa);
          } else {
            for (; nb >= wnb_min && !need_mask(nb); --nb) step(nb, std::false_type{}, s, pa);
          }
        }
      } else {
        for (int nb = nb_top; nb >= wnb_min; --nb) step(nb, std::true_type{}, s, pa);
      }
      for (int nb = wnb_min - 1; nb >= t.nb_min; --nb) idle(nb);
    }
  }
  if (tma_o) {
    Sm90EpilogueTma<Tr>(P, t, h, cw, tid, smem + Tr::kQOff + q.buf * Tr::kQBytes + cw * 64 * 128, o,
                        row_max, row_sum);
    ost.pending_buf = q.buf;
    // One Q buffer: the producer needs it back before this warpgroup's next tile can start.
    if (Tr::kQBufs == 1) Sm90ReleaseStoredQ(ost, bars, tid);
  } else {
    Sm90Epilogue<Tr>(p, t, h, r0, lane, o, row_max, row_sum);
  }
}

// A consumer warpgroup with no rows in its tile (under a narrow tail or short head, Sm90RowBlock)
// sits it out: it gives each stage back once it is loaded (so that its arrivals count for this
// use of the stage) and the Q buffer with the last, and stores nothing (its rows past m_end may be
// the next tile's). Kept out of Sm90Consume, whose code then stays that of every other tile.
// (Under the plain cut, a warpgroup whose rows lie past the sequence end computes them, never
// stored.)
template <typename Tr>
__device__ __forceinline__ void Sm90SitOut(const Sm90Tile& t, const Sm90Bars<Tr::kStages>& bars,
                                           Sm90Ring<Tr::kStages>& ring, uint32_t q_loads,
                                           Sm90OStore& ost, bool q_ready) {
  const int tid = threadIdx.x % 128;
  const bool lane0 = tid % 32 == 0;
  const Sm90QSlot q(q_loads, Tr::kQBufs);
  if (t.nb_max > t.nb_min && !q_ready) ptx::MbarWait(bars.FullQ(q.buf), q.phase);
  Sm90ReleaseStoredQ(ost, bars, tid);
  // A tile without key tiles has its Q buffer only under the dynamic schedule (q_ready).
  if (t.nb_max == t.nb_min && q_ready && lane0) ptx::MbarArrive(bars.EmptyQ(q.buf));
  for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
    Sm90PassStage<Tr>(bars, ring, lane0);
    if (nb == t.nb_min && lane0) ptx::MbarArrive(bars.EmptyQ(q.buf));
  }
}

// The producer under the dynamic schedule (P.tile_counter): the CTA's first tile is its index,
// each next one the counter's next value past the grid, claimed once every load of the tile before
// is issued (its consumers then have the last kStages key tiles of it left, time enough for the
// atomic and the next Q load). Claimed at the start of the tile before instead, each CTA holds one
// tile ahead: the first 2G tiles are then paired at random, not longest with shortest (H200: 2-4%
// slower at causal 1k-4k with L2 groups, level without). Each tile with rows gets a Q buffer and
// its description there (Sm90TileSlot), loaded or not (no key tile); the buffer after the last
// tile gets head -1.
// Paged K/V (Tr::kPaged): the whole producer warp runs this, lane 0 taking the counter's values and
// writing the tile descriptions.
template <typename Tr>
__device__ __forceinline__ void Sm90ProduceDynamic(const Sm90Params& P, const Sm90Schedule& sched,
                                                   uint8_t* smem, const Sm90Bars<Tr::kStages>& bars,
                                                   Sm90Ring<Tr::kStages>& ring, Sm90PagedLoad& pl) {
  // The counter's next value past the grid.
  auto next = [&]() -> int {
    if constexpr (Tr::kPaged) {
      unsigned int v = 0;
      if (pl.lane == 0) v = atomicAdd(P.tile_counter, 1u);
      return int(gridDim.x) + int(__shfl_sync(0xffffffffu, v, 0));
    } else {
      return int(gridDim.x) + int(atomicAdd(P.tile_counter, 1u));
    }
  };
  const bool leader = !Tr::kPaged || pl.lane == 0;
  int j = int(blockIdx.x);
  for (uint32_t n = 0;;) {
    Sm90Tile t;
    int h = -1;
    if (j < sched.Total()) {
      int m_block, b;
      sched.Decode(j, &m_block, &h, &b);
      if (!MakeSm90Tile<Tr::kBlockM, Tr::kBlockN, Tr::kPaged>(P.p, m_block, b, Sm90CutOf<Tr>(P), &t)) {
        j = next();
        continue;
      }
    }
    const Sm90QSlot q(n++, Tr::kQBufs);
    ptx::MbarWait(bars.EmptyQ(q.buf), q.phase ^ 1);
    if (leader) bars.TileOfQ(q.buf)->Put(t, h);
    if (h < 0) {
      if (leader) ptx::MbarArrive(bars.FullQ(q.buf));
      return;
    }
    if (t.nb_max > t.nb_min) {
      Sm90Produce<Tr>(P, t, h, smem, bars, ring, q, pl);
    } else if (leader) {
      ptx::MbarArrive(bars.FullQ(q.buf));
    }
    j = next();
  }
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 1) FlashFwdSm90Kernel(const __grid_constant__ Sm90Params P) {
  // The final tiling's register split (a derived traits type may change it) within the launch
  // allocation (Sm90TraitsBase::kLaunchRegs): else the consumers' setmaxnreg.inc never returns.
  static_assert(128 * (Tr::kProducerRegs + Tr::kConsumerWGs * Tr::kConsumerRegs) <=
                    Tr::kThreads * Tr::kLaunchRegs,
                "register split above the launch allocation");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int S = Tr::kStages;
  const Sm90Bars<S> bars{reinterpret_cast<uint64_t*>(smem + Tr::kBarOff)};
  constexpr uint32_t kConsumerWarps = Tr::kConsumerWGs * 4;  // each arrives once per release

  if (threadIdx.x == 0) {
    bars.Init(kConsumerWarps);
    if constexpr (Tr::kPaged) ptx::MbarInit(reinterpret_cast<uint64_t*>(smem + Tr::kTailBarOff), 1);
    ptx::FenceMbarInit();
  }
  __syncthreads();

  // Each role loops over the tiles in its own branch (setmaxnreg needs one branch per role).
  // The fixed order never runs in phases (Sm90PhasedOrder): with `false` here the compiler drops
  // the phases' walk from the consumers, whose code is then the same as before phases existed.
  const Sm90Schedule sched{(P.p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, P.p.num_heads,
                           P.p.batch, P.p.has_right, P.hb_group, false};
  constexpr bool kDynamic = Tr::kDynamicSchedule;
  // Tilings without kDynamic: each role walks the fixed schedule's tiles with rows.
  auto for_each_tile = [&](auto&& fn) {
    uint32_t q_loads = 0;  // Q tiles loaded so far (tiles with at least one key tile)
    for (int r = 0; r * int(gridDim.x) < sched.Total(); ++r) {
      const int j = sched.Tile(r, int(blockIdx.x), int(gridDim.x));
      if (j >= sched.Total()) continue;
      int m_block, h, b;
      sched.Decode(j, &m_block, &h, &b);
      Sm90Tile t;
      if (!MakeSm90Tile<Tr::kBlockM, Tr::kBlockN, Tr::kPaged>(P.p, m_block, b, Sm90CutOf<Tr>(P),
                                                              &t)) {
        continue;
      }
      fn(t, h, q_loads);
      q_loads += t.nb_max > t.nb_min;
    }
  };
  // Tilings with kDynamic, on a launch without the counter: the fixed schedule's next
  // tile with rows after round r, and r past it; false when there is none. (for_each_tile's
  // snake walk could be built on it, but that changes a fifth of the kernel's SASS at d=64/128,
  // whose speed was measured in this form.)
  auto fixed_next = [&](int& r, Sm90Tile& t, int& h) {
    while (r * int(gridDim.x) < sched.Total()) {
      const int j = sched.Tile(r++, int(blockIdx.x), int(gridDim.x));
      if (j >= sched.Total()) continue;
      int m_block, b;
      sched.Decode(j, &m_block, &h, &b);
      if (MakeSm90Tile<Tr::kBlockM, Tr::kBlockN, Tr::kPaged>(P.p, m_block, b, Sm90CutOf<Tr>(P), &t)) {
        return true;
      }
    }
    return false;
  };
  Sm90Ring<S> ring;
  // The warpgroup index, read from lane 0 so that the compiler knows it is the same across each
  // warp: a branch on it (the consumers' per-warpgroup epilogue choice) then needs no
  // reconvergence. With threadIdx.x / 128 alone, ptxas wrapped the key loop's products and softmax
  // in BSSY/BSYNC + WARPSYNC: 5% slower (median, s >= 1k) at d=64 on the H200.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (wg == 0) {
    ptx::SetMaxNRegDec<Tr::kProducerRegs>();
    // One thread issues every load; paged K/V: the whole first warp (Sm90ProducePaged).
    if (Tr::kPaged ? threadIdx.x < 32 : threadIdx.x == 0) {
      Sm90PagedLoad pl;
      if constexpr (Tr::kPaged) {
        pl.tail_bar = reinterpret_cast<uint64_t*>(smem + Tr::kTailBarOff);
        pl.lane = int(threadIdx.x);
      }
      auto produce = [&](const Sm90Tile& t, int h, uint32_t q_loads) {
        if (t.nb_max == t.nb_min) return;
        const Sm90QSlot q(q_loads, Tr::kQBufs);
        ptx::MbarWait(bars.EmptyQ(q.buf), q.phase ^ 1);  // a fresh barrier passes parity 1 at once
        Sm90Produce<Tr>(P, t, h, smem, bars, ring, q, pl);
      };
      if constexpr (kDynamic) {
        if (P.tile_counter != nullptr) {
          Sm90Schedule counted = sched;
          counted.phased = P.l2_phases != 0;
          Sm90ProduceDynamic<Tr>(P, counted, smem, bars, ring, pl);
        } else {
          Sm90Tile t;
          int r = 0, h = 0;
          uint32_t q_loads = 0;
          while (fixed_next(r, t, h)) {
            produce(t, h, q_loads);
            q_loads += t.nb_max > t.nb_min;
          }
        }
      } else {
        for_each_tile(produce);
      }
    }
  } else {
    ptx::SetMaxNRegInc<Tr::kConsumerRegs>();
    Sm90OStore ost;
    auto sits_out = [&](const Sm90Tile& t) {
      return Sm90CutOf<Tr>(P) != kSm90CutPlain && t.m0 + 64 * (wg - 1) >= t.m_end;
    };
    if constexpr (kDynamic) {
      // Q buffers used so far: the fixed schedule uses one per tile with key tiles; the dynamic
      // one, one per tile with rows (its description comes with it, Sm90ProduceDynamic).
      uint32_t q_loads = 0;
      int r = 0;
      for (;;) {  // one call site of Sm90Consume: its registers are allocated once
        Sm90Tile t;
        int h = 0;
        const bool dynamic = P.tile_counter != nullptr;
        if (dynamic) {
          const Sm90QSlot q(q_loads, Tr::kQBufs);
          ptx::MbarWait(bars.FullQ(q.buf), q.phase);
          h = bars.TileOfQ(q.buf)->Get(&t);
          if (h < 0) break;
        } else if (!fixed_next(r, t, h)) {
          break;
        }
        if (sits_out(t)) {
          Sm90SitOut<Tr>(t, bars, ring, q_loads, ost, dynamic);
        } else {
          Sm90Consume<Tr>(P, t, h, wg - 1, smem, bars, ring, q_loads, ost, dynamic);
        }
        q_loads += dynamic || t.nb_max > t.nb_min;
      }
    } else {
      for_each_tile([&](const Sm90Tile& t, int h, uint32_t q_loads) {
        if (sits_out(t)) {
          Sm90SitOut<Tr>(t, bars, ring, q_loads, ost, false);
        } else {
          Sm90Consume<Tr>(P, t, h, wg - 1, smem, bars, ring, q_loads, ost, false);
        }
      });
    }
    Sm90ReleaseStoredQ(ost, bars, threadIdx.x % 128);
    if (P.tma_o && threadIdx.x % 128 == 0) ptx::BulkWait();  // O written before the CTA exits
  }
#endif
}

}  // namespace attn::kernels::cuda
