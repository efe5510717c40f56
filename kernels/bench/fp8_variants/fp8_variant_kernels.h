// The builds of the FP8 forward kernel that fp8_variants times against the shipped one (defined
// in fp8_variant_launch.cuh, one translation unit per head dim: fp8_variant_kernels_d*.cu): loops
// and softmax splits tried before any of them is shipped.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_params.h"

namespace attn::kernels::cuda {

enum class Fp8Variant {
  kFma4,            // the shipped loop, every 4th group of 8 keys' exp2 on the FMA pipe
  kFma2,            // the shipped loop, every 2nd group on the FMA pipe
  kBlocks,          // Fp8Loop::kBlocks
  kPingpong,        // Fp8Loop::kPingpong
  kPingpongFma4,    // kPingpong with kFma4's split
  kPingpongFma3,    // kPingpong, every 3rd group on the FMA pipe
  kPingpongFma2,    // kPingpong with kFma2's split
  kCount,
};

const char* Fp8VariantName(Fp8Variant v);

// Launches variant v of head dim D (o in bf16) as RunFlashFwdSm90Fp8 launches the shipped one
// (V transposed into params.vt first).
template <int D>
cudaError_t LaunchFp8Variant(const FlashParams& params, Fp8Variant v, int sms, cudaStream_t stream);

}  // namespace attn::kernels::cuda
