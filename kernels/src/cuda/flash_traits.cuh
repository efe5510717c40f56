// Tile traits of the flash forward kernel, per head dim and dtype.
#pragma once

#include <cstdint>

namespace attn::kernels::cuda {

// KVStages_ (S) selects the K/V schedule of the main loop:
//   S = 1: one K and one V tile buffer, loaded alternately (K(j+1) during PV(j), V(j) during
//          QK(j)); two barriers per key tile. Kept for d=256, where a K/V ring does not fit twice
//          per SM.
//   S >= 2: a ring of S stages, each a (K, V) tile pair; the loads of tile j+S-1 are issued while
//          tile j is computed (cp.async.wait_group S-2), one barrier per key tile.
template <int D_, int BlockM_, int BlockN_, int NWarps_, bool QInRegs_, int KVStages_, typename T_>
struct FlashTraitsBase {
  using T = T_;
  static constexpr int kHeadDim = D_;
  static constexpr int kBlockM = BlockM_;
  static constexpr int kBlockN = BlockN_;
  static constexpr int kNWarps = NWarps_;
  static constexpr int kNThreads = 32 * NWarps_;
  static constexpr int kRowsPerWarp = BlockM_ / NWarps_;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles each warp owns
  static constexpr int kNTiles = BlockN_ / 8;         // n8 tiles of S
  static constexpr int kDTiles = D_ / 8;              // n8 tiles of O
  static constexpr int kKSteps = D_ / 16;             // k16 steps of Q K^T
  static constexpr bool kQInRegs = QInRegs_;
  static constexpr int kKVStages = KVStages_;
  static_assert(KVStages_ >= 1 && KVStages_ <= 4, "1 (alternating K/V) to 4 ring stages");

  // Shared memory: rows of kHeadDim 16-bit elements, in 16-byte chunks (kChunksPerRow per row),
  // chunk index XOR-swizzled by the row so that the 8 row addresses of one ldmatrix phase and the
  // cp.async stores hit 8 distinct 16-byte bank groups.
  static constexpr int kChunksPerRow = D_ / 8;
  static_assert(kChunksPerRow % 4 == 0, "head dim must be a multiple of 32");
  static constexpr int kSwzMask = (kChunksPerRow % 8 == 0) ? 7 : 3;
  static constexpr int kSmemQElems = kBlockM * kHeadDim;
  static constexpr int kSmemKElems = kBlockN * kHeadDim;
  // Layout: Q, then stage s = 0..S-1 as K_s, V_s (S = 1: Q, K, V).
  static constexpr int kStageBytes = 2 * kSmemKElems * 2;
  static constexpr int kSmemBytes = kSmemQElems * 2 + kKVStages * kStageBytes;
  // sm_90: 227 KB per block (opt-in), 228 KB per SM with 1 KB reserved per block. Every config
  // below keeps two blocks per SM (the 255-register budget of 4 warps allows two).
  static_assert(kSmemBytes <= 227 * 1024, "over the sm_90 per-block shared-memory limit");

  static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0, "");
  static_assert(D_ % 16 == 0, "");

  // The XOR key of a row (depends only on row % 8).
  __device__ __forceinline__ static int SwzKey(int row) {
    return kSwzMask == 7 ? (row & 7) : ((row >> 1) & 3);
  }
  // Element offset of (row, chunk) in a tile.
  __device__ __forceinline__ static int Offset(int row, int chunk) {
    const int c = (chunk & ~kSwzMask) | ((chunk ^ SwzKey(row)) & kSwzMask);
    return (row * kChunksPerRow + c) * 8;
  }
};

// Tile and stage choice per head dim (FA2-like; each warp owns 16*kMTiles query rows). Shared
// memory per block (Q + S stages of K and V) and blocks per SM (by shared memory; registers allow
// two):
//   d=32:  128x128, S=3: 8 + 3*16 =  56 KB
//   d=64:  128x128, S=3: 16 + 3*32 = 112 KB, 2/SM (S=2: 80 KB)
//   d=96:  128x64,  S=3: 24 + 3*24 =  96 KB, 2/SM
//   d=128: 128x64,  S=2: 32 + 2*32 =  96 KB, 2/SM (S=3 would be 128 KB, 1/SM)
//   d=256: 64x64,   S=1: 32 + 64   =  96 KB, 2/SM (a 2-stage ring would be 160 KB, 1/SM)
// Measured on H200 (bench/results/2026-11-29-flash-fwd-h200-v3.md, s >= 1k): d=64 S=3 is +3%
// (median) over S=1 and +0.5% over S=2; d=128 S=2 is within +-1% of S=1 (run-to-run spread) and
// S=3 (one block per SM) is 15-22% slower.
template <int D, typename T>
struct FlashTraits;
template <typename T>
struct FlashTraits<32, T> : FlashTraitsBase<32, 128, 128, 4, true, 3, T> {};
template <typename T>
struct FlashTraits<64, T> : FlashTraitsBase<64, 128, 128, 4, false, 3, T> {};
template <typename T>
struct FlashTraits<96, T> : FlashTraitsBase<96, 128, 64, 4, false, 3, T> {};
template <typename T>
struct FlashTraits<128, T> : FlashTraitsBase<128, 128, 64, 4, false, 2, T> {};
template <typename T>
struct FlashTraits<256, T> : FlashTraitsBase<256, 64, 64, 4, false, 1, T> {};

}  // namespace attn::kernels::cuda
