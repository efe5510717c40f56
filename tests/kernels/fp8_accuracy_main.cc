// fp8_accuracy: RMSE of attention with FP8 (E4M3) inputs against a float64 reference on the
// unquantized inputs, with the CPU backend's semantics (kernels::cpu::Run: dequantize with the
// scale, compute in float). Prints a table; docs/FP8.md records it and the command.
//
// Modes, each against the float64 attention of the same float64 inputs:
//   bf16          q, k, v rounded to bfloat16 (the baseline)
//   fp8kv/head    q bf16; k, v E4M3 with a scale per (sequence, KV head) = amax / 448
//   fp8kv/tensor  q bf16; k, v E4M3 with one scale per tensor
//   fp8 all       q, k, v E4M3, scales per (sequence, KV head); q's codes widened to bf16 and its
//                 scale folded into k's, as attnd's CPU backend runs all-FP8 Attend
//   fp8 TC        the same codes as the CUDA FP8 tensor-core kernel computes them (P rounded to
//                 e4m3 for the P V product; testing::Fp8TensorCoreModel, float64)
// Output o is bfloat16 in every mode. Usage: fp8_accuracy [seqlen] [seed]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/cpu_thread_pool.h"
#include "attn/kernels/dtype_convert.h"
#include "common/fp8_model.h"
#include "common/reference.h"

namespace attn {
namespace {

using kernels::AttentionArgs;
using kernels::DType;

enum class Distribution { kNormal, kSparseOutliers, kOutlierChannels };

const char* Name(Distribution d) {
  switch (d) {
    case Distribution::kNormal: return "normal";
    case Distribution::kSparseOutliers: return "sparse outliers";
    case Distribution::kOutlierChannels: return "outlier channels";
  }
  return "";
}

// [rows, heads, d] values of the distribution: N(0, 1) elements; sparse outliers add N(0, 10^2)
// to each element with probability 0.001; outlier channels multiply channels c with c % 16 == 3
// (of every head) by 20.
std::vector<double> Draw(Distribution dist, int64_t rows, int heads, int d, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<double> x(size_t(rows) * heads * d);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = normal(rng);
    if (dist == Distribution::kSparseOutliers && unit(rng) < 0.001) x[i] += 10.0 * normal(rng);
    if (dist == Distribution::kOutlierChannels && int(i % d) % 16 == 3) x[i] *= 20.0;
  }
  return x;
}

std::vector<uint16_t> ToBf16(const std::vector<double>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = kernels::cpu::FloatToBf16Bits(float(x[i]));
  return out;
}

double Rmse(const std::vector<double>& ref, const std::vector<uint16_t>& o) {
  double sum = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = kernels::cpu::Bf16BitsToFloat(o[i]) - ref[i];
    sum += e * e;
  }
  return std::sqrt(sum / double(ref.size()));
}

struct Shape {
  int seqlen = 1024;
  int heads = 16;
  int kv_heads = 4;
  int d = 128;
};

// One run of the CPU kernel; returns o's RMSE against ref.
double RunCpu(AttentionArgs a, const std::vector<double>& ref, kernels::cpu::CpuThreadPool* pool) {
  std::vector<uint16_t> o(ref.size(), 0x7FC0);  // NaN until written
  a.o = o.data();
  std::vector<char> ws(kernels::cpu::WorkspaceBytes(a, pool->NumWorkers()) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) &
                                          ~uintptr_t{63});
  const kernels::Status st = kernels::cpu::Run(a, aligned, pool);
  if (!st.ok()) {
    std::fprintf(stderr, "fp8_accuracy: %s\n", std::string(st.message()).c_str());
    std::exit(1);
  }
  return Rmse(ref, o);
}

void Row(Distribution dist, const Shape& s, std::mt19937_64& rng,
         kernels::cpu::CpuThreadPool* pool) {
  const std::vector<int32_t> cu = {0, s.seqlen};
  const std::vector<double> q = Draw(dist, s.seqlen, s.heads, s.d, rng);
  const std::vector<double> k = Draw(dist, s.seqlen, s.kv_heads, s.d, rng);
  const std::vector<double> v = Draw(dist, s.seqlen, s.kv_heads, s.d, rng);
  AttentionArgs a;
  a.dtype = DType::kBFloat16;
  a.batch = 1;
  a.total_q = a.total_k = a.max_seqlen_q = a.max_seqlen_k = s.seqlen;
  a.num_heads = s.heads;
  a.num_kv_heads = s.kv_heads;
  a.head_dim = s.d;
  a.cu_seqlens_q = cu.data();
  a.cu_seqlens_k = cu.data();
  const std::vector<double> ref = testing::ReferenceAttention(a, q, k, v, cu, cu).o;

  const std::vector<uint16_t> q16 = ToBf16(q), k16 = ToBf16(k), v16 = ToBf16(v);
  AttentionArgs bf16 = a;
  bf16.q = q16.data();
  bf16.k = k16.data();
  bf16.v = v16.data();
  const double rmse_bf16 = RunCpu(bf16, ref, pool);

  const testing::Fp8Quantized k8 = testing::QuantizeE4m3(k, cu, s.kv_heads, s.d);
  const testing::Fp8Quantized v8 = testing::QuantizeE4m3(v, cu, s.kv_heads, s.d);
  AttentionArgs fp8kv = bf16;
  fp8kv.kv_dtype = DType::kFloat8E4M3;
  fp8kv.k = k8.codes.data();
  fp8kv.v = v8.codes.data();
  fp8kv.kv_scales = {k8.scales.data(), v8.scales.data()};
  const double rmse_kv_head = RunCpu(fp8kv, ref, pool);

  // One scale per tensor: the largest of the per-head ones (amax of the tensor / 448).
  auto per_tensor = [&](const std::vector<double>& x, const testing::Fp8Quantized& f) {
    const float scale = *std::max_element(f.scales.begin(), f.scales.end());
    std::vector<uint8_t> codes(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      codes[i] = kernels::cpu::FloatToE4m3Bits(float(x[i] / scale));
    }
    return std::pair{codes, std::vector<float>(s.kv_heads, scale)};
  };
  const auto [kt, kts] = per_tensor(k, k8);
  const auto [vt, vts] = per_tensor(v, v8);
  AttentionArgs fp8kv_tensor = fp8kv;
  fp8kv_tensor.k = kt.data();
  fp8kv_tensor.v = vt.data();
  fp8kv_tensor.kv_scales = {kts.data(), vts.data()};
  const double rmse_kv_tensor = RunCpu(fp8kv_tensor, ref, pool);

  // All FP8: q quantized per (sequence, KV head) as [rows, kv_heads, group * d].
  const int group = s.heads / s.kv_heads;
  const testing::Fp8Quantized q8 = testing::QuantizeE4m3(q, cu, s.kv_heads, group * s.d);
  std::vector<uint16_t> q_wide(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q_wide[i] = kernels::cpu::FloatToBf16Bits(kernels::cpu::E4m3BitsToFloat(q8.codes[i]));
  }
  std::vector<float> qk_scales(s.kv_heads);
  for (int g = 0; g < s.kv_heads; ++g) qk_scales[g] = q8.scales[g] * k8.scales[g];
  AttentionArgs all = fp8kv;
  all.q = q_wide.data();
  all.kv_scales.k = qk_scales.data();
  const double rmse_all = RunCpu(all, ref, pool);
  const std::vector<double> tc = testing::Fp8TensorCoreModel(a, q8.values, k8.values, v8.values, cu, cu).o;
  const double rmse_tc = Rmse(ref, ToBf16(tc));

  double rms = 0;
  for (double x : ref) rms += x * x;
  rms = std::sqrt(rms / double(ref.size()));
  std::printf("| %-16s | %3d | %8.2e | %8.2e | %8.2e | %8.2e | %8.2e | %8.2e |\n", Name(dist), s.d,
              rms, rmse_bf16, rmse_kv_head, rmse_kv_tensor, rmse_all, rmse_tc);
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  attn::Shape shape;
  if (argc > 1) shape.seqlen = std::atoi(argv[1]);
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  if (shape.seqlen <= 0) {
    std::fprintf(stderr, "usage: fp8_accuracy [seqlen > 0] [seed]\n");
    return 2;
  }
  auto pool = attn::kernels::cpu::CpuThreadPool::Create(0);
  std::mt19937_64 rng(seed);
  std::printf("seqlen %d, %d query heads, %d KV heads, non-causal, one sequence, o bf16, seed %llu\n\n",
              shape.seqlen, shape.heads, shape.kv_heads, (unsigned long long)seed);
  std::printf("| distribution     |   d | RMS of o | bf16     | fp8kv/head | fp8kv/tensor | fp8 all | fp8 TC |\n");
  std::printf("|------------------|----:|---------:|---------:|---------:|---------:|---------:|---------:|\n");
  for (auto dist : {attn::Distribution::kNormal, attn::Distribution::kSparseOutliers,
                    attn::Distribution::kOutlierChannels}) {
    for (int d : {64, 128, 256}) {
      shape.d = d;
      attn::Row(dist, shape, rng, pool.get());
    }
  }
  return 0;
}
