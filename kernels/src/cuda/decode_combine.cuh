// The merge of the split-KV decode kernels' partial results (device code): each split wrote a
// normalised fp32 partial O and its LSE (log2 units) per (token, head) row, and a row's result is
// the partials weighted by exp2(LSE - max LSE), over the sum of those weights.
//
// Two places merge: the combine kernel (a launch of its own after the split kernel), and the last
// CTA of each (sequence, KV head, row block) to finish in the split kernel itself, where the caller
// keeps zeroed counters (DecodeParams::split_counters). The second saves a launch, which is most of
// the cost of a combine for small batches.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "decode_params.h"
#include "ptx.cuh"

namespace attn::kernels::cuda {
namespace decode {

constexpr unsigned kFullMask = 0xffffffffu;

// One row's split weights in a warp: lane l holds those of splits l and l + 32 (kDecodeMaxSplits
// is 64); zero for an empty split or an empty row.
struct SplitWeights {
  float w0 = 0.0f;
  float w1 = 0.0f;
  float inv = 0.0f;      // 1 / sum, or 0 for an empty row
  float mx = -INFINITY;  // the largest LSE, log2 units
  float sum = 0.0f;
};

// Every lane of the warp calls it. The partials are read through L2 (__ldcg): other CTAs of the
// running grid wrote them, and a line this SM's L1 holds from another group's merge may be older
// than their writes. (The combine kernel below runs after the split kernel and reads them plainly;
// its code is kept as it was measured.)
__device__ __forceinline__ SplitWeights LoadSplitWeights(const DecodeParams& p, int64_t row, int lane) {
  const int64_t rows_all = int64_t(p.total_q) * p.num_heads;
  const int ns = p.num_splits;
  const float l0 = lane < ns ? __ldcg(p.part_lse + int64_t(lane) * rows_all + row) : -INFINITY;
  const float l1 = lane + 32 < ns ? __ldcg(p.part_lse + int64_t(lane + 32) * rows_all + row) : -INFINITY;
  SplitWeights sw;
  float mx = fmaxf(l0, l1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
  sw.w0 = (mx == -INFINITY || l0 == -INFINITY) ? 0.0f : exp2f(l0 - mx);
  sw.w1 = (mx == -INFINITY || l1 == -INFINITY) ? 0.0f : exp2f(l1 - mx);
  float sum = sw.w0 + sw.w1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  sw.inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  sw.mx = mx;
  sw.sum = sum;
  return sw;
}

// Split s's normalised weight, from the lane that holds it (s is the same in every lane).
__device__ __forceinline__ float SplitWeight(const SplitWeights& sw, int s) {
  return __shfl_sync(kFullMask, s < 32 ? sw.w0 : sw.w1, s & 31) * sw.inv;
}

// Columns 4c .. 4c + 3 of a merged row, as two 4-byte stores: o rows need only the 4-byte alignment
// the split kernel's own stores need.
template <typename T>
__device__ __forceinline__ void StoreMerged4(T* out, int c, float4 v) {
  *reinterpret_cast<uint32_t*>(out + 4 * c) = ptx::Pack2<T>(v.x, v.y);
  *reinterpret_cast<uint32_t*>(out + 4 * c + 2) = ptx::Pack2<T>(v.z, v.w);
}

// The row of token t, head h merged by one warp: every lane keeps its float4 columns of the sum
// over the splits, with the loads of several splits in flight (unrolled; no branch between them);
// then o's row and, where asked for, its LSE (natural log).
template <typename T, int D>
__device__ __forceinline__ void MergeRowInWarp(const DecodeParams& p, int t, int h, int lane) {
  constexpr int kVecs = D / 4;
  constexpr int kPerLane = (kVecs + 31) / 32;
  const int64_t row = int64_t(t) * p.num_heads + h;
  const SplitWeights sw = LoadSplitWeights(p, row, lane);
  const int64_t rows_all = int64_t(p.total_q) * p.num_heads;
  float4 acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = SplitWeight(sw, s);
    const float4* po = reinterpret_cast<const float4*>(p.part_o + (int64_t(s) * rows_all + row) * D);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int c = lane + 32 * j;
      if (c < kVecs) {
        const float4 x = __ldcg(po + c);
        acc[j].x += w * x.x;
        acc[j].y += w * x.y;
        acc[j].z += w * x.z;
        acc[j].w += w * x.w;
      }
    }
  }
  T* out = reinterpret_cast<T*>(p.o) + int64_t(t) * p.o_row_stride + int64_t(h) * D;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int c = lane + 32 * j;
    if (c < kVecs) StoreMerged4(out, c, acc[j]);
  }
  if (lane == 0 && p.lse != nullptr) {
    p.lse[int64_t(h) * p.total_q + t] =
        sw.sum > 0.0f ? (sw.mx + __log2f(sw.sum)) * 0.6931471805599453f : -INFINITY;
  }
}

// The split kernel's merge, called by every thread of a CTA once its partial rows are written
// (num_splits > 1, p.split_counters set; the same for every thread). The CTA counts itself in on
// its group's word; the last of the group's num_splits CTAs zeroes the word and merges the
// group's valid packed rows m0 .. m_last, one warp per row. The fences order each thread's partial
// stores before the count and the last CTA's loads after it.
template <typename T, int D, int kThreads>
__device__ __forceinline__ void MergeIfLastSplit(const DecodeParams& p, int b, int hk, int mb, int m0,
                                                 int m_last, int q_start) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* word = p.split_counters + (int64_t(b) * p.num_kv_heads + hk) * p.m_blocks + mb;
    const bool is_last = atomicAdd(word, 1u) == uint32_t(p.num_splits - 1);
    if (is_last) atomicExch(word, 0u);  // every split is counted: zero for the next launch
    last = is_last;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int G = p.heads_per_kv;
  for (int pr = m0 + int(threadIdx.x >> 5); pr <= m_last; pr += kThreads / 32) {
    const int i = pr / G;
    const int h = hk * G + (pr - i * G);
    MergeRowInWarp<T, D>(p, q_start + i, h, int(threadIdx.x & 31));
  }
}

// Merges the num_splits partial results of each (token, head) row by their LSE: one CTA of
// kCombineWarps warps per row, warp w summing splits w, w + kCombineWarps, ... with the loads of
// several splits in flight at once (a one-warp loop over the splits waited for each partial in
// turn), then the warps' sums through shared memory.
constexpr int kCombineWarps = 4;

template <typename T, int D>
__global__ void __launch_bounds__(32 * kCombineWarps) DecodeCombineKernel(const __grid_constant__ DecodeParams p) {
  constexpr int kVecs = D / 4;                   // float4 columns of a row
  constexpr int kPerLane = (kVecs + 31) / 32;    // of them per lane
  __shared__ float4 red[kCombineWarps][kVecs];
  // With programmatic dependent launch this grid may start before the split kernel has finished.
  ptx::GridDependencyWait();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t rows_all = int64_t(p.total_q) * p.num_heads;
  const int64_t row = blockIdx.x;
  const int ns = p.num_splits;
  const float l0 = lane < ns ? p.part_lse[int64_t(lane) * rows_all + row] : -INFINITY;
  const float l1 = lane + 32 < ns ? p.part_lse[int64_t(lane + 32) * rows_all + row] : -INFINITY;
  float mx = fmaxf(l0, l1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float w0 = (mx == -INFINITY || l0 == -INFINITY) ? 0.0f : exp2f(l0 - mx);
  const float w1 = (mx == -INFINITY || l1 == -INFINITY) ? 0.0f : exp2f(l1 - mx);
  float sum = w0 + w1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  float4 acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  // Every split's partial is written (an empty split's is 0 with LSE -inf, weight 0), so each is
  // read unconditionally: no branch between the loads of consecutive splits.
#pragma unroll 4
  for (int s = warp; s < ns; s += kCombineWarps) {
    const float w = __shfl_sync(0xffffffffu, s < 32 ? w0 : w1, s & 31) * inv;
    const float4* po = reinterpret_cast<const float4*>(p.part_o + (int64_t(s) * rows_all + row) * D);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int c = lane + 32 * j;
      if (c < kVecs) {
        const float4 x = po[c];
        acc[j].x += w * x.x;
        acc[j].y += w * x.y;
        acc[j].z += w * x.z;
        acc[j].w += w * x.w;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int c = lane + 32 * j;
    if (c < kVecs) red[warp][c] = acc[j];
  }
  __syncthreads();
  const int64_t t = row / p.num_heads;
  const int h = static_cast<int>(row - t * p.num_heads);
  T* go = reinterpret_cast<T*>(p.o) + t * p.o_row_stride + int64_t(h) * D;
  for (int c = threadIdx.x; c < kVecs; c += 32 * kCombineWarps) {
    float4 v = red[0][c];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      v.x += red[w][c].x;
      v.y += red[w][c].y;
      v.z += red[w][c].z;
      v.w += red[w][c].w;
    }
    // Two 4-byte stores: o rows need only the 4-byte alignment the split kernel's stores need.
    *reinterpret_cast<uint32_t*>(go + 4 * c) = ptx::Pack2<T>(v.x, v.y);
    *reinterpret_cast<uint32_t*>(go + 4 * c + 2) = ptx::Pack2<T>(v.z, v.w);
  }
  if (p.lse != nullptr && threadIdx.x == 0) {
    p.lse[int64_t(h) * p.total_q + t] = sum > 0.0f ? (mx + __log2f(sum)) * 0.6931471805599453f : -INFINITY;
  }
}

}  // namespace decode
}  // namespace attn::kernels::cuda
