// sm90_timeline's builds of the sm_90a kernel, head dim 256, bf16 (see timeline_kernels.h).
#include "flash_fwd_sm90_launch.cuh"
#include "timeline_kernels.h"

namespace attn::kernels::cuda {

template <>
cudaError_t LaunchTracedSm90<256>(const FlashParams& params, bool narrow, int sms, cudaStream_t stream,
                                unsigned long long* trace, int* consumer_wgs, int* block_m) {
  using Wide = Sm90Traced<Sm90WideTraits<256, __nv_bfloat16>>;
  using Narrow = Sm90Traced<Sm90NarrowTraits<256, __nv_bfloat16>>;
  if (!narrow) {
    *consumer_wgs = Wide::kConsumerWGs;
    *block_m = Wide::kBlockM;
    return LaunchFlashFwdSm90<Wide>(params, sms, stream, trace);
  }
  *consumer_wgs = Narrow::kConsumerWGs;
  *block_m = Narrow::kBlockM;
  return LaunchFlashFwdSm90<Narrow>(params, sms, stream, trace);
}

template <>
cudaError_t LaunchVariantSm90<256>(const FlashParams& params, Sm90Variant v, bool narrow, int sms,
                                 cudaStream_t stream) {
  using Wide = Sm90WideTraits<256, __nv_bfloat16>;
  using Narrow = Sm90NarrowTraits<256, __nv_bfloat16>;
  switch (v) {
    case Sm90Variant::kRescaleOnChange:
      if (!narrow) return LaunchFlashFwdSm90<Sm90RescaleOnChange<Wide>>(params, sms, stream);
      return LaunchFlashFwdSm90<Sm90RescaleOnChange<Narrow>>(params, sms, stream);
    case Sm90Variant::kKeys80:
      return LaunchFlashFwdSm90<Sm90TraitsBase<256, __nv_bfloat16, 80, 2, 2>>(params, sms, stream);
    case Sm90Variant::kClusterKV:
      if (!narrow) return LaunchFlashFwdSm90<Sm90ClusterKV<Wide>>(params, sms, stream);
      return LaunchFlashFwdSm90<Sm90ClusterKV<Narrow>>(params, sms, stream);
    case Sm90Variant::kSplitMask:
      if (!narrow) return LaunchFlashFwdSm90<Sm90SplitMask<Wide>>(params, sms, stream);
      return LaunchFlashFwdSm90<Sm90SplitMask<Narrow>>(params, sms, stream);
    case Sm90Variant::kOverlap:
      return LaunchFlashFwdSm90<Sm90Overlap<Narrow>>(params, sms, stream);
    default:
      return cudaErrorNotSupported;
  }
}

}  // namespace attn::kernels::cuda
