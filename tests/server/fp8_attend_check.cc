#include "fp8_attend_check.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "attn/kernels/dtype_convert.h"
#include "common/reference.h"

namespace attn::testing {

Fp8Tensor QuantizeFp8(const std::vector<double>& x, const std::vector<int32_t>& cu, int heads,
                      int d, bool per_head) {
  Fp8Quantized f = QuantizeE4m3(x, cu, heads, d);
  if (!per_head) {
    const float s = *std::max_element(f.scales.begin(), f.scales.end());
    f.scales.assign(1, s);
    for (size_t i = 0; i < x.size(); ++i) {
      f.codes[i] = kernels::cpu::FloatToE4m3Bits(static_cast<float>(x[i] / s));
      f.values[i] = E4m3ToDouble(f.codes[i]) * s;
    }
  }
  Fp8Tensor t;
  t.codes.dtype = client::DType::kFloat8E4M3;
  t.codes.shape = {cu.back(), heads, d};
  t.codes.data.assign(f.codes.begin(), f.codes.end());
  t.descale = std::move(f.scales);
  t.values = std::move(f.values);
  return t;
}

Fp8Attend MakeFp8Attend(const Fp8AttendCase& c, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  auto random = [&](int64_t n) {
    std::vector<double> x(n);
    for (double& e : x) e = normal(rng);
    return x;
  };
  const int d = c.head_dim;
  const int64_t rows_q = c.cu_q.back(), rows_k = c.cu_k.back();
  Fp8Attend a;
  a.k = QuantizeFp8(random(rows_k * c.kv_heads * d), c.cu_k, c.kv_heads, d, c.per_head);
  a.v = QuantizeFp8(random(rows_k * c.kv_heads * d), c.cu_k, c.kv_heads, d, c.per_head);
  const std::vector<double> qx = random(rows_q * c.heads * d);
  a.shape.num_heads = c.heads;
  a.shape.num_kv_heads = c.kv_heads;
  a.shape.head_dim = d;
  a.shape.causal = c.causal;
  a.options.cu_seqlens_q = c.cu_q;
  a.options.cu_seqlens_k = c.cu_k;
  a.options.causal = c.causal;
  a.options.k_descale = a.k.descale;
  a.options.v_descale = a.v.descale;
  a.out_type = c.q_type;
  if (c.q_type == client::DType::kFloat8E4M3) {
    // q's descales are per (sequence, KV head): each KV head's group of query heads quantizes
    // together, as [rows, kv_heads, group * d].
    Fp8Tensor q = QuantizeFp8(qx, c.cu_q, c.kv_heads, (c.heads / c.kv_heads) * d, c.per_head);
    q.codes.shape = {rows_q, c.heads, d};
    a.q = std::move(q.codes);
    a.q_values = std::move(q.values);
    a.options.q_descale = std::move(q.descale);
    a.out_type = c.per_head ? client::DType::kFloat16 : client::DType::kBFloat16;
    a.options.o_dtype = a.out_type;
  } else {
    a.q = client::Tensor::FromFloats(c.q_type, {rows_q, c.heads, d},
                                     std::vector<float>(qx.begin(), qx.end()));
    const std::vector<float> f = a.q.ToFloats();
    a.q_values.assign(f.begin(), f.end());
  }
  return a;
}

double Fp8AttendError(const Fp8Attend& a, const client::Tensor& o) {
  constexpr double kBad = std::numeric_limits<double>::infinity();
  if (o.dtype != a.out_type || o.shape != a.q.shape) return kBad;
  const ReferenceResult ref = ReferenceAttention(a.shape, a.q_values, a.k.values, a.v.values,
                                                 a.options.cu_seqlens_q, a.options.cu_seqlens_k);
  const std::vector<float> got = o.ToFloats();
  if (got.size() != ref.o.size()) return kBad;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    if (!std::isfinite(got[i])) return kBad;
    num += (got[i] - ref.o[i]) * (got[i] - ref.o[i]);
    den += ref.o[i] * ref.o[i];
  }
  return std::sqrt(num / den);
}

}  // namespace attn::testing
