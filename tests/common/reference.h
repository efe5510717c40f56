// Test-only helpers: a plain float64 attention reference, dtype conversion, random inputs.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "attn/kernels/attention.h"

namespace attn::testing {

// Converts between float and the wire dtypes (round to nearest even).
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t b);

// A host tensor of any dtype, stored as raw bytes, with float views for checking.
struct HostTensor {
  kernels::DType dtype = kernels::DType::kFloat32;
  int64_t elements = 0;
  std::vector<uint8_t> bytes;

  static HostTensor Random(kernels::DType dtype, int64_t elements, std::mt19937_64& rng,
                           float lo = -1.0f, float hi = 1.0f);
  static HostTensor Filled(kernels::DType dtype, int64_t elements, float value);
  std::vector<double> ToDouble() const;
  float At(int64_t i) const;
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
};

// Plain float64 attention with the semantics documented in attn/kernels/attention.h.
// q/k/v are already converted to double; cu_seqlens are host vectors of batch + 1 entries.
struct ReferenceResult {
  std::vector<double> o;    // [total_q, num_heads, head_dim]
  std::vector<double> lse;  // [num_heads, total_q], -inf where a row sees no key
};
ReferenceResult ReferenceAttention(const kernels::AttentionArgs& shape_and_flags,
                                   const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v,
                                   const std::vector<int32_t>& cu_seqlens_q,
                                   const std::vector<int32_t>& cu_seqlens_k);

// Per query row (indexed as ReferenceResult::lse), the largest over the keys the row sees of
// scale * sum_c |q_c k_c|: the magnitude a tensor core's sum of the row's products is aligned to,
// against which its accumulation error is bounded. -inf for rows that see no key.
std::vector<double> ScoreMagnitudes(const kernels::AttentionArgs& shape_and_flags,
                                    const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<int32_t>& cu_seqlens_q,
                                    const std::vector<int32_t>& cu_seqlens_k);

// x rounded to the nearest OCP E4M3FN value (ties to even), saturated at +-448.
double RoundToE4m3(double x);

// Relative L2 error ||got - ref|| / ||ref|| and the largest absolute error.
struct ErrorStats {
  double rel_l2 = 0;
  double max_abs = 0;
  int64_t non_finite = 0;  // NaN/Inf in got where ref is finite
};
ErrorStats CompareTo(const std::vector<double>& ref, const HostTensor& got);
ErrorStats CompareLse(const std::vector<double>& ref, const std::vector<float>& got);

// OCP E4M3FN (FP8) code -> its value in float64, from the bit fields with ldexp (written apart
// from the kernels library's conversion): (-1)^S * 2^(E-7) * (1 + M/8), or 2^-6 * M/8 for E = 0;
// NaN for S.1111.111.
double E4m3ToDouble(uint8_t code);

// FP8 K or V of a contiguous [rows, heads, d] tensor, as a KV cache holds it: e4m3 codes with one
// scale per (sequence, head), amax / 448 of that sequence's and head's values (1 where all are
// 0), and the float64 values the codes stand for (code value * scale).
struct Fp8Quantized {
  std::vector<uint8_t> codes;  // [rows, heads, d]
  std::vector<float> scales;   // [batch, heads]
  std::vector<double> values;  // [rows, heads, d]
};
Fp8Quantized QuantizeE4m3(const std::vector<double>& x, const std::vector<int32_t>& cu_seqlens,
                          int heads, int d);

// Cumulative lengths of the given sequence lengths: {0, l0, l0+l1, ...}.
std::vector<int32_t> CuSeqlens(const std::vector<int32_t>& lengths);

}  // namespace attn::testing
