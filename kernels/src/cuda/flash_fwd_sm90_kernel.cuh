// FlashAttention forward for sm_90a (device code): wgmma products, TMA loads, warp specialisation.
//
// One CTA = kBlockM query rows of one (sequence, head), three warpgroups:
//  - warpgroup 0, the producer, gives registers back (setmaxnreg.dec); one of its threads loads
//    the Q tile, then K and V tiles into a ring of kStages stages with TMA. Each stage has a
//    "full" mbarrier for K and one for V (the TMA's transaction bytes complete them) and an
//    "empty" mbarrier the consumer warps arrive on once they are done with the stage.
//  - warpgroups 1 and 2, the consumers, take the registers (setmaxnreg.inc) and own 64 query rows
//    each: S = Q K^T (wgmma, both operands in shared memory), masking and the online softmax in
//    registers, then O += P V with P in registers (the accumulator layout of S is the A-fragment
//    layout) and V read MN-major, with no transpose.
// Key tiles run from the last to the first, so the only masked tiles (the sequence tail and the
// causal/window edges) come first, and tiles no row of the CTA can see are never loaded. Varlen
// batches use one tensor map over the packed rows: a tile may run into the next sequence's rows
// (masked for K/V, never stored for Q) or past the tensor's end (zero-filled by the TMA).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

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
};

// The CTA's view of its work: sequence bounds, the key tiles it visits and its mask offsets.
struct Sm90Tile {
  int m0 = 0;        // first query row of the CTA within its sequence
  int q_start = 0;   // packed row of the sequence's first query
  int k_start = 0;   // packed row of its first key
  int s_q = 0;
  int s_k = 0;
  int off = 0;       // s_k - s_q: query i sits at key position i + off
  int nb_min = 0;    // key tiles [nb_min, nb_max), visited downwards
  int nb_max = 0;
};

template <int BM, int BN>
__device__ __forceinline__ bool MakeSm90Tile(const FlashParams& p, int m_block, int b, Sm90Tile* t) {
  t->q_start = p.cu_seqlens_q[b];
  t->s_q = p.cu_seqlens_q[b + 1] - t->q_start;
  t->m0 = m_block * BM;
  if (t->m0 >= t->s_q) return false;
  t->k_start = p.cu_seqlens_k[b];
  t->s_k = p.cu_seqlens_k[b + 1] - t->k_start;
  t->off = t->s_k - t->s_q;
  const int m_last = min(t->m0 + BM, t->s_q) - 1;
  int n_lo = 0;
  int n_hi = t->s_k;
  if (p.has_left) n_lo = max(0, t->m0 + t->off - p.left);
  if (p.has_right) n_hi = min(t->s_k, m_last + t->off + p.right + 1);
  t->nb_min = n_lo / BN;
  t->nb_max = n_hi > n_lo ? (n_hi + BN - 1) / BN : t->nb_min;
  return true;
}

// Producer: Q once, then K and V of each key tile into the stage ring.
template <typename Tr>
__device__ __forceinline__ void Sm90Produce(const Sm90Params& P, const Sm90Tile& t, int h,
                                            uint8_t* smem, uint64_t* bars) {
  constexpr int S = Tr::kStages;
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;
  uint64_t* full_v = bars + 1 + S;
  uint64_t* empty = bars + 1 + 2 * S;
  const int hk = h / P.p.heads_per_kv;
  ptx::MbarArriveExpectTx(full_q, Tr::kQBytes);
  ptx::TmaLoad4d(smem + Tr::kQOff, &P.tq, 0, t.q_start + t.m0, 0, h, full_q);
  int st = 0;
  uint32_t phase = 0;
  for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
    ptx::MbarWait(&empty[st], phase ^ 1);  // a fresh barrier passes parity 1 at once
    const int row = t.k_start + nb * Tr::kBlockN;
    ptx::MbarArriveExpectTx(&full_k[st], Tr::kKVBytes);
    ptx::TmaLoad4d(smem + Tr::kKOff + st * Tr::kKVBytes, &P.tk, 0, row, 0, hk, &full_k[st]);
    ptx::MbarArriveExpectTx(&full_v[st], Tr::kKVBytes);
    ptx::TmaLoad4d(smem + Tr::kVOff + st * Tr::kKVBytes, &P.tv, 0, row, 0, hk, &full_v[st]);
    if (++st == S) {
      st = 0;
      phase ^= 1;
    }
  }
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

// Online softmax of one score tile (log2 domain, scale folded in): updates the row max and sum,
// leaves P = exp2(s * scale - max) in s and the factor O must be rescaled by in corr (applied
// separately, once no product writing O is in flight).
template <int BN>
__device__ __forceinline__ void Sm90Softmax(float (&s)[BN / 2], float (&row_max)[2], float (&row_sum)[2],
                                            float (&corr)[2], float sl2) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float mx = row_max[hf];
#pragma unroll
    for (int c = 0; c < BN / 8; ++c) mx = fmaxf(mx, fmaxf(s[4 * c + 2 * hf], s[4 * c + 2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float ms = mx == -INFINITY ? 0.0f : mx * sl2;
    corr[hf] = exp2f(row_max[hf] * sl2 - ms);
    row_max[hf] = mx;
    float sum = row_sum[hf] * corr[hf];
#pragma unroll
    for (int c = 0; c < BN / 8; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2f(fmaf(s[4 * c + 2 * hf + e], sl2, -ms));
        s[4 * c + 2 * hf + e] = pe;
        sum += pe;
      }
    row_sum[hf] = sum;
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

// The products of one consumer warpgroup: rows sq.. of Q against the stage ring.
template <typename Tr>
struct Sm90Mma {
  using T = typename Tr::T;
  static constexpr int D = Tr::kHeadDim;
  static constexpr int BN = Tr::kBlockN;
  uint32_t sq, sk, sv;  // shared addresses: this warpgroup's Q rows, K stage 0, V stage 0

  // Issues S = Q K^T over D / 16 steps of 16 columns (4 per 128-byte slab row) and commits.
  __device__ __forceinline__ void IssueS(float (&s)[BN / 2], int st) const {
    ptx::WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t kofs = (ks % 4) * 32;  // 16 columns = 32 bytes inside the swizzled row
      const uint64_t da = ptx::SmemDesc(sq + (ks / 4) * Tr::kBlockM * 128 + kofs, 16);
      const uint64_t db = ptx::SmemDesc(sk + st * Tr::kKVBytes + (ks / 4) * BN * 128 + kofs, 16);
      ptx::WgmmaSS<T, BN>(s, da, db, ks > 0);
    }
    ptx::WgmmaCommit();
  }

  // Issues O += P V, 16 keys per step, and commits.
  __device__ __forceinline__ void IssuePV(float (&o)[Tr::kPvChunks][Tr::kPvN / 2],
                                          const uint32_t (&pa)[BN / 16][4], int st) const {
    ptx::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
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

// Consumer warpgroup `cw` (0-based): rows m0 + 64 * cw .. + 63 of the CTA.
// kOverlap: S of tile j is issued before P V of tile j+1 (the previous one in visiting order), so
// the tensor cores compute that product while this warpgroup runs the softmax of tile j; O is
// rescaled only once that product has completed. Otherwise every product is waited for at once.
template <typename Tr, bool kOverlap>
__device__ __forceinline__ void Sm90Consume(const Sm90Params& P, const Sm90Tile& t, int h, int cw,
                                            uint8_t* smem, uint64_t* bars) {
  using T = typename Tr::T;
  constexpr int BN = Tr::kBlockN;
  constexpr int S = Tr::kStages;
  const FlashParams& p = P.p;
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;
  uint64_t* full_v = bars + 1 + S;
  uint64_t* empty = bars + 1 + 2 * S;
  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const int r0 = t.m0 + 64 * cw + 16 * (tid / 32) + lane / 4;  // this thread's first row
  const Sm90Mma<Tr> mma{ptx::SmemAddr(smem + Tr::kQOff) + cw * 64 * 128, ptx::SmemAddr(smem + Tr::kKOff),
                        ptx::SmemAddr(smem + Tr::kVOff)};
  const int m_last = min(t.m0 + Tr::kBlockM, t.s_q) - 1;
  auto mask = [&](float (&s)[BN / 2], int nb) {
    const int n0 = nb * BN;
    const bool need = (n0 + BN > t.s_k) || (p.has_right && n0 + BN - 1 > t.m0 + t.off + p.right) ||
                      (p.has_left && n0 < m_last + t.off - p.left);
    if (need) Sm90Mask<BN>(s, p, t, r0, n0, lane);
  };

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

  if (t.nb_max > t.nb_min) {  // else no tile: Q is never loaded, O = 0 and LSE = -inf
    ptx::MbarWait(full_q, 0);
    int st = 0;
    uint32_t phase = 0;
    auto advance = [&] {
      if (++st == S) {
        st = 0;
        phase ^= 1;
      }
    };
    if constexpr (kOverlap) {
      // First tile: S, softmax, P; its P V is issued with the next tile's S.
      ptx::MbarWait(&full_k[st], phase);
      mma.IssueS(s, st);
      ptx::WgmmaWait<0>();
      ptx::RegFence(s);
      mask(s, t.nb_max - 1);
      Sm90Softmax<BN>(s, row_max, row_sum, corr, p.scale_log2);
      Sm90PackP<T, BN>(pa, s);
      int prev_st = st;
      uint32_t prev_phase = phase;
      advance();
      for (int nb = t.nb_max - 2; nb >= t.nb_min; --nb) {
        ptx::MbarWait(&full_k[st], phase);
        mma.IssueS(s, st);
        ptx::MbarWait(&full_v[prev_st], prev_phase);
        mma.IssuePV(o, pa, prev_st);
        ptx::WgmmaWait<1>();  // S done; P V of the previous tile may still run
        ptx::RegFence(s);
        mask(s, nb);
        Sm90Softmax<BN>(s, row_max, row_sum, corr, p.scale_log2);
        ptx::WgmmaWait<0>();
#pragma unroll
        for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
        if (lane == 0) ptx::MbarArrive(&empty[prev_st]);
        Sm90Rescale<Tr>(o, corr);
        Sm90PackP<T, BN>(pa, s);
        prev_st = st;
        prev_phase = phase;
        advance();
      }
      ptx::MbarWait(&full_v[prev_st], prev_phase);
      mma.IssuePV(o, pa, prev_st);
      ptx::WgmmaWait<0>();
#pragma unroll
      for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
      if (lane == 0) ptx::MbarArrive(&empty[prev_st]);
    } else {
      for (int nb = t.nb_max - 1; nb >= t.nb_min; --nb) {
        ptx::MbarWait(&full_k[st], phase);
        mma.IssueS(s, st);
        ptx::WgmmaWait<0>();
        ptx::RegFence(s);
        mask(s, nb);
        Sm90Softmax<BN>(s, row_max, row_sum, corr, p.scale_log2);
        Sm90Rescale<Tr>(o, corr);
        Sm90PackP<T, BN>(pa, s);
        ptx::MbarWait(&full_v[st], phase);
        mma.IssuePV(o, pa, st);
        ptx::WgmmaWait<0>();
#pragma unroll
        for (int nc = 0; nc < Tr::kPvChunks; ++nc) ptx::RegFence(o[nc]);
        if (lane == 0) ptx::MbarArrive(&empty[st]);
        advance();
      }
    }
  }
  Sm90Epilogue<Tr>(p, t, h, r0, lane, o, row_max, row_sum);
}

template <typename Tr, bool kOverlap>
__global__ void __launch_bounds__(Tr::kThreads, 1) FlashFwdSm90Kernel(const __grid_constant__ Sm90Params P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Tr::kBarOff);
  constexpr int S = Tr::kStages;

  // Causal blocks further down have more key tiles: launch them first.
  const int m_block = P.p.has_right ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y;
  Sm90Tile t;
  if (!MakeSm90Tile<Tr::kBlockM, Tr::kBlockN>(P.p, m_block, blockIdx.z, &t)) return;

  if (threadIdx.x == 0) {
    ptx::MbarInit(&bars[0], 1);
    for (int i = 0; i < S; ++i) {
      ptx::MbarInit(&bars[1 + i], 1);
      ptx::MbarInit(&bars[1 + S + i], 1);
      ptx::MbarInit(&bars[1 + 2 * S + i], Tr::kConsumerWGs * 4);  // one arrival per consumer warp
    }
    ptx::FenceMbarInit();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    ptx::SetMaxNRegDec<Tr::kProducerRegs>();
    if (threadIdx.x == 0 && t.nb_max > t.nb_min) Sm90Produce<Tr>(P, t, h, smem, bars);
  } else {
    ptx::SetMaxNRegInc<Tr::kConsumerRegs>();
    Sm90Consume<Tr, kOverlap>(P, t, h, wg - 1, smem, bars);
  }
#endif
}

}  // namespace attn::kernels::cuda
