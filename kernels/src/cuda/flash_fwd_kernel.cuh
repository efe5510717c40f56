// FlashAttention-2-class fused forward kernel (device code).
//
// One block = BlockM query rows of one (sequence, head); 4 warps, each owning 16*kMTiles rows, so
// softmax statistics never cross warps. K/V tiles of BlockN keys stream through shared memory with
// cp.async: a ring of kKVStages (K, V) tile pairs, the loads of tile j+S-1 in flight while tile j
// is computed (or, with one stage, K and V alternating, each load overlapping the other's matrix
// product; see flash_traits.cuh); S = Q K^T and
// O += P V run on mma.sync m16n8k16 with fp32 accumulation; P stays in registers (the S
// accumulator layout is the A-fragment layout of the PV product). Key tiles are visited from the
// last to the first so the partial/diagonal tiles, the only ones that are masked, come first.
// With kPaged, K/V rows come from page pools through the CSR page table (PagedKv in attention.h):
// each copied row gets its own address (page * page_size + row in page); with a K/V ring the page
// numbers of upcoming tiles are copied to shared memory by cp.async ahead of use (see kPageTable).
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "flash_params.h"
#include "flash_traits.cuh"
#include "ptx.cuh"

namespace attn::kernels::cuda {

// Chunk index c (compile-time even value plus a per-thread low bit folded into y) after swizzle.
template <int kMask>
__device__ __forceinline__ int SwzChunk(int c_even, int y) {
  return (c_even & ~kMask) | ((c_even & kMask) ^ y);
}

// Per-thread state for copying kRows x D tiles (global rows of stride `stride` elements) into a
// swizzled shared-memory tile with cp.async; rows at or beyond `limit` are zero-filled. The
// thread's first (row, chunk) and its offsets are computed once, so the main loop only adds.
template <typename Tr, int kRows>
struct TileLoader {
  static constexpr int kCPR = Tr::kChunksPerRow;
  static constexpr int kTotal = kRows * kCPR;
  static constexpr int kIters = kTotal / Tr::kNThreads;
  static_assert(kTotal % Tr::kNThreads == 0, "tile chunks must divide among threads");
  static constexpr bool kRegular = Tr::kNThreads % kCPR == 0;
  static constexpr int kRowStep = Tr::kNThreads / kCPR;  // rows between a thread's copies

  int row = 0;       // first row (kRegular)
  int64_t goff = 0;  // element offset of (row, chunk) in the global tile
  int64_t gstep = 0; // element offset of kRowStep rows

  __device__ __forceinline__ TileLoader(int tid, int64_t stride) {
    row = tid / kCPR;
    goff = int64_t(row) * stride + (tid % kCPR) * 8;
    gstep = int64_t(kRowStep) * stride;
  }

  // As Load, with `gthr` = gmem + goff (this thread's first chunk) precomputed once by the caller,
  // so the main loop keeps one pointer per tensor live instead of base + 64-bit offset (this cut
  // the d=128 sm_90a spills from 80 to 16 bytes). Non-regular layouts fall back to Load.
  // `base` is the shared-memory address of the destination tile.
  __device__ __forceinline__ void LoadFrom(uint32_t base, const typename Tr::T* gthr,
                                           const typename Tr::T* gmem, int64_t stride, int row0,
                                           int limit, int tid) const {
    if constexpr (!kRegular) {
      Load(base, gmem, stride, row0, limit, tid);
      return;
    }
    const int c = tid % kCPR;
    const int rem = limit - row0 - row;
    const typename Tr::T* src = gthr + int64_t(row0) * stride;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool ok = it * kRowStep < rem;
      ptx::CpAsync16(base + Tr::Offset(row + it * kRowStep, c) * 2, ok ? src + it * gstep : gmem,
                     ok);
    }
  }

  // Paged K/V: row r of the tile is key j = row0 + r of the sequence, in page pages[j / ps] at
  // row j % ps; rows at or past `limit` are zero-filled. The page numbers of all of a thread's rows
  // are read first (independent loads, one latency), then the copies issued. kTwo: the same rows
  // of a second tensor (V) into base1 as well. `g0`/`g1` point at the pool plus the head offset.
  template <bool kTwo>
  __device__ __forceinline__ void LoadPaged(uint32_t base0, const typename Tr::T* g0, uint32_t base1,
                                            const typename Tr::T* g1, int64_t stride, int row0,
                                            int limit, int tid, const int32_t* pages, int ps,
                                            int shift) const {
    int pg[kIters];
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int j = row0 + (tid + it * Tr::kNThreads) / kCPR;
      pg[it] = j < limit ? __ldg(pages + (shift >= 0 ? (j >> shift) : (j / ps))) : 0;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = tid + it * Tr::kNThreads;
      const int r = idx / kCPR;
      const int c = idx % kCPR;
      const int j = row0 + r;
      const bool ok = j < limit;
      const int in_page = shift >= 0 ? (j & (ps - 1)) : (j % ps);
      const int64_t off = ok ? int64_t(pg[it] * ps + in_page) * stride + c * 8 : 0;
      ptx::CpAsync16(base0 + Tr::Offset(r, c) * 2, g0 + off, ok);
      if constexpr (kTwo) ptx::CpAsync16(base1 + Tr::Offset(r, c) * 2, g1 + off, ok);
    }
  }

  // As LoadPaged, with the page number of every row of the tile already in shared memory
  // (`pg_rows`, one per tile row, copied there by cp.async a few iterations ahead).
  template <bool kTwo>
  __device__ __forceinline__ void LoadRows(uint32_t base0, const typename Tr::T* g0, uint32_t base1,
                                           const typename Tr::T* g1, int64_t stride,
                                           const int32_t* pg_rows, int row0, int limit, int ps,
                                           int shift, int tid) const {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      int r, c;
      if constexpr (kRegular) {
        r = row + it * kRowStep;
        c = tid % kCPR;
      } else {
        r = (tid + it * Tr::kNThreads) / kCPR;
        c = (tid + it * Tr::kNThreads) % kCPR;
      }
      const int j = row0 + r;
      const bool ok = j < limit;
      const int in_page = shift >= 0 ? (j & (ps - 1)) : (j % ps);
      const int64_t off = ok ? int64_t(pg_rows[r] * ps + in_page) * stride + c * 8 : 0;
      ptx::CpAsync16(base0 + Tr::Offset(r, c) * 2, g0 + off, ok);
      if constexpr (kTwo) ptx::CpAsync16(base1 + Tr::Offset(r, c) * 2, g1 + off, ok);
    }
  }

  __device__ __forceinline__ void Load(uint32_t base, const typename Tr::T* gmem, int64_t stride,
                                       int row0, int limit, int tid) const {
    if constexpr (kRegular) {
      const int c = tid % kCPR;
      const int rem = limit - row0 - row;  // copies with it*kRowStep < rem are in range
      const typename Tr::T* src = gmem + int64_t(row0) * stride + goff;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const bool ok = it * kRowStep < rem;
        ptx::CpAsync16(base + Tr::Offset(row + it * kRowStep, c) * 2, ok ? src + it * gstep : gmem,
                       ok);
      }
    } else {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int idx = tid + it * Tr::kNThreads;
        const int r = idx / kCPR;
        const int c = idx % kCPR;
        const bool ok = row0 + r < limit;
        const typename Tr::T* src = ok ? gmem + (row0 + r) * stride + c * 8 : gmem;
        ptx::CpAsync16(base + Tr::Offset(r, c) * 2, src, ok);
      }
    }
  }
};

// kPaged: K/V rows are read through the page table (FlashParams::page_*), else contiguous rows of
// cu_seqlens_k. Nothing else differs.
template <typename Tr, bool kPaged>
__global__ void __launch_bounds__(Tr::kNThreads, 1) FlashFwdKernel(const __grid_constant__ FlashParams p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int MT = Tr::kMTiles;
  constexpr int NT = Tr::kNTiles;
  constexpr int DT = Tr::kDTiles;
  constexpr int KS = Tr::kKSteps;
  constexpr int CPR = Tr::kChunksPerRow;
  constexpr int M = Tr::kSwzMask;
  constexpr int RPW = Tr::kRowsPerWarp;
  constexpr int S = Tr::kKVStages;
  constexpr uint32_t kStageBytes = Tr::kStageBytes;
  constexpr uint32_t kVOff = Tr::kSmemKElems * 2;  // V_s after K_s

  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  const uint32_t sK0 = ptx::SmemAddr(sQ + Tr::kSmemQElems);  // K of stage 0

  const int m_block = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int q_start = p.cu_seqlens_q[b];
  const int s_q = p.cu_seqlens_q[b + 1] - q_start;
  const int m0 = m_block * BM;
  if (m0 >= s_q) return;
  int k_start = 0;
  int s_k;
  const int32_t* pages = nullptr;  // paged: this sequence's page list
  if constexpr (kPaged) {
    s_k = p.seqlens_k[b];
    pages = p.page_indices + p.page_indptr[b];
  } else {
    k_start = p.cu_seqlens_k[b];
    s_k = p.cu_seqlens_k[b + 1] - k_start;
  }
  const int hk = h / p.heads_per_kv;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int off = s_k - s_q;
  const int m_last = min(m0 + BM, s_q) - 1;

  const T* gq = reinterpret_cast<const T*>(p.q) + int64_t(q_start) * p.q_row_stride + h * D;
  const T* gk = reinterpret_cast<const T*>(p.k) + int64_t(k_start) * p.k_row_stride + hk * D;
  const T* gv = reinterpret_cast<const T*>(p.v) + int64_t(k_start) * p.v_row_stride + hk * D;
  T* go = reinterpret_cast<T*>(p.o) + int64_t(q_start) * p.o_row_stride + h * D;
  float* glse = p.lse != nullptr ? p.lse + int64_t(h) * p.total_q + q_start : nullptr;

  // Keys any row of this block may see: [n_lo, n_hi).
  int n_lo = 0;
  int n_hi = s_k;
  if (p.has_left) n_lo = max(0, m0 + off - p.left);
  if (p.has_right) n_hi = min(s_k, m_last + off + p.right + 1);
  if (n_hi <= n_lo) {
    // No row of this block sees a key: o = 0, lse = -inf.
    const int rows = m_last - m0 + 1;
    for (int idx = tid; idx < rows * CPR; idx += Tr::kNThreads) {
      const int r = idx / CPR;
      const int c = idx % CPR;
      *reinterpret_cast<uint4*>(go + int64_t(m0 + r) * p.o_row_stride + c * 8) = make_uint4(0, 0, 0, 0);
    }
    if (glse != nullptr) {
      for (int r = tid; r < rows; r += Tr::kNThreads) glse[m0 + r] = -INFINITY;
    }
    return;
  }
  const int nb_min = n_lo / BN;
  const int nb_max = (n_hi + BN - 1) / BN;

  // Per-thread ldmatrix coordinates (see the fragment layouts of mma.m16n8k16).
  const int wrow = warp * RPW;
  const int swz_key = Tr::SwzKey(lane & 7);
  // Q (A operand): row lane%16, chunk +lane/16.
  const int q_row = wrow + (lane & 15);
  const int q_y = ((lane >> 4) ^ swz_key) & M;
  // K (B operand, non-transposed): key lane%8 + 8*(lane/16), chunk +(lane/8)%2.
  const int k_row = (lane & 7) + 8 * (lane >> 4);
  const int k_y = (((lane >> 3) & 1) ^ swz_key) & M;
  // V (B operand, transposed): key lane%8 + 8*((lane/8)%2), chunk +lane/16.
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int v_y = ((lane >> 4) ^ swz_key) & M;
  const uint32_t sQ_addr = ptx::SmemAddr(sQ) + q_row * CPR * 16;
  const uint32_t sK_addr = sK0 + k_row * CPR * 16;           // + stage offset
  const uint32_t sV_addr = sK0 + kVOff + v_row * CPR * 16;   // + stage offset

  const TileLoader<Tr, BN> kv_loader(tid, p.k_row_stride);  // k and v rows share a stride
  const T* gk_thr = gk + kv_loader.goff;
  const T* gv_thr = gv + kv_loader.goff;
  // Tile loads of K, of V, or of both (K into dst, V into dst + kVOff), keys from n0.
  auto load_k = [&](uint32_t dst, int n0) {
    if constexpr (kPaged) {
      kv_loader.template LoadPaged<false>(dst, gk, 0, nullptr, p.k_row_stride, n0, s_k, tid, pages,
                                          p.page_size, p.page_shift);
    } else {
      kv_loader.LoadFrom(dst, gk_thr, gk, p.k_row_stride, n0, s_k, tid);
    }
  };
  auto load_v = [&](uint32_t dst, int n0) {
    if constexpr (kPaged) {
      kv_loader.template LoadPaged<false>(dst, gv, 0, nullptr, p.v_row_stride, n0, s_k, tid, pages,
                                          p.page_size, p.page_shift);
    } else {
      kv_loader.LoadFrom(dst, gv_thr, gv, p.v_row_stride, n0, s_k, tid);
    }
  };
  auto load_kv = [&](uint32_t dst, int n0) {
    if constexpr (kPaged) {
      kv_loader.template LoadPaged<true>(dst, gk, dst + kVOff, gv, p.k_row_stride, n0, s_k, tid,
                                         pages, p.page_size, p.page_shift);
    } else {
      kv_loader.LoadFrom(dst, gk_thr, gk, p.k_row_stride, n0, s_k, tid);
      kv_loader.LoadFrom(dst + kVOff, gv_thr, gv, p.v_row_stride, n0, s_k, tid);
    }
  };

  // Prologue: Q (one cp.async group), then the first key tiles, one group per tile, committed
  // even when empty so that group counts stay fixed: S = 1: K of the first tile; S >= 2: K and V
  // of the first S-1 tiles into stages 0..S-2. Tiles run from nb_max-1 down to nb_min; rows at or
  // past s_k (the varlen tail of the first tile) are zero-filled.
  // Paged with a K/V ring: the page numbers of the rows of tile t are copied by cp.async (4 bytes
  // per row, no register held, no wait) into slot t % 4 of a shared-memory table after the ring
  // (FlashPagedTableBytes), kLead = 2S-2 tiles ahead of the loop iteration, so they are in a group
  // that `cp.async.wait_group S-2` has completed by the iteration that refills tile t (t + S - 1).
  // A slot is rewritten (tile t - 4, at iteration t - 4 + kLead) only after that read, for S <= 4.
  constexpr bool kPageTable = kPaged && S >= 2;
  constexpr int kLead = 2 * S - 2;
  static_assert(!kPageTable || S <= 4, "");
  const uint32_t sPg = ptx::SmemAddr(smem_raw + Tr::kSmemBytes);
  const int32_t* sPgPtr = reinterpret_cast<const int32_t*>(smem_raw + Tr::kSmemBytes);
  auto copy_pages = [&](int t) {  // rows of tile t >= nb_min
    if (tid < BN) {
      const int j = t * BN + tid;
      const bool ok = j < s_k;
      const int32_t* src =
          ok ? pages + (p.page_shift >= 0 ? (j >> p.page_shift) : (j / p.page_size)) : p.page_indices;
      ptx::CpAsync4(sPg + ((t & 3) * BN + tid) * 4, src, ok);
    }
  };
  TileLoader<Tr, BM>(tid, p.q_row_stride).Load(ptx::SmemAddr(sQ), gq, p.q_row_stride, m0, s_q, tid);
  if constexpr (kPageTable) {
    // Pages of the tiles refilled before the loop's own copies arrive: nb_max-S .. nb_max-2S+2.
#pragma unroll
    for (int i = S; i <= kLead; ++i) {
      if (nb_max - i >= nb_min) copy_pages(nb_max - i);
    }
  }
  ptx::CpAsyncCommit();
  if constexpr (S == 1) {
    load_k(sK0, (nb_max - 1) * BN);
    ptx::CpAsyncCommit();
  } else {
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
      const int nb = nb_max - 1 - st;
      if (nb >= nb_min) load_kv(sK0 + st * kStageBytes, nb * BN);
      ptx::CpAsyncCommit();
    }
  }
  constexpr int kPrologueKVGroups = S == 1 ? 1 : S - 1;

  uint32_t qf[Tr::kQInRegs ? MT : 1][Tr::kQInRegs ? KS : 1][4];
  if constexpr (Tr::kQInRegs) {
    ptx::CpAsyncWait<kPrologueKVGroups>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        ptx::LdMatrixX4(qf[mt][ks], sQ_addr + mt * 16 * CPR * 16 + SwzChunk<M>(2 * ks, q_y) * 16);
  }

  float acc_o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.0f;
  float row_max[MT][2];
  float row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }
  const float sl2 = p.scale_log2;

  uint32_t stage = 0;  // byte offset of the stage tile nb is in (S >= 2)
  for (int nb = nb_max - 1; nb >= nb_min; --nb) {
    const int n0 = nb * BN;
    if constexpr (S == 1) {
      ptx::CpAsyncWait<0>();
      __syncthreads();  // K(nb) visible to all; every warp is done with V(nb+1)
      load_v(sK0 + kVOff, n0);
      ptx::CpAsyncCommit();
    } else {
      // Groups committed after tile nb's: S-2 (one per later tile, empty past the last).
      ptx::CpAsyncWait<S - 2>();
      __syncthreads();  // K(nb), V(nb) visible to all; every warp is done with the previous stage
      // Refill the stage the previous tile used with tile nb-(S-1).
      const uint32_t refill = stage == 0 ? (S - 1) * kStageBytes : stage - kStageBytes;
      const int nb_next = nb - (S - 1);
      if constexpr (kPageTable) {
        if (nb_next >= nb_min) {
          kv_loader.template LoadRows<true>(sK0 + refill, gk, sK0 + refill + kVOff, gv,
                                            p.k_row_stride, sPgPtr + (nb_next & 3) * BN,
                                            nb_next * BN, s_k, p.page_size, p.page_shift, tid);
        }
        if (nb - kLead >= nb_min) copy_pages(nb - kLead);
      } else {
        if (nb_next >= nb_min) load_kv(sK0 + refill, nb_next * BN);
      }
      ptx::CpAsyncCommit();
    }

    // S = Q K^T
    float acc_s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Tr::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[mt][e] = qf[mt][ks][e];
        } else {
          ptx::LdMatrixX4(qa[mt], sQ_addr + mt * 16 * CPR * 16 + SwzChunk<M>(2 * ks, q_y) * 16);
        }
      }
#pragma unroll
      for (int nt2 = 0; nt2 < NT / 2; ++nt2) {
        uint32_t kb[4];
        ptx::LdMatrixX4(kb, sK_addr + stage + nt2 * 16 * CPR * 16 + SwzChunk<M>(2 * ks, k_y) * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::Mma16816<T>(acc_s[mt][2 * nt2], qa[mt], kb[0], kb[1]);
          ptx::Mma16816<T>(acc_s[mt][2 * nt2 + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

    // Mask only the tiles that need it: the sequence tail and causal/window boundaries.
    const bool need_mask = (n0 + BN > s_k) || (p.has_right && n0 + BN - 1 > m0 + off + p.right) ||
                           (p.has_left && n0 < m_last + off - p.left);
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = m0 + wrow + mt * 16 + (lane >> 2) + 8 * hf;
          const int lo = p.has_left ? row + off - p.left : INT_MIN;
          const int hi = p.has_right ? min(s_k - 1, row + off + p.right) : s_k - 1;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = n0 + nt * 8 + 2 * (lane & 3) + e;
              if (col < lo || col > hi) acc_s[mt][nt][2 * hf + e] = -INFINITY;
            }
        }
    }

    if constexpr (S == 1) {
      ptx::CpAsyncWait<0>();
      __syncthreads();  // V(nb) visible; every warp is done with K(nb)
      if (nb > nb_min) {
        load_k(sK0, n0 - BN);
        ptx::CpAsyncCommit();
      }
    }

    // Online softmax (log2 domain, scale folded in), P packed to T as the A operand of PV.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = row_max[mt][hf];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * hf], acc_s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float ms = (mx == -INFINITY) ? 0.0f : mx * sl2;
        const float corr = exp2f(row_max[mt][hf] * sl2 - ms);
        row_max[mt][hf] = mx;
        float sum = row_sum[mt][hf] * corr;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc_o[mt][dt][2 * hf] *= corr;
          acc_o[mt][dt][2 * hf + 1] *= corr;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = exp2f(fmaf(acc_s[mt][nt][2 * hf + e], sl2, -ms));
            acc_s[mt][nt][2 * hf + e] = pe;
            sum += pe;
          }
        row_sum[mt][hf] = sum;
      }
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = ptx::Pack2<T>(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
        pa[mt][1] = ptx::Pack2<T>(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
        pa[mt][2] = ptx::Pack2<T>(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
        pa[mt][3] = ptx::Pack2<T>(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int nd2 = 0; nd2 < DT / 2; ++nd2) {
        uint32_t vb[4];
        ptx::LdMatrixX4Trans(vb,
                             sV_addr + stage + kk * 16 * CPR * 16 + SwzChunk<M>(2 * nd2, v_y) * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::Mma16816<T>(acc_o[mt][2 * nd2], pa[mt], vb[0], vb[1]);
          ptx::Mma16816<T>(acc_o[mt][2 * nd2 + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    if constexpr (S > 1) stage = stage == (S - 1) * kStageBytes ? 0 : stage + kStageBytes;
  }

  // Epilogue: normalise, write LSE, stage O through this warp's own Q rows in shared memory
  // (only this warp ever reads them) and store 16-byte chunks.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = row_sum[mt][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool any = sum > 0.0f;
      const float inv = any ? 1.0f / sum : 0.0f;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        acc_o[mt][dt][2 * hf] *= inv;
        acc_o[mt][dt][2 * hf + 1] *= inv;
      }
      const int row = m0 + wrow + mt * 16 + (lane >> 2) + 8 * hf;
      if (glse != nullptr && (lane & 3) == 0 && row < s_q) {
        glse[row] = any ? row_max[mt][hf] * p.scale + __logf(sum) : -INFINITY;
      }
    }
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = wrow + mt * 16 + (lane >> 2) + 8 * hf;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<uint32_t*>(sQ + Tr::Offset(r, dt) + 2 * (lane & 3)) =
            ptx::Pack2<T>(acc_o[mt][dt][2 * hf], acc_o[mt][dt][2 * hf + 1]);
      }
    }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < RPW * CPR / 32; ++it) {
    const int idx = lane + it * 32;
    const int r = idx / CPR;
    const int c = idx % CPR;
    const int grow = m0 + wrow + r;
    if (grow < s_q) {
      *reinterpret_cast<uint4*>(go + int64_t(grow) * p.o_row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + Tr::Offset(wrow + r, c));
    }
  }
}

}  // namespace attn::kernels::cuda
