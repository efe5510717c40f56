// Quantization of 16-bit keys and values into an FP8 (E4M3) session cache, as the step pipeline
// stages them: code = E4M3(x / scale[head]), the float32 quotient rounded to nearest even,
// saturating to +-448 (infinities too), NaN kept NaN; the same codes as
// kernels::cpu::FloatToE4m3Bits of the quotient, computed without branches so that the loop
// vectorizes.
#pragma once

#include <cstdint>
#include <span>

#include "attn/kernels/attention.h"

namespace attn {

// rows [tokens, heads, head_dim] of dtype (kFloat16 or kBFloat16) from src into E4M3 codes at
// dst; scales has `heads` entries. Returns the elements that saturated: |x / scale| > 448 or
// infinite.
int64_t QuantizeE4m3Rows(kernels::DType dtype, const void* src, int64_t tokens, int32_t heads,
                         int32_t head_dim, std::span<const float> scales, uint8_t* dst);

}  // namespace attn
