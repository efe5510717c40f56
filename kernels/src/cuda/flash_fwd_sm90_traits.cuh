// Tile shapes of the sm_90a forward kernel per head dim (flash_fwd_sm90_kernel.cuh).
//
// A CTA computes tiles of kBlockM = 64 * kConsumerWGs query rows of one (sequence, head), one after
// the other (persistent): warpgroup 0 is the producer (one thread issues every TMA load), the
// consumer warpgroups each own 64 rows of the tile and run the wgmma products (d=64: three, so a
// K/V tile serves 192 rows; d=128/256: two, for their larger register footprint).
// Q, K and V tiles live in shared memory as 64-element-wide slabs of 128-byte swizzled rows (one
// slab per 64 head-dim columns), the layout a TMA box with SWIZZLE_128B writes and the wgmma
// descriptors of ptx_sm90.cuh read. K/V stream through kStages stages.
#pragma once

#include <cstdint>
#include <type_traits>

namespace attn::kernels::cuda {

template <int D, typename T_, int kBlockN_, int kStages_, int kConsumerWGs_ = 2>
struct Sm90TraitsBase {
  using T = T_;
  static constexpr int kHeadDim = D;
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // The overlapped key loop: S of the next key tile issued with P V of this one, its softmax
  // running during that P V (this loop always gives K back early: it holds two stages at once).
  // d=256's wide tiling sets it (Sm90WideTraits).
  static constexpr bool kOverlap = false;
  // Key tiles that need no mask run in a loop of their own, compiled without it (the d=64 tilings
  // set it; see Sm90WideTraits).
  static constexpr bool kSplitMaskLoop = false;
  // Causal and right-windowed launches with a tile counter (FlashParams) deal their tiles to the
  // CTAs as they finish (Sm90ProduceDynamic) instead of in a fixed order. The code for it changes
  // how ptxas compiles the consumers' loop, for better or worse by head dim (H200, against the
  // fixed order's code): d=128 1-5% faster everywhere, d=64 3% faster causal at 1k-2k and 1-2%
  // slower non-causal, d=256 up to 3.7% slower (median 1.5%); the d=64/128 tilings set it.
  static constexpr bool kDynamicSchedule = false;
  // The plain key loop trims the key tiles at the edge of what each warpgroup's rows may see
  // (Sm90Consume): it skips those none of its rows may see, and computes the highest of the rest
  // in its first half only (S and P V of BN / 2 keys) where its rows see no key beyond (BN = 128
  // only: the m64n64 products).
  static constexpr bool kTrimEdgeTiles = false;
  // K and V read through the page table (FlashParams::page_*) instead of contiguous rows
  // (Sm90PagedTraits).
  static constexpr bool kPaged = false;
  // Every kExpFmaEvery-th group of 8 keys takes its exp2 on the FMA pipe (Sm90Softmax); 0: all on
  // MUFU. The FP8 kernel, which the MUFU pipe bounds, ships 4; here sm90_variants times it.
  static constexpr int kExpFmaEvery = 0;
  // Sm90Softmax's kSlack8: > 0 keeps a row's max (and skips O's rescale) until it grows by more
  // than kRescaleSlack8 / 8 in log2 units; sm90_variants times it.
  static constexpr int kRescaleSlack8 = 0;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kSlabs = D / 64;  // 64-column slabs per row
  // P V is issued as products of at most 128 output columns (the wgmma shapes generated).
  static constexpr int kPvN = D < 128 ? D : 128;
  static constexpr int kPvChunks = D / kPvN;

  static constexpr uint32_t kQBytes = uint32_t(kBlockM) * D * 2;
  static constexpr uint32_t kKVBytes = uint32_t(kBlockN) * D * 2;  // one K (or V) tile
  // Barriers: per Q buffer full and empty, then per stage K full, V full, K empty, V empty; then
  // the tile each Q buffer holds (Sm90Bars, Sm90TileSlot).
  static constexpr uint32_t kTileSlotBytes = 40;
  static constexpr uint32_t kBarBytes = 8 * (2 * 2 + 4 * kStages) + 2 * kTileSlotBytes;
  // Two Q buffers where shared memory allows: the next tile's Q then loads while this tile runs,
  // so a consumer warpgroup that finishes its tile early starts the next one at once instead of
  // waiting for the slowest warpgroup to release the shared Q (d=256: one buffer only).
  static constexpr int kQBufs =
      2 * kQBytes + 2 * kStages * kKVBytes + kBarBytes + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr uint32_t kQOff = 0;
  static constexpr uint32_t kKOff = kQBufs * kQBytes;
  static constexpr uint32_t kVOff = kKOff + kStages * kKVBytes;
  static constexpr uint32_t kBarOff = kVOff + kStages * kKVBytes;
  static constexpr uint32_t kSmemBytes = kBarOff + kBarBytes;
  // + slack to align the dynamic shared-memory base to 1024 bytes (the 128B swizzle atom).
  static constexpr uint32_t kSmemAlloc = kSmemBytes + 1024;

  // Register split (setmaxnreg): 128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= 64K.
  static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  // setmaxnreg moves registers within the CTA's allocation at launch, kThreads times the
  // per-thread count __launch_bounds__(kThreads, 1) caps ptxas at (65536 / kThreads, a multiple of
  // 8: 168 at 384 threads, 128 at 512): a split above it makes setmaxnreg.inc wait for ever.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= kThreads * kLaunchRegs,
                "register split above the launch allocation");

  static_assert(D % 64 == 0, "head dim must be a multiple of 64 (one 128-byte swizzle row)");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 176,
                "S = Q K^T uses the m64nN shapes of wgmma_ops.cuh");
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory per block");
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "tiles keep 1024-byte alignment");
};

// Two tilings per head dim. d=64/128: wide (3 consumer warpgroups, 192-row tiles) and narrow (2,
// 128 rows). Wide wins everywhere measured except short causal problems, where its larger diagonal
// tiles waste more (H200, bf16/fp16, s_q <= 1k causal: narrow 0.73-0.76x cuDNN against wide
// 0.63-0.70x; from 2k up wide is ahead). d=128 wide spills 88 bytes and still wins (median 0.91x
// against 0.86x cuDNN). d=256 has no room for a third warpgroup: its "wide" tiling has 80-key
// tiles (225 KiB of shared memory), its narrow one 64 (bench/sm90_variants, H200: 80 keys 1.8-4.6%
// faster non-causal at 2k-16k and causal at 4k-16k, level causal at 2k, 3.7% slower causal at
// 1k). d=64 and d=256's narrow tiling run their unmasked key tiles in a loop without the mask
// (kSplitMaskLoop: d=64 1-2% faster causal, level non-causal; d=256 0.6-1.8% faster); at d=128
// that loop spilled more (140 bytes against 88) and was 11-13% slower. d=256's wide tiling
// overlaps each key tile's softmax with the previous P V (kOverlap: 3.0-6.8% faster at every shape
// the wide tiling serves, 1k-16k non-causal and 2k-16k causal; at causal 1k the narrow plain
// loop stays 4% ahead of it). At d=64/128 the overlap loses to the plain loop with three
// warpgroups, which have no registers for it.
template <int D, typename T>
struct Sm90WideTraits;
template <typename T>
struct Sm90WideTraits<64, T> : Sm90TraitsBase<64, T, 128, 4, 3> {
  static constexpr bool kSplitMaskLoop = true;
  static constexpr bool kDynamicSchedule = true;
};
template <typename T>
struct Sm90WideTraits<128, T> : Sm90TraitsBase<128, T, 128, 2, 3> {
  static constexpr bool kDynamicSchedule = true;
  // A lazy rescale (P below 2^8 of its row's max weight; bf16 and fp16 hold it): 1.02-1.03x at
  // s = 1k-16k, level at 512 (H100, sm90_variants lazy_rescale / eager_rescale); d=64 and d=256
  // ran 0.97-1.00x with it.
  static constexpr int kRescaleSlack8 = 64;
};
template <typename T>
struct Sm90WideTraits<256, T> : Sm90TraitsBase<256, T, 80, 2, 2> {
  static constexpr bool kOverlap = true;
};

template <int D, typename T>
struct Sm90NarrowTraits;
template <typename T>
struct Sm90NarrowTraits<64, T> : Sm90TraitsBase<64, T, 128, 4, 2> {
  static constexpr bool kSplitMaskLoop = true;
  static constexpr bool kDynamicSchedule = true;
};
template <typename T>
struct Sm90NarrowTraits<128, T> : Sm90TraitsBase<128, T, 128, 2, 2> {
  static constexpr bool kDynamicSchedule = true;
};
template <typename T>
struct Sm90NarrowTraits<256, T> : Sm90TraitsBase<256, T, 64, 2, 2> {
  static constexpr bool kSplitMaskLoop = true;
};

// The wide tiling of launches with a causal or window mask. d=64 trims each warpgroup's edge key
// tiles there (kTrimEdgeTiles; H200, against the untrimmed tiling in the same run: causal 2k-4k
// +3-9%, and at causal 1k it overtakes the narrow tiling, +3%). It is a kernel of its own: compiled
// into the one unmasked launches run, the trim's code moved ptxas's schedule of the unmasked loop,
// 1.5-2% slower non-causal at every length. The d=64 narrow tiling and d=128 do without: there the
// trim measured -1.6% (d=64 narrow, causal 1k) and level (d=128 narrow), and d=128's wide tiling
// spilled more (128 bytes against 80) and was 2% slower non-causal.
template <int D, typename T>
struct Sm90TrimmedWideTraits : Sm90WideTraits<D, T> {
  static constexpr bool kTrimEdgeTiles = true;
};
template <int D, typename T>
using Sm90MaskedWideTraits =
    std::conditional_t<D == 64, Sm90TrimmedWideTraits<D, T>, Sm90WideTraits<D, T>>;

// A tiling reading K and V from page pools (Sm90ProducePaged): the producer's whole first warp
// loads, each lane a chunk of rows of one page, and one more mbarrier (kTailBarOff) stages the V
// chunk that holds the sequence's last key. The register split stays the tiling's: setmaxnreg
// moves registers within the CTA's launch allocation (384 threads x 168 = 128 x (24 + 2 x 240)),
// so two consumer warpgroups at 240 leave the producer 24.
template <typename Tr>
struct Sm90PagedTraits : Tr {
  static constexpr bool kPaged = true;
  static constexpr uint32_t kTailBarOff = Tr::kSmemBytes;
  static constexpr uint32_t kSmemBytes = Tr::kSmemBytes + 8;
  static constexpr uint32_t kSmemAlloc = kSmemBytes + 1024;
  static_assert(Tr::kSmemBytes % 8 == 0, "mbarrier alignment");
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory per block");
};

// Rows per TMA box of a paged K/V tile (Sm90ProducePaged): a common divisor of the page size and
// the key tile, a multiple of 8 (whole 1024-byte swizzle atoms; the page size must be a multiple
// of 8) and at most 64, so that the V chunk holding a sequence's last key has few rows to clear.
constexpr int Sm90PagedBoxRows(int page_size, int block_n) {
  int a = page_size, b = block_n;
  while (b != 0) {
    const int r = a % b;
    a = b;
    b = r;
  }
  while (a > 64) a /= 2;
  return a;
}
static_assert(Sm90PagedBoxRows(16, 128) == 16 && Sm90PagedBoxRows(256, 128) == 64 &&
                  Sm90PagedBoxRows(64, 80) == 16 && Sm90PagedBoxRows(80, 80) == 40 &&
                  Sm90PagedBoxRows(24, 128) == 8,
              "box rows");

// Launches with many tiles (where no tiling estimate is made) use the narrow tiling for causal (or
// right-windowed) problems with at most this many queries.
constexpr int kSm90NarrowMaxSeqlenQ = 1024;

}  // namespace attn::kernels::cuda
