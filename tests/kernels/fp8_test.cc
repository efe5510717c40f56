// FP8 (OCP E4M3FN) K/V on the host: the e4m3 conversions of dtype_convert.h against an independent
// float64 decode of all 256 codes and a brute-force nearest-value search (round to nearest even,
// saturation to +-448, NaN), and the CPU backend with FP8 K/V (contiguous and paged, every q
// dtype) against the float64 reference over the values the codes stand for; bad FP8 arguments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/dtype_convert.h"
#include "common/fp8_model.h"
#include "common/reference.h"

namespace attn {
namespace {

using kernels::AttentionArgs;
using kernels::DType;
using kernels::cpu::E4m3BitsToFloat;
using kernels::cpu::FloatToE4m3Bits;
using testing::HostTensor;

// Every code's value written out from the format's definition, in float64 with pow: the 127
// non-negative finite values are 0, the subnormals m * 2^-9 (m = 1..7) and (8 + m) * 2^(e - 10)
// for e = 1..15 (m = 0..6 at e = 15; S.1111.111 is NaN).
double Definition(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? m * std::pow(2.0, -9) : (8 + m) * std::pow(2.0, e - 10);
  return (code & 0x80) ? -mag : mag;
}

TEST(E4m3, EveryCodeDecodesToItsValue) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double want = Definition(c);
    const float got = E4m3BitsToFloat(static_cast<uint8_t>(c));
    const double ref = testing::E4m3ToDouble(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_TRUE(std::isnan(ref)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(ref, want) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;  // -0 is 0x80
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(E4m3BitsToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4m3BitsToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4m3BitsToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(E4m3, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(FloatToE4m3Bits(E4m3BitsToFloat(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

// The code FloatToE4m3Bits must give for x, by search: the finite value nearest to x, ties to the
// code with an even mantissa (its lowest bit 0); |x| >= 448 and the infinities give +-448; NaN
// gives S.1111.111.
int Nearest(double x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(Definition(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

void ExpectNearest(float x) {
  EXPECT_EQ(int(FloatToE4m3Bits(x)), Nearest(x)) << "x = " << x << " (" << std::hexfloat << x << ")";
}

TEST(E4m3, RoundsToNearestEven) {
  // The midpoints between neighbouring codes (exact in float), and one float either side.
  for (int c = 0; c < 0x7E; ++c) {
    const float mid = static_cast<float>((Definition(c) + Definition(c + 1)) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      ExpectNearest(x);
      ExpectNearest(-x);
    }
  }
  // Ties go to the even code: 2^-10 (between 0 and 2^-9) to 0, 3 * 2^-10 to 2 * 2^-9, 17 (between
  // 16 and 18) to 16, 19 to 20.
  EXPECT_EQ(FloatToE4m3Bits(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(FloatToE4m3Bits(3 * std::ldexp(1.0f, -10)), 0x02);
  EXPECT_EQ(E4m3BitsToFloat(FloatToE4m3Bits(17.0f)), 16.0f);
  EXPECT_EQ(E4m3BitsToFloat(FloatToE4m3Bits(19.0f)), 20.0f);
  // Random magnitudes from 2^-14 to 2^10 (past the largest value), both signs.
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<double> log2mag(-14.0, 10.0);
  for (int i = 0; i < 200000; ++i) {
    const float x = static_cast<float>(std::exp2(log2mag(rng))) * ((i & 1) ? -1.0f : 1.0f);
    ExpectNearest(x);
  }
}

TEST(E4m3, SaturatesAndKeepsNaN) {
  EXPECT_EQ(FloatToE4m3Bits(448.0f), 0x7E);
  EXPECT_EQ(FloatToE4m3Bits(463.99f), 0x7E);  // would round to 448 anyway
  EXPECT_EQ(FloatToE4m3Bits(464.0f), 0x7E);   // the tie with 480, which e4m3fn does not have
  EXPECT_EQ(FloatToE4m3Bits(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4m3Bits(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(FloatToE4m3Bits(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToE4m3Bits(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToE4m3Bits(-500.0f), 0xFE);
  EXPECT_EQ(FloatToE4m3Bits(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(FloatToE4m3Bits(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(FloatToE4m3Bits(0.0f), 0x00);
  EXPECT_EQ(FloatToE4m3Bits(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4m3Bits(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(FloatToE4m3Bits(std::ldexp(1.0f, -9)), 0x01);  // the smallest subnormal
}

// ---- The CPU backend with FP8 K/V ----------------------------------------------------------------

struct Fp8Case {
  DType q_dtype = DType::kBFloat16;
  int heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  std::vector<int32_t> len_q;
  std::vector<int32_t> len_k;
  bool causal = true;
  int window_left = -1;
  int page_size = 0;  // 0: contiguous
};

double OutputTolerance(DType t) {
  return t == DType::kFloat32 ? 2e-6 : t == DType::kFloat16 ? 1e-3 : 6e-3;
}

void RunFp8OnCpu(const Fp8Case& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << kernels::DTypeName(c.q_dtype) << " d=" << c.head_dim
                                    << " page=" << c.page_size << " seed=" << seed);
  std::mt19937_64 rng(seed);
  const auto cu_q = testing::CuSeqlens(c.len_q), cu_k = testing::CuSeqlens(c.len_k);
  const int batch = static_cast<int>(c.len_q.size());
  const int D = c.head_dim, Hkv = c.kv_heads;
  const int64_t row = int64_t(Hkv) * D;
  HostTensor q = HostTensor::Random(c.q_dtype, int64_t(cu_q.back()) * c.heads * D, rng);
  // K/V of varied magnitude per head (the scales differ), quantized per (sequence, KV head).
  std::vector<double> kf(size_t(cu_k.back()) * row), vf(kf.size());
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t i = 0; i < kf.size(); ++i) {
    const double mag = 1.0 + 3.0 * ((i / D) % Hkv);
    kf[i] = mag * normal(rng);
    vf[i] = mag * normal(rng) + 0.5;
  }
  const testing::Fp8Quantized kq = testing::QuantizeE4m3(kf, cu_k, Hkv, D);
  const testing::Fp8Quantized vq = testing::QuantizeE4m3(vf, cu_k, Hkv, D);

  AttentionArgs a;
  a.dtype = c.q_dtype;
  a.kv_dtype = DType::kFloat8E4M3;
  a.kv_scales.k = kq.scales.data();
  a.kv_scales.v = vq.scales.data();
  a.batch = batch;
  a.total_q = cu_q.back();
  a.total_k = cu_k.back();
  a.max_seqlen_q = *std::max_element(c.len_q.begin(), c.len_q.end());
  a.max_seqlen_k = std::max(1, *std::max_element(c.len_k.begin(), c.len_k.end()));
  a.num_heads = c.heads;
  a.num_kv_heads = Hkv;
  a.head_dim = D;
  a.causal = c.causal;
  a.window_left = c.window_left;
  a.cu_seqlens_q = cu_q.data();
  a.cu_seqlens_k = cu_k.data();
  // Paged: the codes scattered over shuffled pages; every pool byte no key covers is NaN (0x7F).
  std::vector<uint8_t> kpool, vpool;
  std::vector<int32_t> indptr{0}, indices;
  const int ps = c.page_size;
  if (ps > 0) {
    for (int b = 0; b < batch; ++b) indptr.push_back(indptr.back() + (c.len_k[b] + ps - 1) / ps);
    const int num_pages = indptr.back() + 2;
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    indices.assign(perm.begin(), perm.begin() + indptr.back());
    kpool.assign(size_t(num_pages) * ps * row, 0x7F);
    vpool.assign(kpool.size(), 0x7F);
    for (int b = 0; b < batch; ++b) {
      for (int j = 0; j < c.len_k[b]; ++j) {
        const int64_t prow = int64_t(indices[indptr[b] + j / ps]) * ps + j % ps;
        std::memcpy(&kpool[prow * row], &kq.codes[(cu_k[b] + j) * row], row);
        std::memcpy(&vpool[prow * row], &vq.codes[(cu_k[b] + j) * row], row);
      }
    }
    a.paged.page_size = ps;
    a.paged.num_pages = num_pages;
    a.paged.page_indptr = indptr.data();
    a.paged.page_indices = indices.data();
    a.paged.seqlens_k = c.len_k.data();
    a.k = kpool.data();
    a.v = vpool.data();
  } else {
    a.k = kq.codes.data();
    a.v = vq.codes.data();
  }
  HostTensor o = HostTensor::Filled(c.q_dtype, q.elements, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse(size_t(c.heads) * a.total_q, std::numeric_limits<float>::quiet_NaN());
  a.q = q.data();
  a.o = o.data();
  a.lse = lse.data();

  auto pool = kernels::cpu::CpuThreadPool::Create(2);
  std::vector<char> ws(kernels::cpu::WorkspaceBytes(a, pool->NumWorkers()) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
  const kernels::Status st = kernels::cpu::Run(a, aligned, pool.get());
  ASSERT_TRUE(st.ok()) << st.message();

  AttentionArgs shape = a;
  shape.paged = {};
  const auto ref = testing::ReferenceAttention(shape, q.ToDouble(), kq.values, vq.values, cu_q, cu_k);
  const testing::ErrorStats eo = testing::CompareTo(ref.o, o);
  EXPECT_EQ(eo.non_finite, 0);
  EXPECT_LE(eo.rel_l2, OutputTolerance(c.q_dtype)) << "max abs " << eo.max_abs;
  const testing::ErrorStats el = testing::CompareLse(ref.lse, lse);
  EXPECT_EQ(el.non_finite, 0);
  EXPECT_LE(el.max_abs, 1e-4);
}

// The float64 e4m3 rounding of the FP8 tensor-core model (common/reference.h) against the codes:
// every value is its own rounding, points between neighbours go to the nearer (ties to the even
// code), and it agrees with the kernels library's float conversion on random values.
TEST(E4m3, ModelRoundingMatchesTheCodes) {
  for (int c = 0; c < 0x7E; ++c) {
    const double v = testing::E4m3ToDouble(uint8_t(c)), next = testing::E4m3ToDouble(uint8_t(c + 1));
    EXPECT_EQ(testing::RoundToE4m3(v), v) << c;
    EXPECT_EQ(testing::RoundToE4m3(-v), -v) << c;
    EXPECT_EQ(testing::RoundToE4m3(v + 0.25 * (next - v)), v) << c;
    EXPECT_EQ(testing::RoundToE4m3(v + 0.75 * (next - v)), next) << c;
    EXPECT_EQ(testing::RoundToE4m3(0.5 * (v + next)), c % 2 == 0 ? v : next) << c;
  }
  EXPECT_EQ(testing::RoundToE4m3(1e6), 448.0);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> log2x(-12.0, 8.7);
  for (int i = 0; i < 20000; ++i) {
    const float x = float(std::exp2(log2x(rng)));
    EXPECT_EQ(testing::RoundToE4m3(x), E4m3BitsToFloat(FloatToE4m3Bits(x))) << x;
  }
}

double Rel(const std::vector<double>& x, const std::vector<double>& y) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num / den);
}

// A causal GQA shape (4 query heads on 2 KV heads, d=16) over the given sequences.
AttentionArgs SmallCausalShape(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k) {
  AttentionArgs a;
  a.batch = static_cast<int>(cu_q.size()) - 1;
  a.num_heads = 4;
  a.num_kv_heads = 2;
  a.head_dim = 16;
  a.causal = true;
  a.total_q = cu_q.back();
  a.total_k = cu_k.back();
  return a;
}

// The model of the FP8 tensor-core kernel: exact where every p is an e4m3 value (equal scores:
// p = 256 for each key), and close to, but not equal to, the exact attention on random scores
// (the rounding of P is a few per cent per element; o's error averages out over the keys).
TEST(Fp8TensorCoreModel, RoundsOnlyP) {
  const std::vector<int32_t> cu_q = testing::CuSeqlens({5, 40}), cu_k = testing::CuSeqlens({300, 40});
  const AttentionArgs a = SmallCausalShape(cu_q, cu_k);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> q(size_t(a.total_q) * 4 * 16, 0.0), k(size_t(a.total_k) * 2 * 16), v(k.size());
  for (double& x : k) x = normal(rng);
  for (double& x : v) x = normal(rng);
  const auto ref0 = testing::ReferenceAttention(a, q, k, v, cu_q, cu_k);
  const auto model0 = testing::Fp8TensorCoreModel(a, q, k, v, cu_q, cu_k);
  EXPECT_LT(Rel(model0.o, ref0.o), 1e-12);
  for (double& x : q) x = 2.0 * normal(rng);
  const auto ref = testing::ReferenceAttention(a, q, k, v, cu_q, cu_k);
  const auto model = testing::Fp8TensorCoreModel(a, q, k, v, cu_q, cu_k);
  EXPECT_GT(Rel(model.o, ref.o), 1e-4);
  EXPECT_LT(Rel(model.o, ref.o), 5e-2);
  double lse_err = 0;
  for (size_t i = 0; i < ref.lse.size(); ++i) lse_err = std::max(lse_err, std::fabs(model.lse[i] - ref.lse[i]));
  EXPECT_LT(lse_err, 1e-9);  // the row sum is of unrounded p
}

// RoundedSumLseBounds' check of one rule (rounded sums, lazy rescale of `lazy` eighths) and score
// error err (rel of each row's magnitude): the model inside its interval, q perturbed by rel
// inside too, and the interval closed on the model where the scores are exact.
void ExpectRoundedSumLseBounds(const AttentionArgs& a, const std::vector<double>& q, const std::vector<double>& k,
                               const std::vector<double>& v, const std::vector<int32_t>& cu_q,
                               const std::vector<int32_t>& cu_k, const std::vector<double>& err, double rel,
                               int lazy, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  testing::Fp8SoftmaxModel rule;
  rule.sums_rounded_p = true;
  rule.lazy_rescale_eighths = lazy;
  const testing::LseBounds b = testing::Fp8TensorCoreLseBounds(a, q, k, cu_q, cu_k, err, rule);
  const auto model = testing::Fp8TensorCoreModel(a, q, k, v, cu_q, cu_k, rule);
  ASSERT_EQ(b.lo.size(), model.lse.size());
  int64_t outside = 0, moved = 0;
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<double> qp = q;
    for (double& x : qp) x *= 1.0 + rel * unit(rng);
    const auto perturbed = testing::Fp8TensorCoreModel(a, qp, k, v, cu_q, cu_k, rule);
    for (size_t i = 0; i < b.lo.size(); ++i) {
      outside += perturbed.lse[i] < b.lo[i] - 1e-12 || perturbed.lse[i] > b.hi[i] + 1e-12;
      moved += std::fabs(perturbed.lse[i] - model.lse[i]) > 1e-6;
    }
  }
  EXPECT_EQ(outside, 0);
  EXPECT_GT(moved, 0);  // the perturbation did move the rounded sums
  for (size_t i = 0; i < b.lo.size(); ++i) {
    EXPECT_LE(b.lo[i], model.lse[i] + 1e-12) << i;
    EXPECT_GE(b.hi[i], model.lse[i] - 1e-12) << i;
    // 2e for the max, up to 4e more on each term and an e4m3 step's share (R(y) / y within
    // 15/16..17/16; subnormal p, which could stretch it, weigh nothing here).
    if (!std::isinf(model.lse[i])) EXPECT_LT(b.hi[i] - b.lo[i], 6 * err[i] + 0.13) << i;
  }
  const testing::LseBounds b0 =
      testing::Fp8TensorCoreLseBounds(a, q, k, cu_q, cu_k, std::vector<double>(err.size(), 0.0), rule);
  for (size_t i = 0; i < b0.lo.size(); ++i) {
    if (std::isinf(model.lse[i])) continue;
    EXPECT_NEAR(b0.lo[i], model.lse[i], 1e-12) << i;
    EXPECT_NEAR(b0.hi[i], model.lse[i], 1e-12) << i;
  }
}

// The LSE interval of the kernel whose row sums are of the rounded P, with and without the lazy
// rescale: the model's own LSE (its scores exact) lies inside, and so does the model's on q
// perturbed by up to 2^-10 per element (each score then moves by at most 2^-10 of its row's
// magnitude, the error allowed; with the lazy rescale that flips some groups' choices to
// rescale). With exact scores the interval closes on the model's LSE.
TEST(Fp8TensorCoreModel, RoundedSumLseBounds) {
  // Groups of 16 rows over several key tiles (the third sequence), cut short (7 rows), one tile.
  const std::vector<int32_t> cu_q = testing::CuSeqlens({7, 60, 40}), cu_k = testing::CuSeqlens({600, 60, 700});
  const AttentionArgs a = SmallCausalShape(cu_q, cu_k);
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> q(size_t(a.total_q) * 4 * 16), k(size_t(a.total_k) * 2 * 16), v(k.size());
  for (double& x : k) x = normal(rng);
  for (double& x : v) x = normal(rng);
  // Sharp rows (a few keys hold most weight; their max grows past the slack on most tiles) and
  // mild ones (it seldom does: the lazy rescale keeps most maxima).
  for (const double q_scale : {3.0, 0.5}) {
    std::mt19937_64 q_rng(17);
    for (double& x : q) x = q_scale * normal(q_rng);
    const std::vector<double> mag = testing::ScoreMagnitudes(a, q, k, cu_q, cu_k);
    // The tensor cores' bound, and one 16x larger, under which growths near the slack flip.
    for (const double rel : {1.0 / 1024, 1.0 / 64}) {
      for (int lazy : {0, 6}) {
        SCOPED_TRACE(::testing::Message() << "q scale " << q_scale << " lazy " << lazy << " rel " << rel);
        ExpectRoundedSumLseBounds(a, q, k, v, cu_q, cu_k, testing::ScoreErrors(mag, rel), rel, lazy, rng);
      }
    }
  }
  // The lazy rescale changes P's roundings (a different max), not what o and LSE estimate.
  for (double& x : q) x = 0.5 * normal(rng);
  testing::Fp8SoftmaxModel eager, lazy;
  lazy.lazy_rescale_eighths = 6;
  const auto ref = testing::ReferenceAttention(a, q, k, v, cu_q, cu_k);
  const auto me = testing::Fp8TensorCoreModel(a, q, k, v, cu_q, cu_k, eager);
  const auto ml = testing::Fp8TensorCoreModel(a, q, k, v, cu_q, cu_k, lazy);
  double lse_diff = 0;
  for (size_t i = 0; i < ref.lse.size(); ++i) lse_diff = std::max(lse_diff, std::fabs(ml.lse[i] - ref.lse[i]));
  EXPECT_LT(lse_diff, 1e-9);  // unrounded sums: the max cancels exactly
  EXPECT_GT(Rel(ml.o, me.o), 1e-6);
  EXPECT_LT(Rel(ml.o, ref.o), 1.5 * Rel(me.o, ref.o) + 1e-3);
}

TEST(CpuFp8Kv, DecodeAndPrefillContiguousAndPaged) {
  uint64_t seed = 900;
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int page : {0, 16, 5}) {
      Fp8Case c;
      c.q_dtype = t;
      c.page_size = page;
      c.len_q = {1, 1, 4, 1};
      c.len_k = {1, 37, 200, 0};  // a decode step over an empty cache: o = 0, lse = -inf
      if (page == 0) c.len_k[3] = 3;
      RunFp8OnCpu(c, ++seed);
      c.len_q = {30, 70};  // chunks over cached keys
      c.len_k = {100, 70};
      c.window_left = 40;
      RunFp8OnCpu(c, ++seed);
    }
  }
  Fp8Case mha;
  mha.kv_heads = 8;
  mha.head_dim = 128;
  mha.causal = false;
  mha.len_q = {3, 1};
  mha.len_k = {65, 300};
  RunFp8OnCpu(mha, ++seed);
}

// ---- Bad FP8 arguments: a status naming the field ------------------------------------------------

AttentionArgs ValidFp8Args(const float* k_scale, const float* v_scale) {
  static int dummy[16] = {};
  static const int32_t cu[2] = {0, 1};
  AttentionArgs a;
  a.dtype = DType::kBFloat16;
  a.kv_dtype = DType::kFloat8E4M3;
  a.kv_scales.k = k_scale;
  a.kv_scales.v = v_scale;
  a.q = a.k = a.v = dummy;
  a.o = dummy;
  a.cu_seqlens_q = a.cu_seqlens_k = cu;
  a.total_q = a.total_k = 1;
  a.max_seqlen_q = a.max_seqlen_k = 1;
  a.num_heads = 4;
  a.num_kv_heads = 2;
  a.head_dim = 64;
  return a;
}

void ExpectInvalid(const kernels::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
}

TEST(CpuFp8Kv, BadArgumentsNameTheField) {
  const float ones[2] = {1.0f, 1.0f};
  EXPECT_TRUE(kernels::cpu::CanImplement(ValidFp8Args(ones, ones)).ok());
  ExpectInvalid(kernels::ValidateCommon(ValidFp8Args(nullptr, ones)), "kv_scales");
  ExpectInvalid(kernels::ValidateCommon(ValidFp8Args(ones, nullptr)), "kv_scales");
  AttentionArgs a = ValidFp8Args(ones, ones);
  a.dtype = DType::kFloat8E4M3;  // FP8 queries: no such kernel
  ExpectInvalid(kernels::ValidateCommon(a), "dtype");
  a = ValidFp8Args(ones, ones);
  a.kv_dtype = DType::kFloat16;  // neither dtype nor FP8
  ExpectInvalid(kernels::ValidateCommon(a), "kv_dtype");
  a.kv_dtype = DType::kBFloat16;  // the same as dtype: plain 16-bit K/V, no scales needed
  a.kv_scales = {};
  EXPECT_TRUE(kernels::ValidateCommon(a).ok());
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    const float k_bad[2] = {1.0f, bad};
    const kernels::Status st = kernels::cpu::CanImplement(ValidFp8Args(k_bad, ones));
    ExpectInvalid(st, "kv_scales.k[1]");
    EXPECT_NE(st.message().find("KV head 1"), std::string::npos) << st.message();
    ExpectInvalid(kernels::ValidateKvScales(ValidFp8Args(ones, k_bad)), "kv_scales.v[1]");
  }
}

}  // namespace
}  // namespace attn
