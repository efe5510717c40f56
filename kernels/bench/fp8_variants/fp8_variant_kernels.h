// The builds of the FP8 forward kernel that fp8_variants times against the shipped one (defined
// in fp8_variant_launch.cuh, one translation unit per head dim: fp8_variant_kernels_d*.cu): shares of
// the softmax's exp2 on the FMA pipe other than the shipped one, another count of consumer
// warpgroups, the overlapped softmax.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_params.h"

namespace attn::kernels::cuda {

enum class Fp8Variant {
  kMufu,  // every exp2 on the MUFU pipe (the shipped warpgroups)
  kFma2,  // every 2nd group of 8 keys' exp2 on the FMA pipe (the shipped warpgroups)
  kFma3,  // every 3rd
  kFma4,  // every 4th (d=128's shipped split; d=256's until it moved to every 8th)
  kFma5,  // every 5th
  kFma6,  // every 6th
  kFma8,  // every 8th (d=256's shipped split)
  kWg2,   // d=128: two consumer warpgroups (128-row tiles, 240 registers), the shipped split
  kOverlap,  // two warpgroups, the softmax of each key tile under the previous tile's P V
  kCount,
};

const char* Fp8VariantName(Fp8Variant v);

// Whether variant v is built for head dim d (LaunchFp8Variant's cudaErrorNotSupported otherwise).
inline bool Fp8VariantBuiltFor(Fp8Variant v, int d) { return v != Fp8Variant::kWg2 || d == 128; }

// Launches variant v of head dim D (o in bf16) as RunFlashFwdSm90Fp8 launches the shipped one
// (V transposed into params.vt first); cudaErrorNotSupported where v does not apply to D.
template <int D>
cudaError_t LaunchFp8Variant(const FlashParams& params, Fp8Variant v, int sms, cudaStream_t stream);

}  // namespace attn::kernels::cuda
