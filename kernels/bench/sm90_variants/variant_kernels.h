// The builds of the sm_90a forward kernel that sm90_variants times against the production one
// (defined in variant_launch.cuh, one translation unit per head dim: variant_kernels_d*.cu):
// tilings and loops tried before any of them is dispatched to.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_fwd_sm90_traits.cuh"
#include "flash_params.h"

namespace attn::kernels::cuda {

// S of the next key tile before P V of this one (Sm90TraitsBase::kOverlap).
template <typename Tr>
struct Sm90Overlap : Tr {
  static constexpr bool kOverlap = true;
};

// Unmasked key tiles in a loop of their own (Sm90TraitsBase::kSplitMaskLoop).
template <typename Tr>
struct Sm90SplitMask : Tr {
  static constexpr bool kSplitMaskLoop = true;
};

// Each warpgroup's edge key tiles trimmed (Sm90TraitsBase::kTrimEdgeTiles).
template <typename Tr>
struct Sm90TrimEdges : Tr {
  static constexpr bool kTrimEdgeTiles = true;
};

// Every 4th group of 8 keys' exp2 on the FMA pipe (Sm90TraitsBase::kExpFmaEvery).
template <typename Tr>
struct Sm90ExpFma4 : Tr {
  static constexpr int kExpFmaEvery = 4;
};

// A lazy rescale: a row's max is kept until it grows by more than 8 (log2 units; P below 256), or
// O rescaled on every key tile (d=128's wide tiling ships the lazy one).
template <typename Tr>
struct Sm90LazyRescale : Tr {
  static constexpr int kRescaleSlack8 = 64;
};
template <typename Tr>
struct Sm90EagerRescale : Tr {
  static constexpr int kRescaleSlack8 = 0;
};

enum class Sm90Variant {
  kKeys176,         // d=128: two consumer warpgroups on 128 x 176 tiles, one Q buffer
  kKeys80,          // d=256: two consumer warpgroups on 128 x 80 tiles
  kOverlap,         // the production tiling (wide or narrow) with kOverlap
  kOverlapKeys64,   // d=128: three consumer warpgroups on 192 x 64 tiles (4 stages) with kOverlap
  kSplitMask,       // the production tiling (wide or narrow) with kSplitMaskLoop
  kTrimEdges,       // the production tiling (wide or narrow) with kTrimEdgeTiles (d=64/128)
  kExpFma4,         // the production tiling (wide or narrow) with kExpFmaEvery = 4
  kLazyRescale,     // the production tiling (wide or narrow) with kRescaleSlack8 = 64
  kEagerRescale,    // the production tiling (wide or narrow) with kRescaleSlack8 = 0
};

// Launches variant v of head dim D (bf16) with the launch rules of its tiling (Sm90LaunchOf, the
// tile counter as params has it); cudaErrorNotSupported where v does not apply to D.
template <int D>
cudaError_t LaunchVariantSm90(const FlashParams& params, Sm90Variant v, bool narrow, int sms,
                              cudaStream_t stream);

}  // namespace attn::kernels::cuda
