#include "sessions/fp8_quantize.h"

#include <cstring>

#include "attn/kernels/dtype_convert.h"

namespace attn {
namespace {

// E4M3 of q (FloatToE4m3Bits' rounding) with masks instead of branches; adds 1 to *saturated
// for |q| > 448 (infinity included).
inline uint8_t E4m3Of(float q, uint32_t* saturated) {
  uint32_t u;
  std::memcpy(&u, &q, 4);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Below 2^-6: multiples of 2^-9 (the magnitude clamped first so that the conversion stays in
  // range where this result is not used).
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x3C800000u);
  const uint32_t small = (a & is_sub) | (0x3C800000u & ~is_sub);
  float mag;
  std::memcpy(&mag, &small, 4);
  const uint32_t sub =
      static_cast<uint32_t>(static_cast<int32_t>((mag * 512.0f + 8388608.0f) - 8388608.0f));
  // Normal: round the mantissa to 3 bits (ties to even), rebias the exponent from 127 to 7.
  const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  uint32_t code = (sub & is_sub) | (normal & ~is_sub);
  const uint32_t big = 0u - static_cast<uint32_t>(a >= 0x43E00000u);  // >= 448, infinity
  code = (0x7Eu & big) | (code & ~big);
  const uint32_t nan = 0u - static_cast<uint32_t>(a > 0x7F800000u);
  code = (0x7Fu & nan) | (code & ~nan);
  *saturated += static_cast<uint32_t>(a > 0x43E00000u) & ~nan & 1u;
  return static_cast<uint8_t>(sign | code);
}

// Rows of up to kChunk elements: the quotients first (a loop of divides), then their codes.
constexpr int kChunk = 256;

ATTN_CPU_VECTORIZE
uint32_t CodesOf(const float* q, int n, uint8_t* dst) {
  uint32_t saturated = 0;
  for (int i = 0; i < n; ++i) dst[i] = E4m3Of(q[i], &saturated);
  return saturated;
}

ATTN_CPU_VECTORIZE
void Bf16Quotients(const uint16_t* x, int n, float scale, float* q) {
  for (int i = 0; i < n; ++i) q[i] = kernels::cpu::Bf16BitsToFloat(x[i]) / scale;
}

ATTN_CPU_VECTORIZE
void HalfQuotients(const uint16_t* x, int n, float scale, float* q) {
  for (int i = 0; i < n; ++i) q[i] = kernels::cpu::HalfBitsToFloat(x[i]) / scale;
}

int64_t QuantizeRow(bool bf16, const uint16_t* x, int n, float scale, uint8_t* dst) {
  float q[kChunk];
  int64_t saturated = 0;
  for (int at = 0; at < n; at += kChunk) {
    const int m = n - at < kChunk ? n - at : kChunk;
    if (bf16) {
      Bf16Quotients(x + at, m, scale, q);
    } else {
      HalfQuotients(x + at, m, scale, q);
    }
    saturated += CodesOf(q, m, dst + at);
  }
  return saturated;
}

}  // namespace

int64_t QuantizeE4m3Rows(kernels::DType dtype, const void* src, int64_t tokens, int32_t heads,
                         int32_t head_dim, std::span<const float> scales, uint8_t* dst) {
  const uint16_t* x = static_cast<const uint16_t*>(src);
  const bool bf16 = dtype == kernels::DType::kBFloat16;
  int64_t saturated = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int32_t g = 0; g < heads; ++g) {
      const size_t at = (static_cast<size_t>(t) * heads + g) * head_dim;
      const float scale = scales[static_cast<size_t>(g)];
      saturated += QuantizeRow(bf16, x + at, head_dim, scale, dst + at);
    }
  }
  return saturated;
}

}  // namespace attn
