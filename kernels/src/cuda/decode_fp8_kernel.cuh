// Split-KV decode over FP8 K/V (e4m3 codes with a float32 scale per (sequence, KV head)), device
// code. The CTA, warp and split structure is the 16-bit kernel's (decode_kernel.cuh), through the
// same device functions (decode_block.cuh) and combine kernel; what differs is how the bytes reach
// the tensor cores:
//  - K and V tiles stream into shared memory as e4m3 codes (half the bytes of a 16-bit tile of as
//    many keys, so tiles have twice the keys: the same bytes in flight per warp).
//  - The products run in fp16 with fp32 accumulation (mma.sync m16n8k16): every e4m3 value is an
//    fp16 value, so a code converts exactly (cvt.f16x2.e4m3x2, two codes per instruction) right
//    after its ldmatrix, in registers; nothing is scaled per element.
//  - K (S = Q K^T): a plain ldmatrix of 8 keys x 16 codes gives lane (g, c) the 4 codes
//    16ks + 4c .. 4c+3 of key g, which are the B fragment of one k16 step if the head dims of the
//    step are taken in the order 0,1,4,5,8,9,12,13 | 2,3,6,7,10,11,14,15 (logical k = 2c, 2c+1,
//    2c+8, 2c+9 <-> dims 4c .. 4c+3). Q's A fragments are built once in that order.
//  - V (O += P V): ldmatrix.trans of the codes viewed as 16-bit pairs gives lane (g, c) keys 2c and
//    2c+1 of the dims 2g and 2g+1; one byte permute splits them into the B fragments of two
//    n8 output tiles, one of the chunk's even dims and one of its odd dims. O's columns are
//    reordered back when the warps merge through shared memory.
//  - Scales: the k scale folds into the softmax scale (one multiply per CTA), the v scale into the
//    final normalisation. q of bfloat16 (which fp16 may not hold) is scaled per row by a power of
//    two into fp16's range first, undone in the same per-row softmax scale.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "decode_block.cuh"
#include "decode_params.h"
#include "ptx.cuh"
#include "ptx_decode.cuh"

namespace attn::kernels::cuda {
namespace decode {

template <int D_, typename T_>
struct DecodeFp8Traits {
  using T = T_;  // of q and o
  static constexpr int kHeadDim = D_;
  static constexpr int kWarps = kDecodeWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = kDecodeRows;
  static constexpr int kWarpN = DecodeFp8WarpN(D_);
  static constexpr int kStages = DecodeFp8Stages(D_);
  static constexpr int kCPR = D_ / 16;  // 16-byte chunks (16 codes) per K/V row
  static_assert(kCPR == 4 || kCPR % 8 == 0, "head dim 64, 128 or 256");
  static constexpr int kSwzMask = (kCPR % 8 == 0) ? 7 : 3;
  static constexpr int kTileBytes = kWarpN * D_;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile, then V tile
  static constexpr int kWarpRingBytes = kStages * kStageBytes;
  static constexpr int kQRowBytes = DecodeFp8QRowBytes(D_);
  static constexpr int kQBytes = kRows * kQRowBytes;
  static constexpr int kMergeStride = DecodeMergeStride(D_);
  static constexpr int kSmemBytes = DecodeFp8SmemBytes(D_);
  static constexpr int kMinBlocks = DecodeFp8MinBlocks(D_);
  static constexpr bool kQInRegs = DecodeFp8QInRegs(D_);
  static constexpr int kNT = kWarpN / 8;    // n8 tiles of S
  static constexpr int kKS = D_ / 16;       // k16 steps of Q K^T
  static constexpr int kDT = D_ / 8;        // n8 tiles of O (even and odd dims of each chunk)
  static constexpr int kPVK = kWarpN / 16;  // k16 steps of P V
  static constexpr int kCopyIters = kWarpN * kCPR / 32;
  static_assert(kWarpN == 32, "ldmatrix row addresses: lane l supplies key l of the tile");
  static_assert(kWarpN * kCPR % 32 == 0, "");

  __device__ __forceinline__ static int SwzKey(int row) {
    return kSwzMask == 7 ? (row & 7) : ((row >> 1) & 3);
  }
  // Byte offset of (row, chunk) in a tile of kCPR chunks per row.
  __device__ __forceinline__ static uint32_t Offset(int row, int chunk) {
    const int c = (chunk & ~kSwzMask) | ((chunk ^ SwzKey(row)) & kSwzMask);
    return static_cast<uint32_t>((row * kCPR + c) * 16);
  }
};

// Four consecutive 16-bit q values (two 32-bit words) as floats.
template <typename T>
__device__ __forceinline__ void QuadToFloat(uint2 w, float (&f)[4]) {
  if constexpr (std::is_same_v<T, __half>) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  } else {
    f[0] = __uint_as_float(w.x << 16);
    f[1] = __uint_as_float(w.x & 0xFFFF0000u);
    f[2] = __uint_as_float(w.y << 16);
    f[3] = __uint_as_float(w.y & 0xFFFF0000u);
  }
}

template <typename Tr, bool kPaged, bool kLastSplitMerges>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocks)
    DecodeFp8Kernel(const __grid_constant__ DecodeParams p) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  constexpr int W = Tr::kWarpN;
  constexpr int S = Tr::kStages;
  constexpr int CPR = Tr::kCPR;
  constexpr int NT = Tr::kNT;
  constexpr int KS = Tr::kKS;
  constexpr int DT = Tr::kDT;
  constexpr int NW = Tr::kWarps;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t sQ = ptx::SmemAddr(smem_raw);
  const uint32_t sRing = sQ + Tr::kQBytes;

  ptx::GridDependencyLaunchDependents();  // as DecodeKernel
  DecodeBlock blk = DecodeBlockOf(p);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int G = p.heads_per_kv;
  if (!LocateDecodeRows<Tr>(p, blk)) return;
  const float k_scale = p.k_descale[int64_t(blk.b) * p.num_kv_heads + blk.hk];
  const float v_scale = p.v_descale[int64_t(blk.b) * p.num_kv_heads + blk.hk];
  LocateDecodeKeys<Tr, kPaged>(p, blk);

  // Q: 16 packed rows of D 16-bit values, rows padded to kQRowBytes, zero past the valid rows.
  const T* gq = reinterpret_cast<const T*>(p.q);
  constexpr int kQChunks = D / 8;
  for (int idx = tid; idx < Tr::kRows * kQChunks; idx += Tr::kThreads) {
    const int r = idx / kQChunks;
    const int c = idx % kQChunks;
    const int pr = blk.m0 + r;
    const bool ok = pr < blk.rows_valid;
    const int i = pr / G;
    const int h = blk.hk * G + (pr - i * G);
    const T* src = ok ? gq + int64_t(blk.q_start + i) * p.q_row_stride + int64_t(h) * D + c * 8 : gq;
    ptx::CpAsync16(sQ + r * Tr::kQRowBytes + c * 16, src, ok);
  }
  ptx::CpAsyncCommit();

  const int my_tiles = blk.ntiles > warp ? (blk.ntiles - warp + NW - 1) / NW : 0;
  const uint32_t sWarp = sRing + warp * Tr::kWarpRingBytes;
  const uint8_t* gk = static_cast<const uint8_t*>(p.k) + int64_t(blk.hk) * D;
  const uint8_t* gv = static_cast<const uint8_t*>(p.v) + int64_t(blk.hk) * D;
  const int64_t kv_stride = p.k_row_stride;  // elements = bytes

  auto tile_start = [&](int k) { return blk.tile0 + (warp + k * NW) * W; };
  auto key_ok = [&](int j) { return j >= blk.c_lo && j < blk.c_hi; };
  auto row_index = [&](int k, int page) -> int {
    const int j = tile_start(k) + lane;
    if (!key_ok(j)) return -1;
    if constexpr (kPaged) {
      return page * p.page_size + InPage(j, p.page_size, p.page_shift);
    } else {
      return blk.k_start + j;
    }
  };
  auto page_of = [&](int k) -> int {
    if constexpr (kPaged) {
      const int j = tile_start(k) + lane;
      return key_ok(j) ? PageOf(blk.pages, j, p.page_size, p.page_shift) : 0;
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
      const bool ok = rr >= 0;
      const int64_t goff = int64_t(ok ? rr : 0) * kv_stride + c * 16;
      ptx::CpAsync16(stage_addr + Tr::Offset(r, c), gk + goff, ok);
      ptx::CpAsync16(stage_addr + Tr::kTileBytes + Tr::Offset(r, c), gv + goff, ok);
    }
  };

  int next_page = RingPrologue<Tr, kPaged>(my_tiles, sWarp, page_of, issue);
  int lo[2], hi[2];
  RowKeyBounds(p, blk, lane, lo, hi);

  ptx::CpAsyncWait<S - 1>();
  __syncthreads();

  // Q's A fragments in fp16, the head dims of each k16 step in the order of the K fragments
  // (header): qf[ks] = {row g: dims 4c, 4c+1; row g+8: 4c, 4c+1; row g: 4c+2, 4c+3; row g+8: 4c+2,
  // 4c+3} of the step (lane = 4g + c). A bfloat16 row is first scaled by 2^e[hf], e such that its
  // largest |q| lies in [128, 256) (fp16 then holds it as bfloat16 did), undone in its softmax
  // scale sl2[hf], which also carries the k scale.
  const int g = lane >> 2;
  const int c4 = 4 * (lane & 3);
  const uint8_t* q_row0 = smem_raw + g * Tr::kQRowBytes + c4 * 2;
  const uint8_t* q_row1 = q_row0 + 8 * Tr::kQRowBytes;
  int e[2] = {0, 0};
  if constexpr (!std::is_same_v<T, __half>) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint8_t* row = hf == 0 ? q_row0 : q_row1;
      float mx = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        float f[4];
        QuadToFloat<T>(*reinterpret_cast<const uint2*>(row + 32 * ks), f);
#pragma unroll
        for (int i = 0; i < 4; ++i) mx = fmaxf(mx, fabsf(f[i]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      int x = 0;
      if (mx > 0.0f && mx <= 3.0e38f) frexpf(mx, &x);  // mx = m * 2^x, m in [0.5, 1)
      e[hf] = mx > 0.0f && mx <= 3.0e38f ? max(-126, min(64, 8 - x)) : 0;
    }
  }
  float sl2[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) sl2[hf] = ldexpf(p.scale_log2 * k_scale, -e[hf]);
  uint32_t qf[Tr::kQInRegs ? KS : 1][4];
  // !kQInRegs (d=256): the fragments in this warp's part of shared memory, lane-contiguous.
  const uint32_t sQFrag = sRing + NW * Tr::kWarpRingBytes + warp * (Tr::kQInRegs ? 0 : KS * 512);
  {
    const float qs0 = ldexpf(1.0f, e[0]);
    const float qs1 = ldexpf(1.0f, e[1]);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint2 w0 = *reinterpret_cast<const uint2*>(q_row0 + 32 * ks);
      const uint2 w1 = *reinterpret_cast<const uint2*>(q_row1 + 32 * ks);
      uint32_t fr[4];
      if constexpr (std::is_same_v<T, __half>) {
        fr[0] = w0.x;
        fr[1] = w1.x;
        fr[2] = w0.y;
        fr[3] = w1.y;
      } else {
        float f0[4], f1[4];
        QuadToFloat<T>(w0, f0);
        QuadToFloat<T>(w1, f1);
        fr[0] = ptx::Pack2<__half>(f0[0] * qs0, f0[1] * qs0);
        fr[1] = ptx::Pack2<__half>(f1[0] * qs1, f1[1] * qs1);
        fr[2] = ptx::Pack2<__half>(f0[2] * qs0, f0[3] * qs0);
        fr[3] = ptx::Pack2<__half>(f1[2] * qs1, f1[3] * qs1);
      }
      if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qf[ks][i] = fr[i];
      } else {
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(sQFrag + (ks * 32 + lane) * 16),
                     "r"(fr[0]), "r"(fr[1]), "r"(fr[2]), "r"(fr[3])
                     : "memory");
      }
    }
  }
  if constexpr (!Tr::kQInRegs) __syncwarp();

  float acc_o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[dt][i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};

  // ldmatrix addresses: K (plain): lane l gives key l of the tile at chunk ks; V (trans): lane l
  // gives key 16kk + 8 * ((l >> 3) & 1) + (l & 7) at chunk j + (l >> 4).
  const int v_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int v_chunk = lane >> 4;

  uint32_t stage = 0;
  for (int k = 0; k < my_tiles; ++k) {
    RingAwaitAndRefill<Tr, kPaged>(k, my_tiles, sWarp, stage, next_page, page_of, issue);
    const uint32_t sK = sWarp + stage;
    const uint32_t sV = sK + Tr::kTileBytes;
    const int t0 = tile_start(k);

    // S = Q K^T over this tile's W keys: per k16 step one ldmatrix.x4 of the four n8 key tiles.
    float acc_s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[nt][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t qa[4];
      if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qa[i] = qf[ks][i];
      } else {
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(qa[0]), "=r"(qa[1]), "=r"(qa[2]), "=r"(qa[3])
                     : "r"(sQFrag + (ks * 32 + lane) * 16));
      }
      uint32_t kb[4];
      ptx::LdMatrixX4(kb, sK + Tr::Offset(lane, ks));
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        ptx::Mma16816<__half>(acc_s[nt], qa, ptx::E4m3x2ToHalf2(uint16_t(kb[nt] & 0xFFFF)),
                              ptx::E4m3x2ToHalf2(uint16_t(kb[nt] >> 16)));
      }
    }

    // Mask, then the online softmax in log2 units (per-row scale sl2).
    SoftmaxTile(acc_s, acc_o, row_max, row_sum, sl2, lo, hi, t0, lane);

    // O += P V: per k16 step and pair of 16-dim chunks one ldmatrix.x4.trans, giving the B
    // fragments of four n8 tiles (even and odd dims of each chunk).
#pragma unroll
    for (int kk = 0; kk < Tr::kPVK; ++kk) {
      uint32_t pa[4];
      pa[0] = ptx::Pack2<__half>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
      pa[1] = ptx::Pack2<__half>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
      pa[2] = ptx::Pack2<__half>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
      pa[3] = ptx::Pack2<__half>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
#pragma unroll
      for (int j = 0; j < CPR; j += 2) {
        uint32_t vb[4];
        ptx::LdMatrixX4Trans(vb, sV + Tr::Offset(16 * kk + v_row, j + v_chunk));
        const uint32_t lo_keys0 = ptx::InterleaveBytePairs(vb[0]);  // chunk j, keys 2c, 2c+1
        const uint32_t hi_keys0 = ptx::InterleaveBytePairs(vb[1]);  // chunk j, keys 2c+8, 2c+9
        const uint32_t lo_keys1 = ptx::InterleaveBytePairs(vb[2]);  // chunk j+1
        const uint32_t hi_keys1 = ptx::InterleaveBytePairs(vb[3]);
        ptx::Mma16816<__half>(acc_o[2 * j], pa, ptx::E4m3x2ToHalf2(uint16_t(lo_keys0 & 0xFFFF)),
                              ptx::E4m3x2ToHalf2(uint16_t(hi_keys0 & 0xFFFF)));
        ptx::Mma16816<__half>(acc_o[2 * j + 1], pa, ptx::E4m3x2ToHalf2(uint16_t(lo_keys0 >> 16)),
                              ptx::E4m3x2ToHalf2(uint16_t(hi_keys0 >> 16)));
        ptx::Mma16816<__half>(acc_o[2 * j + 2], pa, ptx::E4m3x2ToHalf2(uint16_t(lo_keys1 & 0xFFFF)),
                              ptx::E4m3x2ToHalf2(uint16_t(hi_keys1 & 0xFFFF)));
        ptx::Mma16816<__half>(acc_o[2 * j + 3], pa, ptx::E4m3x2ToHalf2(uint16_t(lo_keys1 >> 16)),
                              ptx::E4m3x2ToHalf2(uint16_t(hi_keys1 >> 16)));
      }
    }
    stage = RingNextStage<Tr>(stage);
  }

  // Merge the warps as DecodeKernel does; O's columns back in order: tiles 2j and 2j + 1 of a
  // thread hold dims 16j + c4 + {0, 2} and 16j + c4 + {1, 3} of its rows.
  ptx::CpAsyncWait<0>();
  __syncthreads();
  const MergeSmem sm = MergeSmemOf<Tr>(smem_raw);
  float* sOw = sm.o + warp * Tr::kRows * Tr::kMergeStride;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = g + 8 * hf;
#pragma unroll
    for (int j = 0; j < CPR; ++j) {
      *reinterpret_cast<float4*>(sOw + r * Tr::kMergeStride + 16 * j + c4) =
          make_float4(acc_o[2 * j][2 * hf], acc_o[2 * j + 1][2 * hf], acc_o[2 * j][2 * hf + 1],
                      acc_o[2 * j + 1][2 * hf + 1]);
    }
    StoreWarpRowStats<Tr>(sm, warp, lane, r, row_max[hf], sl2[hf], row_sum[hf]);
  }
  __syncthreads();
  // The v scale with the normalisation.
  MergeWarpsAndStore<Tr, kLastSplitMerges>(p, blk, sm, [v_scale](float l) { return v_scale / l; });
}

}  // namespace decode
}  // namespace attn::kernels::cuda
