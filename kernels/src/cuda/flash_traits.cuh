// Tile traits of the flash forward kernel, per head dim and dtype.
#pragma once

#include <cstdint>

namespace attn::kernels::cuda {

template <int D_, int BlockM_, int BlockN_, int NWarps_, bool QInRegs_, typename T_>
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
  // K and V are single tiles each, loaded alternately with cp.async, so the load of one always
  // overlaps the matrix product of the other (two stages in flight: K(j-1) during PV(j), V(j)
  // during QK(j)).
  static constexpr int kStages = 2;

  // Shared memory: rows of kHeadDim 16-bit elements, in 16-byte chunks (kChunksPerRow per row),
  // chunk index XOR-swizzled by the row so that the 8 row addresses of one ldmatrix phase and the
  // cp.async stores hit 8 distinct 16-byte bank groups.
  static constexpr int kChunksPerRow = D_ / 8;
  static_assert(kChunksPerRow % 4 == 0, "head dim must be a multiple of 32");
  static constexpr int kSwzMask = (kChunksPerRow % 8 == 0) ? 7 : 3;
  static constexpr int kSmemQElems = kBlockM * kHeadDim;
  static constexpr int kSmemKElems = kBlockN * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQElems + 2 * kSmemKElems) * 2;

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

// Tile choice per head dim (FA2-like; each warp owns 16*kMTiles query rows).
template <int D, typename T>
struct FlashTraits;
template <typename T>
struct FlashTraits<32, T> : FlashTraitsBase<32, 128, 128, 4, true, T> {};
template <typename T>
struct FlashTraits<64, T> : FlashTraitsBase<64, 128, 128, 4, false, T> {};
template <typename T>
struct FlashTraits<96, T> : FlashTraitsBase<96, 128, 64, 4, false, T> {};
template <typename T>
struct FlashTraits<128, T> : FlashTraitsBase<128, 128, 64, 4, false, T> {};
template <typename T>
struct FlashTraits<256, T> : FlashTraitsBase<256, 64, 64, 4, false, T> {};

}  // namespace attn::kernels::cuda
