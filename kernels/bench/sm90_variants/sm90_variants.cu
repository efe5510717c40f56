// sm90_variants: a variant of the sm_90a forward kernel (variant_kernels.h) timed against the
// production kernel on one shape of the standard sweep (bf16, B*S = 16k tokens, H*D = 2048): single
// launches in alternating order on the same inputs, and their outputs compared; exits 1 when they
// do not agree. Without --variant, times the production kernel alone.
//
//   sm90_variants --d 128 --s 16384 [--causal] [--narrow] [--reps 20]
//                 [--variant keys176|keys80|overlap|overlap_keys64|split_mask|trim_edges|exp_fma4|lazy_rescale|eager_rescale
//                  [--production wide|narrow]]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flash_params.h"
#include "variant_kernels.h"
#include "variant_timing.h"

namespace {

using attn::kernels::cuda::FlashParams;

using attn::bench::FromBf16;
using attn::bench::OneLaunchMs;

struct Options {
  int d = 128;
  int s = 4096;
  bool causal = false;
  bool narrow = false;
  // --production wide|narrow: the tiling production runs with against a variant (default: the
  // variant's, from --narrow).
  std::string production;
  int reps = 20;
  std::string variant;  // empty: production alone
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoi(argv[++i]);
    };
    if (a == "--d") o.d = next();
    else if (a == "--s") o.s = next();
    else if (a == "--reps") o.reps = next();
    else if (a == "--causal") o.causal = true;
    else if (a == "--narrow") o.narrow = true;
    else if (a == "--variant" && i + 1 < argc) o.variant = argv[++i];
    else if (a == "--production" && i + 1 < argc) o.production = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: sm90_variants --d 64|128|256 --s N [--causal] [--narrow] [--reps N]\n"
                   "         [--variant keys176|keys80|overlap|overlap_keys64|split_mask|trim_edges|exp_fma4|lazy_rescale|eager_rescale\n"
                   "                    [--production wide|narrow]]\n");
      std::exit(2);
    }
  }
  if (!o.production.empty() && o.production != "wide" && o.production != "narrow") {
    std::fprintf(stderr, "--production must be wide or narrow\n");
    std::exit(2);
  }
  if (o.d != 64 && o.d != 128 && o.d != 256) {
    std::fprintf(stderr, "--d must be 64, 128 or 256\n");
    std::exit(2);
  }
  return o;
}

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return uint16_t(u >> 16);
}

void* DeviceRandom(size_t elems, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> h(elems);
  for (auto& x : h) x = ToBf16(dist(rng));
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, elems * 2));
  CHECK_CUDA(cudaMemcpy(d, h.data(), elems * 2, cudaMemcpyHostToDevice));
  return d;
}

cudaError_t LaunchVariant(const Options& o, const FlashParams& p, int sms,
                          attn::kernels::cuda::Sm90Variant v) {
  using attn::kernels::cuda::LaunchVariantSm90;
  switch (o.d) {
    case 64: return LaunchVariantSm90<64>(p, v, o.narrow, sms, nullptr);
    case 128: return LaunchVariantSm90<128>(p, v, o.narrow, sms, nullptr);
    default: return LaunchVariantSm90<256>(p, v, o.narrow, sms, nullptr);
  }
}

// The production kernel with the wide or narrow tiling and its own launch rules.
cudaError_t LaunchProduction(const Options& o, const FlashParams& p, bool narrow, int sms) {
  using attn::kernels::cuda::PlanFlashFwdSm90;
  using attn::kernels::cuda::RunFlashFwdSm90;
  attn::kernels::cuda::Sm90Choices c;
  c.tiling = narrow ? 2 : 1;
  c.counter = p.tile_counter != nullptr;
  switch (o.d) {
    case 64:
      return RunFlashFwdSm90<__nv_bfloat16, 64>(p, PlanFlashFwdSm90<__nv_bfloat16, 64>(p, c, sms),
                                                nullptr);
    case 128:
      return RunFlashFwdSm90<__nv_bfloat16, 128>(p, PlanFlashFwdSm90<__nv_bfloat16, 128>(p, c, sms),
                                                 nullptr);
    default:
      return RunFlashFwdSm90<__nv_bfloat16, 256>(p, PlanFlashFwdSm90<__nv_bfloat16, 256>(p, c, sms),
                                                 nullptr);
  }
}

template <typename Fn>
double MedianMs(int reps, Fn&& fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps + 2; ++i) {
    const float t = OneLaunchMs(a, b, fn);
    if (i >= 2) ms.push_back(t);  // two warm-up launches
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

std::vector<uint16_t> Download(const void* d, size_t elems) {
  std::vector<uint16_t> h(elems);
  CHECK_CUDA(cudaMemcpy(h.data(), d, elems * 2, cudaMemcpyDeviceToHost));
  return h;
}

// Production and the variant on the same inputs, timed alternately (attn::bench::TimeAlternating,
// after a warm-up of 1.5 s), then their outputs side by side.
int RunVariant(const Options& o, FlashParams p, int sms, size_t elems, double flop) {
  using attn::kernels::cuda::Sm90Variant;
  Sm90Variant v;
  if (o.variant == "keys176") v = Sm90Variant::kKeys176;
  else if (o.variant == "keys80") v = Sm90Variant::kKeys80;
  else if (o.variant == "overlap") v = Sm90Variant::kOverlap;
  else if (o.variant == "overlap_keys64") v = Sm90Variant::kOverlapKeys64;
  else if (o.variant == "split_mask") v = Sm90Variant::kSplitMask;
  else if (o.variant == "trim_edges") v = Sm90Variant::kTrimEdges;
  else if (o.variant == "exp_fma4") v = Sm90Variant::kExpFma4;
  else if (o.variant == "lazy_rescale") v = Sm90Variant::kLazyRescale;
  else if (o.variant == "eager_rescale") v = Sm90Variant::kEagerRescale;
  else {
    std::fprintf(stderr, "unknown --variant %s\n", o.variant.c_str());
    return 2;
  }
  if (LaunchVariant(o, p, sms, v) == cudaErrorNotSupported) {
    std::fprintf(stderr, "--variant %s does not apply to d=%d s=%d causal=%d\n", o.variant.c_str(), o.d,
                 o.s, int(o.causal));
    return 2;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const bool prod_narrow = o.production.empty() ? o.narrow : o.production == "narrow";
  auto prod = [&] { return LaunchProduction(o, p, prod_narrow, sms); };
  auto var = [&] { return LaunchVariant(o, p, sms, v); };
  attn::bench::AlternatingTimes t = attn::bench::TimeAlternating(prod, var, o.reps, 1500);
  // Outputs: each kernel on a poisoned O.
  CHECK_CUDA(cudaMemset(p.o, 0xff, elems * 2));
  CHECK_CUDA(LaunchProduction(o, p, prod_narrow, sms));
  const std::vector<uint16_t> want = Download(p.o, elems);
  CHECK_CUDA(cudaMemset(p.o, 0xff, elems * 2));
  CHECK_CUDA(LaunchVariant(o, p, sms, v));
  const std::vector<uint16_t> got = Download(p.o, elems);
  double max_diff = 0;
  size_t bad = 0;
  for (size_t i = 0; i < elems; ++i) {
    const double d = std::fabs(double(FromBf16(got[i])) - FromBf16(want[i]));
    if (!(d <= 2e-2)) ++bad;  // NaN (the poison) counts
    if (d > max_diff) max_diff = d;
  }
  const double pm = t.shipped.Pct(0.5), vm = t.variant.Pct(0.5);
  std::printf("sm90_variants: d=%d bf16 s=%d causal=%d, variant %s on the %s tiling, production %s\n",
              o.d, o.s, int(o.causal), o.variant.c_str(), o.narrow ? "narrow" : "wide",
              prod_narrow ? "narrow" : "wide");
  std::printf("| kernel | ms (median of %zu rounds) | TFLOP/s | production / kernel per round: median "
              "(p10 - p90) |\n| --- | --- | --- | --- |\n", t.ratio.v.size());
  std::printf("| production | %.4f | %.0f | 1 |\n", pm, flop / pm / 1e9);
  std::printf("| %s | %.4f | %.0f | %.3f (%.3f - %.3f) |\n", o.variant.c_str(), vm, flop / vm / 1e9,
              t.ratio.Pct(0.5), t.ratio.Pct(0.1), t.ratio.Pct(0.9));
  std::printf("outputs: max |variant - production| = %.3g, %zu of %zu elements beyond 2e-2\n", max_diff,
              bad, elems);
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  const int sms = attn::bench::Sm90MultiprocessorsOrExit("sm90_variants");
  const int heads = 2048 / o.d, batch = std::max(1, 16384 / o.s);
  const int total = batch * o.s;
  std::mt19937 rng(12345);
  const size_t elems = size_t(total) * heads * o.d;
  FlashParams p;
  p.q = DeviceRandom(elems, rng);
  p.k = DeviceRandom(elems, rng);
  p.v = DeviceRandom(elems, rng);
  CHECK_CUDA(cudaMalloc(&p.o, elems * 2));
  CHECK_CUDA(cudaMalloc(&p.lse, size_t(total) * heads * 4));
  std::vector<int32_t> cu(batch + 1);
  for (int b = 0; b <= batch; ++b) cu[b] = b * o.s;
  int32_t* dcu = nullptr;
  CHECK_CUDA(cudaMalloc(&dcu, cu.size() * 4));
  CHECK_CUDA(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  p.cu_seqlens_q = p.cu_seqlens_k = dcu;
  p.batch = batch;
  p.total_q = p.total_k = total;
  p.max_seqlen_q = p.max_seqlen_k = o.s;
  p.num_heads = p.num_kv_heads = heads;
  p.head_dim = o.d;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = int64_t(heads) * o.d;
  p.scale = 1.0f / std::sqrt(float(o.d));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.has_right = o.causal;
  // The tile counter of the dynamic schedule (causal), as Run gives it from the workspace.
  CHECK_CUDA(cudaMalloc(&p.tile_counter, 16));
  const double flop = 4.0 * batch * heads * double(o.s) * o.s * o.d * (o.causal ? 0.5 : 1.0);
  if (!o.variant.empty()) return RunVariant(o, p, sms, elems, flop);
  const double prod_ms = MedianMs(o.reps, [&] { return LaunchProduction(o, p, o.narrow, sms); });
  const int block_m = o.narrow || o.d == 256 ? 128 : 192;
  const int tiles = (o.s + block_m - 1) / block_m * heads * batch;
  std::printf("sm90_variants: d=%d bf16 s=%d batch=%d heads=%d causal=%d, %s tiling, %d tiles on %d "
              "CTAs\n",
              o.d, o.s, batch, heads, int(o.causal), o.narrow ? "narrow" : "wide", tiles,
              std::min(tiles, sms));
  std::printf("| kernel | ms (median of %d) | TFLOP/s |\n| --- | --- | --- |\n", o.reps);
  std::printf("| production | %.4f | %.0f |\n", prod_ms, flop / prod_ms / 1e9);
  return 0;
}
