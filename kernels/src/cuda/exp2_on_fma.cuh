// 2^x on the FMA pipe, for softmax code bound by the MUFU pipe (Sm90Softmax's kFmaEvery).
#pragma once

#include <cuda_runtime.h>

namespace attn::kernels::cuda {

// 2^x on the FMA pipe (no MUFU): x rounded to an integer j by the 1.5 * 2^23 addition (j lands in
// the sum's low mantissa bits), 2^(x - j) by a cubic on [-0.5, 0.5] (relative error 7.5e-5, fitted
// for these kernels), j added to the exponent field. x below -125 gives 2^-125, or with kExactZero
// 0: a row that sees no key would normalise p of 2^-125 in bf16 into the mean of V, where e4m3
// (the FP8 kernel's P) rounds it to 0 and the row's o stays 0.
template <bool kExactZero>
__device__ __forceinline__ float Exp2OnFma(float x) {
  const float xc = fmaxf(x, -125.0f);
  const float t = __fadd_rn(xc, 12582912.0f);
  const float f = __fsub_rn(xc, __fsub_rn(t, 12582912.0f));
  const float m = fmaf(fmaf(fmaf(0.05517084f, f, 0.24260935f), f, 0.69326097f), f, 0.99992818f);
  const float r = __int_as_float(__float_as_int(m) + (__float_as_int(t) << 23));
  if constexpr (kExactZero) {
    return x < -125.0f ? 0.0f : r;
  } else {
    return r;
  }
}

}  // namespace attn::kernels::cuda
