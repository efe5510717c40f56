// The builds of the sm_90a forward kernel that sm90_timeline launches besides the production one
// (defined in timeline_launch.cuh, one translation unit per head dim: timeline_kernels_d*.cu):
// the traced kernel, and variants that are tried against production before any of them is
// dispatched to.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_fwd_sm90_traits.cuh"
#include "flash_params.h"

namespace attn::kernels::cuda {

// O rescaled only when a row's maximum moved (Sm90TraitsBase::kRescaleOnChange).
template <typename Tr>
struct Sm90RescaleOnChange : Tr {
  static constexpr bool kRescaleOnChange = true;
};

// S of the next key tile before P V of this one (Sm90TraitsBase::kOverlap).
template <typename Tr>
struct Sm90Overlap : Tr {
  static constexpr bool kOverlap = true;
};

// kOverlap with the consumer warpgroups taking turns to issue (Sm90TraitsBase::kPingPong).
template <typename Tr>
struct Sm90OverlapPingPong : Tr {
  static constexpr bool kOverlap = true;
  static constexpr bool kPingPong = true;
};

// K released once its S is complete (Sm90TraitsBase::kReleaseKEarly).
template <typename Tr>
struct Sm90ReleaseKEarly : Tr {
  static constexpr bool kReleaseKEarly = true;
};

// K/V halves multicast between the two CTAs of a cluster (Sm90TraitsBase::kClusterKV).
template <typename Tr>
struct Sm90ClusterKV : Tr {
  static constexpr bool kClusterKV = true;
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

// N of every 8 exp2 of the softmax on the FMA pipe (Sm90TraitsBase::kFmaExp2Of8).
template <int N>
struct Sm90FmaExp2 {
  template <typename Tr>
  struct Of8 : Tr {
    static constexpr int kFmaExp2Of8 = N;
  };
};

enum class Sm90Variant {
  kRescaleOnChange,  // the production tiling (wide or narrow) with kRescaleOnChange
  kKeys176,          // d=128: two consumer warpgroups on 128 x 176 tiles, one Q buffer
  kKeys80,           // d=256: two consumer warpgroups on 128 x 80 tiles
  kOverlap,          // the production tiling (wide or narrow) with kOverlap
  kOverlapPingPong,  // the production tiling (wide or narrow) with kOverlap and kPingPong
  kOverlapKeys176,   // d=128: kKeys176's tiles with kOverlap and kPingPong
  kOverlapKeys64,    // d=128: three consumer warpgroups on 192 x 64 tiles (4 stages) with kOverlap
  kClusterKV,        // the production tiling (wide or narrow) with kClusterKV
  kSplitMask,        // the production tiling (wide or narrow) with kSplitMaskLoop
  kReleaseKEarly,    // the production tiling (wide or narrow) with kReleaseKEarly
  kTrimEdges,        // the production tiling (wide or narrow) with kTrimEdgeTiles (d=64/128)
  kFmaExp2Of8_2,     // the production tiling (wide or narrow) with kFmaExp2Of8 = 2
  kFmaExp2Of8_3,     // ... = 3
  kFmaExp2Of8_4,     // ... = 4
};

// What a traced launch ran: its consumer warpgroups, tile rows and keys, and whether its key loop
// is the overlapped one (Sm90TraitsBase::kOverlap), whose records read differently.
struct Sm90TracedShape {
  int consumer_wgs = 0;
  int block_m = 0;
  int block_n = 0;
  bool overlap = false;
};

// Launches the traced kernel (bf16) with the wide or narrow tiling of head dim D; `trace` holds
// grid * 3 * Sm90TraceLayout::kPerWarpgroup entries. Sets *shape to what was launched.
template <int D>
cudaError_t LaunchTracedSm90(const FlashParams& params, bool narrow, int sms, cudaStream_t stream,
                             unsigned long long* trace, Sm90TracedShape* shape);

// Launches variant v of head dim D (bf16), untraced; cudaErrorNotSupported where v does not apply
// to D.
template <int D>
cudaError_t LaunchVariantSm90(const FlashParams& params, Sm90Variant v, bool narrow, int sms,
                              cudaStream_t stream);

}  // namespace attn::kernels::cuda
