// Definitions of LaunchFp8Variant (fp8_variant_kernels.h), included once per head dim.
#pragma once

#include <cuda_bf16.h>

#include "flash_fwd_sm90_fp8_launch.cuh"
#include "fp8_variant_kernels.h"

namespace attn::kernels::cuda {

template <int D>
cudaError_t LaunchFp8Variant(const FlashParams& p, Fp8Variant v, int sms, cudaStream_t stream) {
  using T = __nv_bfloat16;
  switch (v) {
    case Fp8Variant::kFma4:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kPlain, 4>>(p, sms, stream);
    case Fp8Variant::kFma2:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kPlain, 2>>(p, sms, stream);
    case Fp8Variant::kBlocks:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kBlocks, 0>>(p, sms, stream);
    case Fp8Variant::kPingpong:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kPingpong, 0>>(p, sms, stream);
    case Fp8Variant::kPingpongFma4:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kPingpong, 4>>(p, sms, stream);
    case Fp8Variant::kPingpongFma3:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kPingpong, 3>>(p, sms, stream);
    case Fp8Variant::kPingpongFma2:
      return RunFlashFwdSm90Fp8With<Sm90Fp8Traits<D, T, Fp8Loop::kPingpong, 2>>(p, sms, stream);
    default:
      return cudaErrorNotSupported;
  }
}

}  // namespace attn::kernels::cuda
