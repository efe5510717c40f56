// What the two split-KV decode kernels (16-bit K/V in decode_kernel.cuh, FP8 K/V in
// decode_fp8_kernel.cuh) share, as device functions: a CTA's place in the grid and the rows and keys
// it covers, each warp's ring of K/V stages, a key tile's masked online softmax, and the merge of
// the warps' rows into o, LSE or a split's partial. What differs between the two is how K and V
// reach the tensor cores; that stays in each kernel.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "decode_combine.cuh"
#include "decode_params.h"
#include "ptx.cuh"
#include "ptx_decode.cuh"

namespace attn::kernels::cuda {
namespace decode {

// Page of key j (paged K/V), through the sequence's page list.
__device__ __forceinline__ int PageOf(const int32_t* pages, int j, int page_size, int shift) {
  return ptx::LdgEarly(pages + (shift >= 0 ? (j >> shift) : (j / page_size)));
}
__device__ __forceinline__ int InPage(int j, int page_size, int shift) {
  return shift >= 0 ? (j & (page_size - 1)) : (j % page_size);
}

// Columns (c, c + 1) of row r, summed over the warps' rows in sO with weights a.
template <typename Tr>
__device__ __forceinline__ float2 WarpsWeighted(const float* sO, const float (&a)[Tr::kWarps], int r, int c) {
  float2 v = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < Tr::kWarps; ++w) {
    const float2 x = *reinterpret_cast<const float2*>(sO + (w * Tr::kRows + r) * Tr::kMergeStride + c);
    v.x += a[w] * x.x;
    v.y += a[w] * x.y;
  }
  return v;
}

// Row r of the CTA's 16, its warps' sums in sO weighted by a and normalised by inv (any: the row
// saw a key; mx and l: its largest score and sum, log2 units): o and LSE (natural log) with one
// split, else this split's partial and LSE (log2), for (token t, head h). kTPR threads per row,
// from column col0.
template <typename Tr>
__device__ __forceinline__ void StoreWarpsMerged(const DecodeParams& p, const float* sO, const float (&a)[Tr::kWarps],
                                                 float inv, bool any, float mx, float l, int r, int col0,
                                                 int split, int h, int t) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  constexpr int kTPR = Tr::kThreads / Tr::kRows;
  constexpr int kCols = D / kTPR;
  const int tid = threadIdx.x;
  const float lse2 = any ? mx + __log2f(l) : -INFINITY;
  if (p.num_splits == 1) {
    T* go = reinterpret_cast<T*>(p.o) + int64_t(t) * p.o_row_stride + int64_t(h) * D + col0;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      const float2 v = WarpsWeighted<Tr>(sO, a, r, col0 + c);
      *reinterpret_cast<uint32_t*>(go + c) = ptx::Pack2<T>(v.x * inv, v.y * inv);
    }
    if (p.lse != nullptr && (tid % kTPR) == 0) {
      p.lse[int64_t(h) * p.total_q + t] = any ? lse2 * 0.6931471805599453f : -INFINITY;
    }
  } else {
    const int64_t row = int64_t(t) * p.num_heads + h;
    const int64_t rows_all = int64_t(p.total_q) * p.num_heads;
    float* po = p.part_o + (int64_t(split) * rows_all + row) * D + col0;
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      const float2 v = WarpsWeighted<Tr>(sO, a, r, col0 + c);
      *reinterpret_cast<float2*>(po + c) = make_float2(v.x * inv, v.y * inv);
    }
    if ((tid % kTPR) == 0) p.part_lse[int64_t(split) * rows_all + row] = lse2;
  }
}

// A CTA's share of a decode grid: its (split, row block, KV head, sequence), the block's query
// rows (16 packed rows from m0, of rows_valid), the keys they see and this split's whole tiles of
// kWarpN keys among them (ntiles from tile0; keys [c_lo, c_hi) of them in range).
struct DecodeBlock {
  int split, mb, hk, b;
  int q_start, s_q, rows_valid, m0, m_last;
  int s_k, k_start, off;
  const int32_t* pages;
  int c_lo, c_hi, ntiles, tile0;
};

// The CTA's place in the grid (split, row block, KV head, sequence).
__device__ __forceinline__ DecodeBlock DecodeBlockOf(const DecodeParams& p) {
  DecodeBlock blk;
  blk.split = blockIdx.x % p.num_splits;
  blk.mb = blockIdx.x / p.num_splits;
  blk.hk = blockIdx.y;
  blk.b = blockIdx.z;
  return blk;
}

// The block's query rows; false when the row block lies past the sequence's rows.
template <typename Tr>
__device__ __forceinline__ bool LocateDecodeRows(const DecodeParams& p, DecodeBlock& blk) {
  blk.q_start = p.cu_seqlens_q[blk.b];
  blk.s_q = p.cu_seqlens_q[blk.b + 1] - blk.q_start;
  blk.rows_valid = blk.s_q * p.heads_per_kv;
  blk.m0 = blk.mb * Tr::kRows;
  return blk.m0 < blk.rows_valid;
}

// The block's keys: those any of its rows sees (window), then this split's whole tiles of them.
template <typename Tr, bool kPaged>
__device__ __forceinline__ void LocateDecodeKeys(const DecodeParams& p, DecodeBlock& blk) {
  constexpr int W = Tr::kWarpN;
  const int G = p.heads_per_kv;
  blk.k_start = 0;
  blk.pages = nullptr;
  if constexpr (kPaged) {
    blk.s_k = p.seqlens_k[blk.b];
    blk.pages = p.page_indices + p.page_indptr[blk.b];
  } else {
    blk.k_start = p.cu_seqlens_k[blk.b];
    blk.s_k = p.cu_seqlens_k[blk.b + 1] - blk.k_start;
  }
  blk.off = blk.s_k - blk.s_q;
  blk.m_last = min(blk.m0 + Tr::kRows, blk.rows_valid) - 1;
  const int n_lo = p.has_left ? max(0, blk.m0 / G + blk.off - p.left) : 0;
  const int n_hi = p.has_right ? min(blk.s_k, blk.m_last / G + blk.off + p.right + 1) : blk.s_k;
  blk.c_lo = blk.c_hi = blk.ntiles = blk.tile0 = 0;
  if (n_hi > n_lo) {
    const int a_lo = (n_lo / W) * W;
    const int total_tiles = (n_hi - a_lo + W - 1) / W;
    const int tps = (total_tiles + p.num_splits - 1) / p.num_splits;
    const int t_begin = blk.split * tps;
    const int t_end = min(total_tiles, t_begin + tps);
    if (t_end > t_begin) {
      blk.ntiles = t_end - t_begin;
      blk.tile0 = a_lo + t_begin * W;
      blk.c_lo = max(n_lo, blk.tile0);
      blk.c_hi = min(n_hi, a_lo + t_end * W);
    }
  }
}

// The keys each of a thread's two rows (lane / 4 and lane / 4 + 8 of the block's 16) sees: [lo, hi].
// Padding rows past the valid ones take the last valid row's bounds.
__device__ __forceinline__ void RowKeyBounds(const DecodeParams& p, const DecodeBlock& blk, int lane,
                                             int (&lo)[2], int (&hi)[2]) {
  const int G = p.heads_per_kv;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int pr = min(blk.m0 + (lane >> 2) + 8 * hf, blk.rows_valid - 1);
    const int pos = pr / G + blk.off;
    lo[hf] = p.has_left ? max(blk.c_lo, pos - p.left) : blk.c_lo;
    hi[hf] = p.has_right ? min(blk.c_hi - 1, pos + p.right) : blk.c_hi - 1;
  }
}

// A warp's ring of Tr::kStages (K, V) stages from sWarp, one cp.async group per tile. The kernel
// gives page_of(k) (the page of its lane's key of tile k; paged K/V only) and issue(k, page, stage
// address) (tile k's copies).
//
// RingPrologue issues tiles 0 .. S-2 (empty groups keep the group count fixed), reading the page
// numbers of the first S tiles together (one page-table latency, not S), and returns tile S-1's.
template <typename Tr, bool kPaged, typename PageOfTile, typename IssueTile>
__device__ __forceinline__ int RingPrologue(int my_tiles, uint32_t sWarp, PageOfTile&& page_of,
                                            IssueTile&& issue) {
  constexpr int S = Tr::kStages;
  int first_pages[S];
#pragma unroll
  for (int st = 0; st < S; ++st) first_pages[st] = (kPaged && st < my_tiles) ? page_of(st) : 0;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < my_tiles) issue(st, first_pages[st], sWarp + st * Tr::kStageBytes);
    ptx::CpAsyncCommit();
  }
  return first_pages[S - 1];
}

// At the top of tile k (in the stage at byte offset `stage`): waits until tile k is visible to the
// whole warp (the warp is then done with tile k-1's stage), issues tile k + S - 1 into that stage,
// and reads the page of the tile after it one iteration ahead.
template <typename Tr, bool kPaged, typename PageOfTile, typename IssueTile>
__device__ __forceinline__ void RingAwaitAndRefill(int k, int my_tiles, uint32_t sWarp, uint32_t stage,
                                                   int& next_page, PageOfTile&& page_of, IssueTile&& issue) {
  constexpr int S = Tr::kStages;
  ptx::CpAsyncWait<S - 2>();
  __syncwarp();
  const int kn = k + S - 1;
  const uint32_t refill = stage == 0 ? (S - 1) * Tr::kStageBytes : stage - Tr::kStageBytes;
  if (kn < my_tiles) issue(kn, next_page, sWarp + refill);
  ptx::CpAsyncCommit();
  if constexpr (kPaged) {
    if (kn + 1 < my_tiles) next_page = page_of(kn + 1);
  }
}

// The byte offset of the stage after `stage`, wrapping at the ring's end.
template <typename Tr>
__device__ __forceinline__ uint32_t RingNextStage(uint32_t stage) {
  return stage == (Tr::kStages - 1) * Tr::kStageBytes ? 0 : stage + Tr::kStageBytes;
}

// One key tile (keys from t0) of the online softmax of a thread's two rows, in log2 units: scores
// outside a row's [lo, hi] masked, the row's running max and sum updated, its O rescaled, and
// acc_s replaced by P. sl2: each row's score scale (log2 units).
template <int NT, int DT>
__device__ __forceinline__ void SoftmaxTile(float (&acc_s)[NT][4], float (&acc_o)[DT][4], float (&row_max)[2],
                                            float (&row_sum)[2], const float (&sl2)[2], const int (&lo)[2],
                                            const int (&hi)[2], int t0, int lane) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = t0 + nt * 8 + 2 * (lane & 3) + e;
        if (col < lo[hf] || col > hi[hf]) acc_s[nt][2 * hf + e] = -INFINITY;
      }
    float mx = row_max[hf];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(acc_s[nt][2 * hf], acc_s[nt][2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float ms = (mx == -INFINITY) ? 0.0f : mx * sl2[hf];
    const float corr = exp2f(row_max[hf] * sl2[hf] - ms);
    row_max[hf] = mx;
    float sum = row_sum[hf] * corr;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      acc_o[dt][2 * hf] *= corr;
      acc_o[dt][2 * hf + 1] *= corr;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2f(fmaf(acc_s[nt][2 * hf + e], sl2[hf], -ms));
        acc_s[nt][2 * hf + e] = pe;
        sum += pe;
      }
    row_sum[hf] = sum;
  }
}

// The warps' merge in shared memory (the ring's space, after Q's bytes; free once every warp has
// drained its copies): each warp's unnormalised O rows (kMergeStride floats a row), then each
// warp's row maxima (log2 units) and row sums.
struct MergeSmem {
  float* o;
  float* max;
  float* sum;
};

template <typename Tr>
__device__ __forceinline__ MergeSmem MergeSmemOf(uint8_t* smem_raw) {
  MergeSmem sm;
  sm.o = reinterpret_cast<float*>(smem_raw + Tr::kQBytes);
  sm.max = sm.o + Tr::kWarps * Tr::kRows * Tr::kMergeStride;
  sm.sum = sm.max + Tr::kWarps * Tr::kRows;
  return sm;
}

// Row r's max (scaled by sl2 into log2 units) and the warp's sum of it (its four lanes' partial
// sums, of which this lane's is `sum`), by the row's first lane.
template <typename Tr>
__device__ __forceinline__ void StoreWarpRowStats(const MergeSmem& sm, int warp, int lane, int r, float row_max,
                                                  float sl2, float sum) {
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  if ((lane & 3) == 0) {
    sm.max[warp * Tr::kRows + r] = row_max == -INFINITY ? -INFINITY : row_max * sl2;
    sm.sum[warp * Tr::kRows + r] = sum;
  }
}

// After every warp's rows are in sm (and a CTA barrier): the block's rows merged across the warps
// by their maxima, times inv_of(l) for their sum l, stored as o and LSE or as this split's partial;
// then, where the last split of a block merges the splits, that merge.
template <typename Tr, bool kLastSplitMerges, typename InvOfSum>
__device__ __forceinline__ void MergeWarpsAndStore(const DecodeParams& p, const DecodeBlock& blk,
                                                   const MergeSmem& sm, InvOfSum&& inv_of) {
  constexpr int D = Tr::kHeadDim;
  constexpr int NW = Tr::kWarps;
  constexpr int kTPR = Tr::kThreads / Tr::kRows;  // threads per row
  constexpr int kCols = D / kTPR;                 // columns per thread
  static_assert(kCols % 2 == 0, "");
  const int tid = threadIdx.x;
  const int G = p.heads_per_kv;
  const int r = tid / kTPR;
  const int col0 = (tid % kTPR) * kCols;
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm.max[w * Tr::kRows + r]);
  float a[NW];
  float l = 0.0f;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    const float m = sm.max[w * Tr::kRows + r];
    a[w] = m == -INFINITY ? 0.0f : exp2f(m - mx);
    l += a[w] * sm.sum[w * Tr::kRows + r];
  }
  const bool any = l > 0.0f;
  const float inv = any ? inv_of(l) : 0.0f;
  const int pr = blk.m0 + r;
  if constexpr (!kLastSplitMerges) {
    if (pr > blk.m_last) return;
  }
  if (pr <= blk.m_last) {
    const int i = pr / G;
    const int h = blk.hk * G + (pr - i * G);
    const int t = blk.q_start + i;
    StoreWarpsMerged<Tr>(p, sm.o, a, inv, any, mx, l, r, col0, blk.split, h, t);
  }
  if constexpr (kLastSplitMerges) {
    MergeIfLastSplit<typename Tr::T, D, Tr::kThreads>(p, blk.b, blk.hk, blk.mb, blk.m0, blk.m_last, blk.q_start);
  }
}

}  // namespace decode
}  // namespace attn::kernels::cuda
