// Conversions between the 16-bit wire dtypes (and FP8 e4m3) and float (header-only), and the row
// loads and stores of the CPU backend.
#pragma once

#include <cstdint>
#include <cstring>

#include "attn/kernels/attention.h"

// Hot loops get an AVX2+FMA clone next to the baseline one, picked at load time.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && \
    !defined(ATTN_NO_TARGET_CLONES)
#define ATTN_CPU_VECTORIZE __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ATTN_CPU_VECTORIZE
#endif

namespace attn::kernels::cpu {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// binary16 -> binary32: place the magnitude bits in a float and rescale by 2^112, which maps
// normals and subnormals alike; exponent 31 becomes Inf/NaN.
inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t mag = static_cast<uint32_t>(h & 0x7FFF) << 13;
  float f = BitsToFloat(mag) * 5.192296858534828e+33f;  // 2^112
  uint32_t u = FloatToBits(f);
  if ((h & 0x7C00) == 0x7C00) u = 0x7F800000u | mag;
  return BitsToFloat(u | (static_cast<uint32_t>(h & 0x8000) << 16));
}

// binary32 -> binary16, round to nearest even; overflow to Inf, NaN stays NaN.
inline uint16_t FloatToHalfBits(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a >= 0x7F800000) return sign | (a > 0x7F800000 ? 0x7E00 : 0x7C00);
  if (a >= 0x477FF000) return sign | 0x7C00;  // rounds to >= 65520
  if (a < 0x38800000) {                        // below 2^-14: subnormal half
    // value / 2^-24 rounded to an integer, by adding 0.5 in float (exact for these magnitudes).
    const float scaled = BitsToFloat(a) * 16777216.0f;  // 2^24
    const float r = scaled + 8388608.0f - 8388608.0f;   // RNE to integer (|scaled| < 2^10)
    return sign | static_cast<uint16_t>(r);
  }
  const uint32_t rounded = a + 0xFFF + ((a >> 13) & 1);
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}

inline float Bf16BitsToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// OCP E4M3FN (DType::kFloat8E4M3) -> binary32, exactly: S.EEEE.MMM is (-1)^S * 2^(E-7) * 1.MMM for
// E > 0, (-1)^S * 2^-6 * 0.MMM for E = 0, and NaN for S.1111.111 (there are no infinities).
inline float E4m3BitsToFloat(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t mag = b & 0x7F;
  if (mag == 0x7F) return BitsToFloat(sign | 0x7FC00000u);
  // Subnormals are MMM * 2^-9 (exact in float); a normal's bits are a float's with the exponent
  // rebiased from 7 to 127 (no float subnormal on either path: a process that flushes them, as
  // -ffast-math code may set up, converts the same).
  const float f = mag < 8 ? static_cast<float>(mag) * 0.001953125f
                          : BitsToFloat((mag << 20) + (120u << 23));
  return BitsToFloat(FloatToBits(f) | sign);
}

// binary32 -> OCP E4M3FN, round to nearest even, saturating: finite values beyond +-448 and the
// infinities become +-448 (0x7E / 0xFE), NaN becomes S.1111.111 (its sign kept). What the CUDA
// conversion cvt.rn.satfinite.e4m3x2.f32 does.
inline uint8_t FloatToE4m3Bits(float f) {
  const uint32_t u = FloatToBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7F;   // NaN
  if (a >= 0x43E00000) return sign | 0x7E;  // >= 448 (and inf): the largest finite value
  if (a < 0x3C800000) {                     // below 2^-6: multiples of 2^-9 (code 8 is 2^-6)
    const float scaled = BitsToFloat(a) * 512.0f;                       // exact
    const float r = (scaled + 8388608.0f) - 8388608.0f;                 // RNE to an integer
    return sign | static_cast<uint8_t>(r);
  }
  // Round the 23 mantissa bits to 3 at bit 20 (ties to even; a carry moves into the exponent),
  // then rebias the exponent from 127 to 7.
  const uint32_t rounded = a + 0x7FFFF + ((a >> 20) & 1);
  return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
}

// dst[0..n) = src[offset .. offset + n) converted to float and multiplied by scale. base is aligned
// to t's size (ValidateCommon refuses arrays that are not), so its elements load as their type.
inline void LoadRow(DType t, const void* base, int64_t offset, int n, float* dst, float scale) {
  if (t == DType::kFloat32) {
    const float* p = static_cast<const float*>(base) + offset;
    for (int i = 0; i < n; ++i) dst[i] = p[i] * scale;
  } else if (t == DType::kBFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int i = 0; i < n; ++i) dst[i] = Bf16BitsToFloat(p[i]) * scale;
  } else if (t == DType::kFloat8E4M3) {
    const uint8_t* p = static_cast<const uint8_t*>(base) + offset;
    for (int i = 0; i < n; ++i) dst[i] = E4m3BitsToFloat(p[i]) * scale;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int i = 0; i < n; ++i) dst[i] = HalfBitsToFloat(p[i]) * scale;
  }
}

// base[offset .. offset + n) = src[0..n) converted to t (FP8: FloatToE4m3Bits, unscaled).
inline void StoreRow(DType t, const float* src, int n, void* base, int64_t offset) {
  if (t == DType::kFloat8E4M3) {
    uint8_t* p = static_cast<uint8_t*>(base) + offset;
    for (int i = 0; i < n; ++i) p[i] = FloatToE4m3Bits(src[i]);
  } else if (t == DType::kFloat32) {
    std::memcpy(static_cast<float*>(base) + offset, src, sizeof(float) * n);
  } else if (t == DType::kBFloat16) {
    uint16_t* p = static_cast<uint16_t*>(base) + offset;
    for (int i = 0; i < n; ++i) p[i] = FloatToBf16Bits(src[i]);
  } else {
    uint16_t* p = static_cast<uint16_t*>(base) + offset;
    for (int i = 0; i < n; ++i) p[i] = FloatToHalfBits(src[i]);
  }
}

}  // namespace attn::kernels::cpu
