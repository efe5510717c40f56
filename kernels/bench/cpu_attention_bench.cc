// CPU backend against a plain single-threaded triple loop on the same inputs.
// Prints GFLOP/s for s in {1k, 4k} and d in {64, 128} (bf16 in and out, 2 heads, non-causal).
//   cpu_attention_bench [--threads N] [--heads H]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/dtype_convert.h"

namespace {

using attn::kernels::AttentionArgs;
using attn::kernels::DType;

// O = softmax(Q K^T * scale) V, one query row at a time with a full row of scores.
void NaiveAttention(const AttentionArgs& a, const std::vector<float>& q,
                    const std::vector<float>& k, const std::vector<float>& v,
                    std::vector<float>& o) {
  const int s = a.total_q, h = a.num_heads, d = a.head_dim;
  const float scale = attn::kernels::EffectiveSoftmaxScale(a);
  std::vector<float> p(s);
  for (int head = 0; head < h; ++head) {
    for (int i = 0; i < s; ++i) {
      float mx = -INFINITY;
      for (int j = 0; j < s; ++j) {
        float dot = 0;
        for (int c = 0; c < d; ++c) dot += q[(i * h + head) * d + c] * k[(j * h + head) * d + c];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0;
      for (int j = 0; j < s; ++j) sum += (p[j] = std::exp(p[j] - mx));
      float* out = &o[(i * h + head) * d];
      for (int c = 0; c < d; ++c) out[c] = 0;
      for (int j = 0; j < s; ++j) {
        for (int c = 0; c < d; ++c) out[c] += p[j] / sum * v[(j * h + head) * d + c];
      }
    }
  }
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0, heads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--heads")) heads = std::atoi(argv[i + 1]);
  }
  auto pool = attn::kernels::cpu::CpuThreadPool::Create(threads);
  std::printf("CPU backend (%d threads) vs plain single-threaded loop; bf16, %d heads, "
              "non-causal, one sequence\n",
              pool->NumWorkers(), heads);
  std::printf("%6s %5s %14s %14s %9s %10s\n", "s", "d", "tiled GFLOP/s", "plain GFLOP/s",
              "speedup", "rel_err");
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (int s : {1024, 4096}) {
    for (int d : {64, 128}) {
      const size_t n = size_t(s) * heads * d;
      std::vector<uint16_t> qb(n), kb(n), vb(n), ob(n);
      std::vector<float> qf(n), kf(n), vf(n), of(n);
      for (size_t i = 0; i < n; ++i) {
        qb[i] = attn::kernels::cpu::FloatToBf16Bits(dist(rng));
        kb[i] = attn::kernels::cpu::FloatToBf16Bits(dist(rng));
        vb[i] = attn::kernels::cpu::FloatToBf16Bits(dist(rng));
        qf[i] = attn::kernels::cpu::Bf16BitsToFloat(qb[i]);
        kf[i] = attn::kernels::cpu::Bf16BitsToFloat(kb[i]);
        vf[i] = attn::kernels::cpu::Bf16BitsToFloat(vb[i]);
      }
      const int32_t cu[2] = {0, s};
      AttentionArgs a;
      a.dtype = DType::kBFloat16;
      a.q = qb.data();
      a.k = kb.data();
      a.v = vb.data();
      a.o = ob.data();
      a.cu_seqlens_q = cu;
      a.cu_seqlens_k = cu;
      a.total_q = a.total_k = a.max_seqlen_q = a.max_seqlen_k = s;
      a.num_heads = a.num_kv_heads = heads;
      a.head_dim = d;
      std::vector<char> ws(attn::kernels::cpu::WorkspaceBytes(a, pool->NumWorkers()) + 64);
      void* wsa = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
      const double flops = attn::kernels::AttentionFlops(a, cu, cu);

      attn::kernels::cpu::Run(a, wsa, pool.get());  // warm-up
      int reps = 0;
      const auto t0 = std::chrono::steady_clock::now();
      do {
        attn::kernels::Status st = attn::kernels::cpu::Run(a, wsa, pool.get());
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", st.message().c_str());
          return 1;
        }
        ++reps;
      } while (Seconds(t0) < 1.0);
      const double tiled = flops * reps / Seconds(t0) / 1e9;

      AttentionArgs plain_args = a;
      plain_args.dtype = DType::kFloat32;
      const auto t1 = std::chrono::steady_clock::now();
      NaiveAttention(plain_args, qf, kf, vf, of);
      const double plain = flops / Seconds(t1) / 1e9;

      double num = 0, den = 0;
      for (size_t i = 0; i < n; ++i) {
        const double g = attn::kernels::cpu::Bf16BitsToFloat(ob[i]);
        num += (g - of[i]) * (g - of[i]);
        den += double(of[i]) * of[i];
      }
      std::printf("%6d %5d %14.2f %14.2f %8.1fx %10.2e\n", s, d, tiled, plain, tiled / plain,
                  std::sqrt(num / den));
    }
  }
  return 0;
}
