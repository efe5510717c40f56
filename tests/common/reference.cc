#include "common/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attn/kernels/dtype_convert.h"
#include "common/score_rows.h"

namespace attn::testing {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToHalf(float f) {
  // Via double arithmetic: exact enough for test data, rounds to nearest even.
  if (std::isnan(f)) return 0x7E00;
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -24) * 0.5) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1;    // a = 1.x * 2^exp
  if (exp < -14) {    // subnormal: units of 2^-24
    double units = std::nearbyint(a * std::ldexp(1.0, 24));
    return sign | static_cast<uint16_t>(units);
  }
  double mant = std::nearbyint((a / std::ldexp(1.0, exp) - 1.0) * 1024.0);
  if (mant >= 1024.0) {
    mant = 0;
    exp += 1;
  }
  if (exp > 15) return sign | 0x7C00;
  return sign | static_cast<uint16_t>(((exp + 15) << 10) | static_cast<int>(mant));
}

float HalfToFloat(uint16_t h) {
  int sign = (h >> 15) & 1;
  int exp = (h >> 10) & 0x1F;
  int mant = h & 0x3FF;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  }
  return static_cast<float>(sign ? -v : v);
}

double E4m3ToDouble(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xF, mant = code & 7;
  if (exp == 15 && mant == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = exp == 0 ? std::ldexp(mant / 8.0, -6) : std::ldexp(1.0 + mant / 8.0, exp - 7);
  return sign ? -mag : mag;
}

Fp8Quantized QuantizeE4m3(const std::vector<double>& x, const std::vector<int32_t>& cu, int heads,
                          int d) {
  Fp8Quantized out;
  out.codes.resize(x.size());
  out.values.resize(x.size());
  const size_t batch = cu.size() - 1;
  out.scales.assign(batch * heads, 1.0f);
  for (size_t b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      double amax = 0;
      for (int64_t r = cu[b]; r < cu[b + 1]; ++r)
        for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(x[(r * heads + h) * d + c]));
      const float scale = amax > 0 ? static_cast<float>(amax / 448.0) : 1.0f;
      out.scales[b * heads + h] = scale;
      for (int64_t r = cu[b]; r < cu[b + 1]; ++r) {
        for (int c = 0; c < d; ++c) {
          const size_t i = (r * heads + h) * d + c;
          out.codes[i] = kernels::cpu::FloatToE4m3Bits(static_cast<float>(x[i] / scale));
          out.values[i] = E4m3ToDouble(out.codes[i]) * scale;
        }
      }
    }
  }
  return out;
}

HostTensor HostTensor::Random(kernels::DType dtype, int64_t elements, std::mt19937_64& rng,
                              float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  HostTensor t;
  t.dtype = dtype;
  t.elements = elements;
  t.bytes.resize(elements * kernels::DTypeSize(dtype));
  for (int64_t i = 0; i < elements; ++i) {
    float x = dist(rng);
    if (dtype == kernels::DType::kFloat32) {
      std::memcpy(t.bytes.data() + 4 * i, &x, 4);
    } else {
      uint16_t h = dtype == kernels::DType::kFloat16 ? FloatToHalf(x) : FloatToBf16(x);
      std::memcpy(t.bytes.data() + 2 * i, &h, 2);
    }
  }
  return t;
}

HostTensor HostTensor::Filled(kernels::DType dtype, int64_t elements, float value) {
  HostTensor t;
  t.dtype = dtype;
  t.elements = elements;
  t.bytes.resize(elements * kernels::DTypeSize(dtype));
  for (int64_t i = 0; i < elements; ++i) {
    if (dtype == kernels::DType::kFloat32) {
      std::memcpy(t.bytes.data() + 4 * i, &value, 4);
    } else {
      uint16_t h = dtype == kernels::DType::kFloat16 ? FloatToHalf(value) : FloatToBf16(value);
      std::memcpy(t.bytes.data() + 2 * i, &h, 2);
    }
  }
  return t;
}

float HostTensor::At(int64_t i) const {
  if (dtype == kernels::DType::kFloat32) {
    float x;
    std::memcpy(&x, bytes.data() + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == kernels::DType::kFloat16 ? HalfToFloat(h) : Bf16ToFloat(h);
}

std::vector<double> HostTensor::ToDouble() const {
  std::vector<double> out(elements);
  for (int64_t i = 0; i < elements; ++i) out[i] = At(i);
  return out;
}

ATTN_TEST_THREAD_PRIVATE
ReferenceResult ReferenceAttention(const kernels::AttentionArgs& a, const std::vector<double>& q,
                                   const std::vector<double>& k, const std::vector<double>& v,
                                   const std::vector<int32_t>& cu_q,
                                   const std::vector<int32_t>& cu_k) {
  const int h_kv = a.num_kv_heads, d = a.head_dim;
  return ForEachScoreRow(a, q, k, cu_q, cu_k,
                         [&](double* o, double* lse, int64_t k0, const std::vector<double>& s,
                             int hk, int64_t) ATTN_TEST_THREAD_PRIVATE {
    double mx = kNegInf;
    for (double x : s) mx = std::max(mx, x);
    if (mx == kNegInf) return;
    double sum = 0;
    for (double x : s) sum += std::exp(x - mx);
    for (size_t j = 0; j < s.size(); ++j) {
      const double p_j = std::exp(s[j] - mx) / sum;
      if (p_j == 0) continue;
      for (int c = 0; c < d; ++c) o[c] += p_j * v[((k0 + int64_t(j)) * h_kv + hk) * d + c];
    }
    *lse = mx + std::log(sum);
  });
}

std::vector<double> ScoreMagnitudes(const kernels::AttentionArgs& a, const std::vector<double>& q,
                                    const std::vector<double>& k, const std::vector<int32_t>& cu_q,
                                    const std::vector<int32_t>& cu_k) {
  std::vector<double> q_abs(q.size()), k_abs(k.size());
  for (size_t i = 0; i < q.size(); ++i) q_abs[i] = std::fabs(q[i]);
  for (size_t i = 0; i < k.size(); ++i) k_abs[i] = std::fabs(k[i]);
  return ForEachScoreRow(a, q_abs, k_abs, cu_q, cu_k,
                         [](double*, double* lse, int64_t, const std::vector<double>& s, int,
                            int64_t) ATTN_TEST_THREAD_PRIVATE {
                           for (double x : s) *lse = std::max(*lse, x);
                         })
      .lse;
}

double RoundToE4m3(double x) {
  if (std::isnan(x) || x == 0) return x;
  const double a = std::min(std::fabs(x), 448.0);
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): the leading bit is 2^(e-1)
  // Three mantissa bits below the leading one; subnormals (below 2^-6) in steps of 2^-9.
  const double quantum = e - 1 < -6 ? std::ldexp(1.0, -9) : std::ldexp(1.0, e - 1 - 3);
  const double r = std::min(std::nearbyint(a / quantum) * quantum, 448.0);
  return x < 0 ? -r : r;
}

ErrorStats CompareTo(const std::vector<double>& ref, const HostTensor& got) {
  ErrorStats e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got.At(static_cast<int64_t>(i));
    if (!std::isfinite(g)) {
      ++e.non_finite;
      continue;
    }
    const double diff = g - ref[i];
    num += diff * diff;
    den += ref[i] * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(diff));
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

ErrorStats CompareLse(const std::vector<double>& ref, const std::vector<float>& got) {
  ErrorStats e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool ref_inf = std::isinf(ref[i]);
    const bool got_inf = std::isinf(got[i]) && got[i] < 0;
    if (ref_inf || got_inf) {
      if (ref_inf != got_inf) ++e.non_finite;
      continue;
    }
    if (!std::isfinite(got[i])) {
      ++e.non_finite;
      continue;
    }
    const double diff = got[i] - ref[i];
    num += diff * diff;
    den += ref[i] * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(diff));
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

std::vector<int32_t> CuSeqlens(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

}  // namespace attn::testing
