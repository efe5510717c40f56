// The definitions behind variant_kernels.h, instantiated once per head dim by
// variant_kernels_d*.cu (one translation unit each, as the library's kernels are).
#pragma once

#include "flash_fwd_sm90_launch.cuh"
#include "variant_kernels.h"

namespace attn::kernels::cuda {

// Tr with the launch its rules give for params (a tile counter where params has one).
template <typename Tr>
cudaError_t LaunchWithRulesSm90(const FlashParams& params, int sms, cudaStream_t stream) {
  Sm90Choices c;
  c.counter = params.tile_counter != nullptr;
  return LaunchFlashFwdSm90<Tr>(params, Sm90LaunchOf<Tr>(params, c, sms), stream);
}

// Head dim D's wide or narrow tiling (bf16), each wrapped in Wrap; the wide one as production
// runs it (Sm90MaskedWideTraits where the launch has a mask).
template <int D, template <typename> class Wrap>
cudaError_t LaunchTilingSm90(const FlashParams& params, bool narrow, int sms, cudaStream_t stream) {
  if (narrow) return LaunchWithRulesSm90<Wrap<Sm90NarrowTraits<D, __nv_bfloat16>>>(params, sms, stream);
  if (params.has_left || params.has_right) {
    return LaunchWithRulesSm90<Wrap<Sm90MaskedWideTraits<D, __nv_bfloat16>>>(params, sms, stream);
  }
  return LaunchWithRulesSm90<Wrap<Sm90WideTraits<D, __nv_bfloat16>>>(params, sms, stream);
}

// Tr, a tiling of one head dim of its own, when D is that head dim.
template <int D, typename Tr>
cudaError_t LaunchFixedSm90(const FlashParams& params, int sms, cudaStream_t stream) {
  if constexpr (D == Tr::kHeadDim) return LaunchWithRulesSm90<Tr>(params, sms, stream);
  return cudaErrorNotSupported;
}

template <int D>
cudaError_t LaunchVariantSm90(const FlashParams& params, Sm90Variant v, bool narrow, int sms,
                              cudaStream_t stream) {
  switch (v) {
    case Sm90Variant::kSplitMask:
      return LaunchTilingSm90<D, Sm90SplitMask>(params, narrow, sms, stream);
    case Sm90Variant::kOverlap:
      return LaunchTilingSm90<D, Sm90Overlap>(params, narrow, sms, stream);
    case Sm90Variant::kExpFma4:
      return LaunchTilingSm90<D, Sm90ExpFma4>(params, narrow, sms, stream);
    case Sm90Variant::kLazyRescale:
      return LaunchTilingSm90<D, Sm90LazyRescale>(params, narrow, sms, stream);
    case Sm90Variant::kEagerRescale:
      return LaunchTilingSm90<D, Sm90EagerRescale>(params, narrow, sms, stream);
    case Sm90Variant::kTrimEdges:
      if constexpr (D == 256) return cudaErrorNotSupported;  // 64- and 80-key tiles
      else return LaunchTilingSm90<D, Sm90TrimEdges>(params, narrow, sms, stream);
    case Sm90Variant::kOverlapKeys64:
      return LaunchFixedSm90<D, Sm90Overlap<Sm90TraitsBase<128, __nv_bfloat16, 64, 4, 3>>>(params, sms,
                                                                                         stream);
    case Sm90Variant::kKeys176:
      return LaunchFixedSm90<D, Sm90TraitsBase<128, __nv_bfloat16, 176, 2, 2>>(params, sms, stream);
    case Sm90Variant::kKeys80:
      return LaunchFixedSm90<D, Sm90TraitsBase<256, __nv_bfloat16, 80, 2, 2>>(params, sms, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace attn::kernels::cuda
