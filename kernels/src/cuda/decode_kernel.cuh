// Split-KV decode kernel and its combine kernel (device code).
//
// Decode is bandwidth-bound: each K/V byte must be read once and enough bytes must be in flight.
//  - One CTA = 16 packed query rows (query token x query head of one KV group, token-major) of one
//    (sequence, KV head, KV split). All the query heads of a KV head share its K/V tiles, so each
//    K/V byte is read once per group (once per row block when s_q * group > 16).
//  - The 4 warps split the CTA's keys: warp w takes key tiles w, w+4, w+8, ... of kWarpN keys and
//    streams them through its own ring of kStages (K, V) tile pairs with 16-byte cp.async (no
//    CTA barrier in the main loop; __syncwarp only). Each warp keeps its own online softmax over
//    the 16 rows with S = Q K^T and O += P V on mma.sync m16n8k16 (fp32 accumulation).
//  - At the end the warps merge through shared memory (the ring's space) by their row maxima.
//    With one split the CTA writes O and LSE; with several it writes a normalised fp32 partial O
//    and its LSE (log2 units) to the workspace, and the splits are merged by LSE: by the last CTA
//    of each (sequence, KV head, row block) to finish where the caller keeps zeroed counters
//    (p.split_counters), else by DecodeCombineKernel (decode_combine.cuh).
//  - Token rows are addressed through a per-tile row index that lane r computes for key r of the
//    tile (contiguous: k_start + j; paged: page * page_size + j % page_size), shuffled to the
//    lanes that copy that row. For paged K/V the page number of the next tile is loaded one
//    iteration ahead, so the page-table read latency stays off the load path.
//  - A session's step may hand its new rows over (p.append_k): they are read from there, and one
//    CTA per (sequence, KV head) writes them into their pages, which saves a copy kernel (and its
//    place in the step's chain of device operations).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "decode_block.cuh"
#include "decode_params.h"
#include "ptx.cuh"
#include "ptx_decode.cuh"

namespace attn::kernels::cuda {
namespace decode {

template <int D_, typename T_>
struct DecodeTraits {
  using T = T_;
  static constexpr int kHeadDim = D_;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = kDecodeRows;
  static constexpr int kWarpN = DecodeWarpN(D_);
  static constexpr int kStages = DecodeStages(D_);
  static constexpr int kCPR = D_ / 8;  // 16-byte chunks per row
  static_assert(kCPR % 4 == 0, "head dim must be a multiple of 32");
  static constexpr int kSwzMask = (kCPR % 8 == 0) ? 7 : 3;
  static constexpr int kTileBytes = kWarpN * D_ * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile, then V tile
  static constexpr int kWarpRingBytes = kStages * kStageBytes;
  static constexpr int kQBytes = kRows * D_ * 2;
  static constexpr int kMergeStride = DecodeMergeStride(D_);
  static constexpr int kSmemBytes = DecodeSmemBytes(D_);
  static constexpr int kMinBlocks = DecodeMinBlocks(D_);
  static constexpr bool kQInRegs = D_ <= 128;
  static constexpr int kNT = kWarpN / 8;    // n8 tiles of S
  static constexpr int kKS = D_ / 16;       // k16 steps of Q K^T
  static constexpr int kDT = D_ / 8;        // n8 tiles of O
  static constexpr int kPVK = kWarpN / 16;  // k16 steps of P V
  static constexpr int kCopyIters = kWarpN * kCPR / 32;
  static_assert(kWarpN <= 32, "one lane computes the row index of one key of the tile");
  static_assert(kWarpN * kCPR % 32 == 0, "");
  static_assert(kWarpN % 16 == 0, "");

  __device__ __forceinline__ static int SwzKey(int row) {
    return kSwzMask == 7 ? (row & 7) : ((row >> 1) & 3);
  }
  // Byte offset of (row, chunk) in a tile of kCPR chunks per row.
  __device__ __forceinline__ static uint32_t Offset(int row, int chunk) {
    const int c = (chunk & ~kSwzMask) | ((chunk ^ SwzKey(row)) & kSwzMask);
    return static_cast<uint32_t>((row * kCPR + c) * 16);
  }
};

template <int kMask>
__device__ __forceinline__ int SwzChunk(int c_even, int y) {
  return (c_even & ~kMask) | ((c_even & kMask) ^ y);
}

// The rows sequence (q_start, s_q) appends, KV head hk: row i of ak / av (16-byte chunks) into the
// page row of key off + i, by the CTA's threads.
template <typename Tr>
__device__ __forceinline__ void AppendRows(const DecodeParams& p, const typename Tr::T* ak,
                                           const typename Tr::T* av, const int32_t* pages,
                                           int q_start, int s_q, int off, int hk) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  constexpr int CPR = Tr::kCPR;
  T* k = reinterpret_cast<T*>(const_cast<void*>(p.k));
  T* v = reinterpret_cast<T*>(const_cast<void*>(p.v));
  for (int idx = threadIdx.x; idx < s_q * CPR; idx += Tr::kThreads) {
    const int i = idx / CPR;
    const int c = idx % CPR;
    const int j = off + i;
    if (j < 0) continue;  // more new rows than keys (ValidatePageTable refuses it on the host)
    const int64_t row = int64_t(PageOf(pages, j, p.page_size, p.page_shift)) * p.page_size +
                        InPage(j, p.page_size, p.page_shift);
    const int64_t dst = row * p.k_row_stride + int64_t(hk) * D + c * 8;
    const int64_t src = int64_t(q_start + i) * p.k_row_stride + int64_t(hk) * D + c * 8;
    *reinterpret_cast<uint4*>(k + dst) = *reinterpret_cast<const uint4*>(ak + src);
    *reinterpret_cast<uint4*>(v + dst) = *reinterpret_cast<const uint4*>(av + src);
  }
}

template <typename Tr, bool kPaged, bool kLastSplitMerges>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocks)
    DecodeKernel(const __grid_constant__ DecodeParams p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  constexpr int W = Tr::kWarpN;
  constexpr int S = Tr::kStages;
  constexpr int CPR = Tr::kCPR;
  constexpr int M = Tr::kSwzMask;
  constexpr int NT = Tr::kNT;
  constexpr int KS = Tr::kKS;
  constexpr int DT = Tr::kDT;
  constexpr int NW = Tr::kWarps;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t sQ = ptx::SmemAddr(smem_raw);
  const uint32_t sRing = sQ + Tr::kQBytes;

  // The combine kernel (a programmatic dependent when there are splits) may be launched as soon
  // as every CTA of this grid is running: its launch then overlaps this grid's work, and it waits
  // for this grid's completion before it reads the partials.
  ptx::GridDependencyLaunchDependents();
  DecodeBlock blk = DecodeBlockOf(p);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int G = p.heads_per_kv;
  if (!LocateDecodeRows<Tr>(p, blk)) return;
  LocateDecodeKeys<Tr, kPaged>(p, blk);

  // Rows this call appends (p.append_k): keys j >= off come from them, and the first CTA of the
  // (sequence, KV head) writes them into their page rows. No CTA of this grid reads those page
  // rows, so the writes need no ordering against the loads.
  const T* ak = reinterpret_cast<const T*>(p.append_k);
  const T* av = reinterpret_cast<const T*>(p.append_v);
  if constexpr (kPaged) {
    if (ak != nullptr && blk.split == 0 && blk.mb == 0) AppendRows<Tr>(p, ak, av, blk.pages, blk.q_start, blk.s_q, blk.off, blk.hk);
  }

  // Q: 16 packed rows (zero-filled past the block's valid rows), one cp.async group.
  const T* gq = reinterpret_cast<const T*>(p.q);
  for (int idx = tid; idx < Tr::kRows * CPR; idx += Tr::kThreads) {
    const int r = idx / CPR;
    const int c = idx % CPR;
    const int pr = blk.m0 + r;
    const bool ok = pr < blk.rows_valid;
    const int i = pr / G;
    const int h = blk.hk * G + (pr - i * G);
    const T* src = ok ? gq + int64_t(blk.q_start + i) * p.q_row_stride + int64_t(h) * D + c * 8 : gq;
    ptx::CpAsync16(sQ + Tr::Offset(r, c), src, ok);
  }
  ptx::CpAsyncCommit();

  // This warp's tiles: w, w + NW, ... of the split's ntiles.
  const int my_tiles = blk.ntiles > warp ? (blk.ntiles - warp + NW - 1) / NW : 0;
  const uint32_t sWarp = sRing + warp * Tr::kWarpRingBytes;
  const T* gk = reinterpret_cast<const T*>(p.k) + int64_t(blk.hk) * D;
  const T* gv = reinterpret_cast<const T*>(p.v) + int64_t(blk.hk) * D;
  const int64_t kv_stride = p.k_row_stride;
  const T* ak_head = ak + int64_t(blk.hk) * D;  // used only where ak is set
  const T* av_head = av + int64_t(blk.hk) * D;

  auto tile_start = [&](int k) { return blk.tile0 + (warp + k * NW) * W; };
  // Lane r's key of tile k, if it is in [c_lo, c_hi).
  auto key_ok = [&](int j) { return j >= blk.c_lo && j < blk.c_hi; };
  // Row index of lane's key of tile k (-1: not loaded, zero-filled; -2 - t: row t of the
  // appended rows).
  auto row_index = [&](int k, int page) -> int {
    const int j = tile_start(k) + lane;
    if (lane >= W || !key_ok(j)) return -1;
    if constexpr (kPaged) {
      if (ak != nullptr && j >= blk.off) return -2 - (blk.q_start + j - blk.off);
      return page * p.page_size + InPage(j, p.page_size, p.page_shift);
    } else {
      return blk.k_start + j;
    }
  };
  auto page_of = [&](int k) -> int {
    if constexpr (kPaged) {
      const int j = tile_start(k) + lane;
      return (lane < W && key_ok(j)) ? PageOf(blk.pages, j, p.page_size, p.page_shift) : 0;
    } else {
      return 0;
    }
  };
  auto issue = [&](int k, int page, uint32_t stage_addr) {
    const int ri = row_index(k, page);
#pragma unroll
    for (int it = 0; it < Tr::kCopyIters; ++it) {
      const int idx = lane + 32 * it;
      const int r = idx / CPR;
      const int c = idx % CPR;
      const int rr = __shfl_sync(0xffffffffu, ri, r);
      const bool ok = rr != -1;
      const bool appended = kPaged && rr < -1;
      const int64_t goff = int64_t(appended ? -2 - rr : (ok ? rr : 0)) * kv_stride + c * 8;
      ptx::CpAsync16(stage_addr + Tr::Offset(r, c), (appended ? ak_head : gk) + goff, ok);
      ptx::CpAsync16(stage_addr + Tr::kTileBytes + Tr::Offset(r, c), (appended ? av_head : gv) + goff,
                     ok);
    }
  };

  int next_page = RingPrologue<Tr, kPaged>(my_tiles, sWarp, page_of, issue);
  int lo[2], hi[2];
  RowKeyBounds(p, blk, lane, lo, hi);

  // Q fragments (after the Q group and the prologue groups: wait for all but the S-1 newest).
  ptx::CpAsyncWait<S - 1>();
  __syncthreads();
  const int swz_key = Tr::SwzKey(lane & 7);
  const int q_y = ((lane >> 4) ^ swz_key) & M;
  const uint32_t sQ_addr = sQ + (lane & 15) * CPR * 16;
  uint32_t qf[Tr::kQInRegs ? KS : 1][4];
  if constexpr (Tr::kQInRegs) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ptx::LdMatrixX4(qf[ks], sQ_addr + SwzChunk<M>(2 * ks, q_y) * 16);
  }
  const int k_row = (lane & 7) + 8 * (lane >> 4);
  const int k_y = (((lane >> 3) & 1) ^ swz_key) & M;
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int v_y = ((lane >> 4) ^ swz_key) & M;

  float acc_o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  const float sl2 = p.scale_log2;
  const float row_sl2[2] = {sl2, sl2};

  uint32_t stage = 0;  // byte offset of tile k's stage in this warp's ring
  for (int k = 0; k < my_tiles; ++k) {
    RingAwaitAndRefill<Tr, kPaged>(k, my_tiles, sWarp, stage, next_page, page_of, issue);
    const uint32_t sK = sWarp + stage;
    const uint32_t sV = sK + Tr::kTileBytes;
    const int t0 = tile_start(k);

    // S = Q K^T over this tile's W keys.
    float acc_s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t qa[4];
      if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[e] = qf[ks][e];
      } else {
        ptx::LdMatrixX4(qa, sQ_addr + SwzChunk<M>(2 * ks, q_y) * 16);
      }
#pragma unroll
      for (int nt2 = 0; nt2 < NT / 2; ++nt2) {
        uint32_t kb[4];
        ptx::LdMatrixX4(kb, sK + (nt2 * 16 + k_row) * CPR * 16 + SwzChunk<M>(2 * ks, k_y) * 16);
        ptx::Mma16816<T>(acc_s[2 * nt2], qa, kb[0], kb[1]);
        ptx::Mma16816<T>(acc_s[2 * nt2 + 1], qa, kb[2], kb[3]);
      }
    }

    // Mask (split range, sequence end, causal/window), then the online softmax in log2 units.
    SoftmaxTile(acc_s, acc_o, row_max, row_sum, row_sl2, lo, hi, t0, lane);

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < Tr::kPVK; ++kk) {
      uint32_t pa[4];
      pa[0] = ptx::Pack2<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
      pa[1] = ptx::Pack2<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
      pa[2] = ptx::Pack2<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
      pa[3] = ptx::Pack2<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
#pragma unroll
      for (int nd2 = 0; nd2 < DT / 2; ++nd2) {
        uint32_t vb[4];
        ptx::LdMatrixX4Trans(vb, sV + (kk * 16 + v_row) * CPR * 16 + SwzChunk<M>(2 * nd2, v_y) * 16);
        ptx::Mma16816<T>(acc_o[2 * nd2], pa, vb[0], vb[1]);
        ptx::Mma16816<T>(acc_o[2 * nd2 + 1], pa, vb[2], vb[3]);
      }
    }
    stage = RingNextStage<Tr>(stage);
  }

  // Merge the warps through shared memory.
  ptx::CpAsyncWait<0>();
  __syncthreads();
  const MergeSmem sm = MergeSmemOf<Tr>(smem_raw);
  float* sOw = sm.o + warp * Tr::kRows * Tr::kMergeStride;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = (lane >> 2) + 8 * hf;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      *reinterpret_cast<float2*>(sOw + r * Tr::kMergeStride + dt * 8 + 2 * (lane & 3)) =
          make_float2(acc_o[dt][2 * hf], acc_o[dt][2 * hf + 1]);
    }
    StoreWarpRowStats<Tr>(sm, warp, lane, r, row_max[hf], sl2, row_sum[hf]);
  }
  __syncthreads();
  MergeWarpsAndStore<Tr, kLastSplitMerges>(p, blk, sm, [](float l) { return 1.0f / l; });
}

}  // namespace decode
}  // namespace attn::kernels::cuda
