// Definitions of LaunchFp8Variant (fp8_variant_kernels.h), included once per head dim.
#pragma once

#include <cuda_bf16.h>

#include "flash_fwd_sm90_fp8_launch.cuh"
#include "fp8_variant_kernels.h"

namespace attn::kernels::cuda {

template <int D>
__device__ unsigned long long gFp8PhaseClocks[kFp8PhaseSlots];
template <int D>
__device__ uint32_t gFp8Timeline[kFp8TraceRoles][kFp8TraceMarks][2];
template <int D>
__device__ int gFp8TimelineTaken[kFp8TraceRoles];

// The shipped (wide) traits (or Base), stamped: thread 0 of each consumer warpgroup and the
// producer thread add their clocks per phase and key tiles to gFp8PhaseClocks<D> once per Q tile.
template <int D, typename Base = Sm90Fp8Shipped<D, __nv_bfloat16>>
struct Fp8StampedTraits : Base {
  static constexpr bool kStamps = true;
  __device__ static void AddClocks(const uint32_t (&sums)[kFp8Phases], uint32_t key_tiles,
                                   bool producer) {
#pragma unroll
    for (int i = 0; i < kFp8Phases; ++i)
      if (sums[i] != 0) atomicAdd(&gFp8PhaseClocks<D>[i], sums[i]);
    atomicAdd(&gFp8PhaseClocks<D>[producer ? kFp8ProducerTilesSlot : kFp8ConsumerTilesSlot],
              key_tiles);
  }
  // CTA 0's first Q tile of each role (consumer warpgroup 0.., then the producer) is traced.
  __device__ static uint32_t* TraceSlot(int role) {
    if (blockIdx.x != 0 || atomicCAS(&gFp8TimelineTaken<D>[role], 0, 1) != 0) return nullptr;
    return &gFp8Timeline<D>[role][0][0];
  }
};

template <int D>
struct Fp8MaskFlippedTraits : Sm90Fp8Shipped<D, __nv_bfloat16> {
  static constexpr bool kHoistedMask = !Sm90Fp8Shipped<D, __nv_bfloat16>::kHoistedMask;
};

template <int D, int kWGs = kSm90Fp8ShippedWGs<D>>
using Fp8TcSumTraits = Sm90Fp8Traits<D, __nv_bfloat16, kSm90Fp8ExpFmaEveryOf<D, kWGs>, kWGs, false, true>;
template <int D>
using Fp8FloatSumTraits =
    Sm90Fp8Traits<D, __nv_bfloat16, kSm90Fp8ExpFmaEveryOf<D, kSm90Fp8ShippedWGs<D>>, kSm90Fp8ShippedWGs<D>>;

// Base with a lazy rescale: rows keep their max until it grows by more than 6/8 (log2 units).
template <typename Base>
struct Fp8LazyTraits : Base {
  static constexpr int kRescaleSlack8 = 6;
};

template <int D>
cudaError_t ResetFp8PhaseClocks() {
  const unsigned long long zeros[kFp8PhaseSlots] = {};
  const int untaken[kFp8TraceRoles] = {};
  static const uint32_t kNoMarks[kFp8TraceRoles][kFp8TraceMarks][2] = {};
  cudaError_t e = cudaMemcpyToSymbol(gFp8PhaseClocks<D>, zeros, sizeof(zeros));
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(gFp8TimelineTaken<D>, untaken, sizeof(untaken));
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(gFp8Timeline<D>, kNoMarks, sizeof(kNoMarks));
  return e;
}

template <int D>
cudaError_t ReadFp8Timeline(uint32_t (&marks)[kFp8TraceRoles][kFp8TraceMarks][2]) {
  return cudaMemcpyFromSymbol(marks, gFp8Timeline<D>, sizeof(marks));
}

template <int D>
cudaError_t ReadFp8PhaseClocks(uint64_t (&slots)[kFp8PhaseSlots]) {
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
  return cudaMemcpyFromSymbol(slots, gFp8PhaseClocks<D>, sizeof(slots));
}

template <int D>
cudaError_t LaunchFp8Variant(const FlashParams& p, Fp8Variant v, int sms, cudaStream_t stream) {
  using T = __nv_bfloat16;
  constexpr int kWGs = kSm90Fp8ShippedWGs<D>;
  switch (v) {
    case Fp8Variant::kMufu: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 0, kWGs>>(p, sms, stream);
    case Fp8Variant::kFma2: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 2, kWGs>>(p, sms, stream);
    case Fp8Variant::kFma3: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 3, kWGs>>(p, sms, stream);
    case Fp8Variant::kFma4: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 4, kWGs>>(p, sms, stream);
    case Fp8Variant::kFma5: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 5, kWGs>>(p, sms, stream);
    case Fp8Variant::kFma6: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 6, kWGs>>(p, sms, stream);
    case Fp8Variant::kFma8: return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, 8, kWGs>>(p, sms, stream);
    case Fp8Variant::kWg2:  // Fp8VariantBuiltFor
      if constexpr (D == 128) return RunFlashFwdSm90Fp8With<Sm90Fp8ShippedNarrow<D, T>>(p, sms, stream);
      return cudaErrorNotSupported;
    case Fp8Variant::kOverlap:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, kSm90Fp8ExpFmaEveryOf<D, 2>, 2, true>>(p, sms, stream);
    case Fp8Variant::kStamped: return RunFlashFwdSm90Fp8With<Fp8StampedTraits<D>>(p, sms, stream);
    case Fp8Variant::kStampedAlone:  // Fp8VariantBuiltFor
      if constexpr (D == 128) {
        return RunFlashFwdSm90Fp8With<Fp8StampedTraits<D, Sm90Fp8Traits<D, T, 0, 1>>>(p, sms, stream);
      }
      return cudaErrorNotSupported;
    case Fp8Variant::kMaskFlipped: return RunFlashFwdSm90Fp8With<Fp8MaskFlippedTraits<D>>(p, sms, stream);
    case Fp8Variant::kTcSum: return RunFlashFwdSm90Fp8With<Fp8TcSumTraits<D>>(p, sms, stream);
    case Fp8Variant::kWg2TcSum:  // Fp8VariantBuiltFor
      if constexpr (D == 128) return RunFlashFwdSm90Fp8With<Fp8TcSumTraits<D, 2>>(p, sms, stream);
      return cudaErrorNotSupported;
    case Fp8Variant::kFloatSum: return RunFlashFwdSm90Fp8With<Fp8FloatSumTraits<D>>(p, sms, stream);
    case Fp8Variant::kLazy:
      return RunFlashFwdSm90Fp8With<Fp8LazyTraits<Sm90Fp8Shipped<D, T>>>(p, sms, stream);
    case Fp8Variant::kLazyTcSum: return RunFlashFwdSm90Fp8With<Fp8LazyTraits<Fp8TcSumTraits<D>>>(p, sms, stream);
    case Fp8Variant::kLazyFloatSum:
      return RunFlashFwdSm90Fp8With<Fp8LazyTraits<Fp8FloatSumTraits<D>>>(p, sms, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace attn::kernels::cuda
