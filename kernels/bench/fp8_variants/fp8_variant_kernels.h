// The builds of the FP8 forward kernel that fp8_variants times against the shipped one (defined
// in fp8_variant_launch.cuh, one translation unit per head dim: fp8_variant_kernels_d*.cu): shares of
// the softmax's exp2 on the FMA pipe other than the shipped one, another count of consumer
// warpgroups, the overlapped softmax; and the shipped kernel stamped with clocks per phase.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flash_fwd_sm90_fp8_phases.h"
#include "flash_params.h"

namespace attn::kernels::cuda {

enum class Fp8Variant {
  kMufu,  // every exp2 on the MUFU pipe (the shipped warpgroups; d=128's shipped split)
  kFma2,  // every 2nd group of 8 keys' exp2 on the FMA pipe (the shipped warpgroups)
  kFma3,  // every 3rd
  kFma4,  // every 4th (d=128's until its third warpgroup gave MUFU the edge; its narrow tiles')
  kFma5,  // every 5th
  kFma6,  // every 6th
  kFma8,  // every 8th (d=256's shipped split)
  kWg2,   // d=128: two consumer warpgroups (128-row tiles, 240 registers; shipped for launches of few tiles)
  kOverlap,  // two warpgroups, the softmax of each key tile under the previous tile's P V
  kStamped,  // the shipped traits with clocks per phase (ReadFp8PhaseClocks)
  kStampedAlone,  // d=128: one consumer warpgroup (64-row tiles, one CTA per SM: a lone consumer
                  // warp per SM sub-partition), every exp2 on MUFU, stamped: its phases unshared
  kMaskFlipped,  // the shipped traits with kHoistedMask flipped (per-Q-tile mask bounds or the per-tile test)
  kTcSum,  // each key tile's row sums of P on the tensor cores (kTcRowSum), no lazy rescale (d=128: the shipped kernel before its lazy rescale)
  kWg2TcSum,  // d=128: kWg2 with the row sums on the tensor cores
  kFloatSum,  // the row sums in the softmax (kTcRowSum off), no lazy rescale
  kLazy,  // the shipped traits with a lazy rescale (kRescaleSlack8 = 6: a row's max kept until it grows by 0.75; d=128: the shipped kernel)
  kLazyTcSum,  // kTcSum with the lazy rescale
  kLazyFloatSum,  // kFloatSum with the lazy rescale
  kCount,
};

const char* Fp8VariantName(Fp8Variant v);

// Whether variant v is built for head dim d (LaunchFp8Variant's cudaErrorNotSupported otherwise).
inline bool Fp8VariantBuiltFor(Fp8Variant v, int d) {
  const bool d128_only = v == Fp8Variant::kWg2 || v == Fp8Variant::kStampedAlone || v == Fp8Variant::kWg2TcSum;
  return !d128_only || d == 128;
}

// Launches variant v of head dim D (o in bf16) as RunFlashFwdSm90Fp8 launches the shipped one
// (V transposed into params.vt first); cudaErrorNotSupported where v does not apply to D.
template <int D>
cudaError_t LaunchFp8Variant(const FlashParams& params, Fp8Variant v, int sms, cudaStream_t stream);

// The stamped variant's counters of head dim D (kFp8PhaseSlots: SM clocks per phase, summed over
// the launches since the last reset, then the consumers' and the producer's key tiles): zeroed,
// and read after the launches have completed.
template <int D>
cudaError_t ResetFp8PhaseClocks();
template <int D>
cudaError_t ReadFp8PhaseClocks(uint64_t (&slots)[kFp8PhaseSlots]);
// The stamped variant's timeline of CTA 0's first Q tile since the last reset (phase, SM clock per
// mark and role; phase 0 and clock 0 past a role's last mark).
template <int D>
cudaError_t ReadFp8Timeline(uint32_t (&marks)[kFp8TraceRoles][kFp8TraceMarks][2]);

}  // namespace attn::kernels::cuda
