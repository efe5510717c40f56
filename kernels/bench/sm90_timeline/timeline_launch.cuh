// The definitions behind timeline_kernels.h, instantiated once per head dim by
// timeline_kernels_d*.cu (one translation unit each, as the library's kernels are).
#pragma once

#include "flash_fwd_sm90_launch.cuh"
#include "timeline_kernels.h"

namespace attn::kernels::cuda {

// Head dim D's wide or narrow tiling (bf16), each wrapped in Wrap; the wide one as production
// runs it (Sm90MaskedWideTraits where the launch has a mask).
template <int D, template <typename> class Wrap>
cudaError_t LaunchTilingSm90(const FlashParams& params, bool narrow, int sms, cudaStream_t stream,
                             unsigned long long* trace = nullptr) {
  if (narrow) return LaunchFlashFwdSm90<Wrap<Sm90NarrowTraits<D, __nv_bfloat16>>>(params, sms, stream, trace);
  if (params.has_left || params.has_right) {
    return LaunchFlashFwdSm90<Wrap<Sm90MaskedWideTraits<D, __nv_bfloat16>>>(params, sms, stream, trace);
  }
  return LaunchFlashFwdSm90<Wrap<Sm90WideTraits<D, __nv_bfloat16>>>(params, sms, stream, trace);
}

template <int D>
cudaError_t LaunchTracedSm90(const FlashParams& params, bool narrow, int sms, cudaStream_t stream,
                             unsigned long long* trace, Sm90TracedShape* shape) {
  auto describe = [shape](auto traits) {
    using Tr = decltype(traits);
    *shape = {Tr::kConsumerWGs, Tr::kBlockM, Tr::kBlockN, Tr::kOverlap};
  };
  if (narrow) {
    describe(Sm90NarrowTraits<D, __nv_bfloat16>{});
  } else {
    describe(Sm90WideTraits<D, __nv_bfloat16>{});
  }
  return LaunchTilingSm90<D, Sm90Traced>(params, narrow, sms, stream, trace);
}

// Tr, a tiling of one head dim of its own, when D is that head dim.
template <int D, typename Tr>
cudaError_t LaunchFixedSm90(const FlashParams& params, int sms, cudaStream_t stream) {
  if constexpr (D == Tr::kHeadDim) return LaunchFlashFwdSm90<Tr>(params, sms, stream);
  return cudaErrorNotSupported;
}

template <int D>
cudaError_t LaunchVariantSm90(const FlashParams& params, Sm90Variant v, bool narrow, int sms,
                              cudaStream_t stream) {
  switch (v) {
    case Sm90Variant::kRescaleOnChange:
      return LaunchTilingSm90<D, Sm90RescaleOnChange>(params, narrow, sms, stream);
    case Sm90Variant::kClusterKV:
      return LaunchTilingSm90<D, Sm90ClusterKV>(params, narrow, sms, stream);
    case Sm90Variant::kSplitMask:
      return LaunchTilingSm90<D, Sm90SplitMask>(params, narrow, sms, stream);
    case Sm90Variant::kOverlap:
      return LaunchTilingSm90<D, Sm90Overlap>(params, narrow, sms, stream);
    case Sm90Variant::kReleaseKEarly:
      return LaunchTilingSm90<D, Sm90ReleaseKEarly>(params, narrow, sms, stream);
    case Sm90Variant::kTrimEdges:
      if constexpr (D == 256) return cudaErrorNotSupported;  // 64- and 80-key tiles
      else return LaunchTilingSm90<D, Sm90TrimEdges>(params, narrow, sms, stream);
    case Sm90Variant::kFmaExp2Of8_2:
      return LaunchTilingSm90<D, Sm90FmaExp2<2>::template Of8>(params, narrow, sms, stream);
    case Sm90Variant::kFmaExp2Of8_3:
      return LaunchTilingSm90<D, Sm90FmaExp2<3>::template Of8>(params, narrow, sms, stream);
    case Sm90Variant::kFmaExp2Of8_4:
      return LaunchTilingSm90<D, Sm90FmaExp2<4>::template Of8>(params, narrow, sms, stream);
    case Sm90Variant::kOverlapPingPong:
      return LaunchTilingSm90<D, Sm90OverlapPingPong>(params, narrow, sms, stream);
    case Sm90Variant::kOverlapKeys176:
      return LaunchFixedSm90<D, Sm90OverlapPingPong<Sm90TraitsBase<128, __nv_bfloat16, 176, 2, 2>>>(
          params, sms, stream);
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
