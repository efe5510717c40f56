// sm90_timeline: where a consumer warpgroup's time goes in the sm_90a forward kernel.
//
// Runs the traced build of the kernel (Sm90Traced: thread 0 of each consumer warpgroup reads the
// SM clock at fixed points of every key-tile iteration) on one shape of the standard sweep (bf16,
// B*S = 16k tokens, H*D = 2048), and prints per-phase cycle counts and how often the tensor cores
// had no product of any warpgroup waiting. The production (untraced) kernel is timed on the same
// inputs in the same run, so the trace's own cost shows.
//
// With --variant, times a variant of the kernel (timeline_kernels.h) against production instead
// (single launches in alternating order, same inputs) and checks that their outputs agree; exits 1
// when they do not.
//
//   sm90_timeline --d 128 --s 16384 [--causal] [--narrow] [--reps 20]
//                 [--variant rescale_on_change|keys176|keys80|overlap|overlap_pingpong|
//                            overlap_keys176|overlap_keys64|cluster_kv|split_mask|release_k_early|
//                            trim_edges|fma_exp2_2|fma_exp2_3|fma_exp2_4
//                            [--production wide|narrow]]
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

#include "flash_fwd_sm90_kernel.cuh"
#include "flash_params.h"
#include "timeline_kernels.h"

namespace attn::kernels::cuda {
template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, cudaStream_t stream);
}

namespace {

using attn::kernels::cuda::FlashParams;
using attn::kernels::cuda::Sm90TracedShape;
using Layout = attn::kernels::cuda::Sm90TraceLayout;

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    const cudaError_t err_ = (x);                                                      \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

struct Options {
  int d = 128;
  int s = 4096;
  bool causal = false;
  bool narrow = false;
  // --production wide|narrow: the tiling production runs with against a variant (default: the
  // variant's, from --narrow).
  std::string production;
  int reps = 20;
  std::string variant;  // empty: the timeline
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
                   "usage: sm90_timeline --d 64|128|256 --s N [--causal] [--narrow] [--reps N]\n"
                   "         [--variant rescale_on_change|keys176|keys80|overlap|overlap_pingpong|\n"
                   "                    overlap_keys176|overlap_keys64|cluster_kv|split_mask|release_k_early|\n"
                   "                    trim_edges|fma_exp2_2|fma_exp2_3|fma_exp2_4\n"
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

cudaError_t LaunchTraced(const Options& o, const FlashParams& p, int sms, unsigned long long* trace,
                         Sm90TracedShape* shape) {
  using attn::kernels::cuda::LaunchTracedSm90;
  switch (o.d) {
    case 64: return LaunchTracedSm90<64>(p, o.narrow, sms, nullptr, trace, shape);
    case 128: return LaunchTracedSm90<128>(p, o.narrow, sms, nullptr, trace, shape);
    default: return LaunchTracedSm90<256>(p, o.narrow, sms, nullptr, trace, shape);
  }
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

cudaError_t LaunchProduction(const Options& o, const FlashParams& p) {
  using attn::kernels::cuda::RunFlashFwdSm90;
  switch (o.d) {
    case 64: return RunFlashFwdSm90<__nv_bfloat16, 64>(p, nullptr);
    case 128: return RunFlashFwdSm90<__nv_bfloat16, 128>(p, nullptr);
    default: return RunFlashFwdSm90<__nv_bfloat16, 256>(p, nullptr);
  }
}

// Device time of one call of fn (ms).
template <typename Fn>
float OneLaunchMs(cudaEvent_t a, cudaEvent_t b, Fn&& fn) {
  CHECK_CUDA(cudaEventRecord(a));
  CHECK_CUDA(fn());
  CHECK_CUDA(cudaEventRecord(b));
  CHECK_CUDA(cudaEventSynchronize(b));
  float t = 0;
  CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
  return t;
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

struct Stat {
  std::vector<double> v;
  void Add(double x) { v.push_back(x); }
  double Mean() const {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0 : s / v.size();
  }
  double Pct(double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(q * v.size()))];
  }
};

// One warpgroup's recorded iteration: Sm90TraceLayout's slots, the tag (t[kTag]) among them.
struct Iter {
  unsigned long long t[Layout::kSlots];
};
static_assert(sizeof(Iter) == Layout::kSlots * sizeof(unsigned long long));

void Analyse(const Options& o, const std::vector<unsigned long long>& trace, int grid, int wgs,
             int block_n, bool overlapped) {
  enum { kKWait, kS, kSoftmax, kVWait, kPv, kNext, kEpilogue, kPhases };
  const char* names[kPhases] = {"K wait (full barrier)", "S = Q K^T (issue to complete)",
                                "mask + softmax + rescale + pack", "V wait (full barrier)",
                                "O += P V (issue to complete)", "to the next K wait (same tile)",
                                "epilogue (last P V to done)"};
  Stat ph[kPhases];
  // Fraction of each CTA's traced span with 0..wgs warpgroups waiting on a product.
  std::vector<double> pending_time(wgs + 1, 0.0);
  double span_total = 0;
  long iters = 0;
  for (int c = 0; c < grid; ++c) {
    std::vector<std::pair<unsigned long long, int>> edges;  // +1 product issued, -1 completed
    unsigned long long first = ~0ull, last = 0;
    for (int w = 0; w < wgs; ++w) {
      const Iter* it = reinterpret_cast<const Iter*>(trace.data() + (size_t(c) * wgs + w) * Layout::kPerWarpgroup);
      for (int i = 0; i < Layout::kMaxIters; ++i) {
        const Iter& x = it[i];
        if (x.t[Layout::kKWait] == 0 || x.t[Layout::kPvDone] == 0) break;
        ++iters;
        // The overlapped loop's records may lack the S or the P V, and issue the P V with the S.
        const unsigned long long tag = x.t[Layout::kTag];
        const bool overlapped = (tag & Layout::kOverlapped) != 0;
        const bool has_s = !overlapped || (tag & Layout::kHasS) != 0;
        const bool has_pv = !overlapped || (tag & Layout::kHasPv) != 0;
        ph[kKWait].Add(double(x.t[Layout::kSIssued] - x.t[Layout::kKWait]));
        if (has_s) {
          ph[kS].Add(double(x.t[Layout::kSDone] - x.t[Layout::kSIssued]));
          ph[kSoftmax].Add(double(x.t[Layout::kSoftmaxDone] - x.t[Layout::kSDone]));
          ph[kVWait].Add(double(x.t[Layout::kVReady] - x.t[Layout::kSoftmaxDone]));
        }
        if (has_pv) ph[kPv].Add(double(x.t[Layout::kPvDone] - x.t[Layout::kVReady]));
        if (x.t[Layout::kEpilogueDone] != 0) {
          ph[kEpilogue].Add(double(x.t[Layout::kEpilogueDone] - x.t[Layout::kPvDone]));
        } else if (i + 1 < Layout::kMaxIters && it[i + 1].t[Layout::kKWait] != 0) {
          ph[kNext].Add(double(it[i + 1].t[Layout::kKWait] - x.t[Layout::kPvDone]));
        }
        if (has_s) {
          edges.push_back({x.t[Layout::kSIssued], +1});
          edges.push_back({x.t[Layout::kSDone], -1});
        }
        if (has_pv) {
          edges.push_back({overlapped ? x.t[Layout::kSIssued] : x.t[Layout::kVReady], +1});
          edges.push_back({x.t[Layout::kPvDone], -1});
        }
        first = std::min(first, x.t[Layout::kKWait]);
        last = std::max(last, x.t[Layout::kEpilogueDone] ? x.t[Layout::kEpilogueDone] : x.t[Layout::kPvDone]);
      }
    }
    if (edges.empty()) continue;
    std::sort(edges.begin(), edges.end());
    int level = 0;
    unsigned long long prev = first;
    for (const auto& e : edges) {
      pending_time[std::clamp(level, 0, wgs)] += double(e.first - prev);
      prev = e.first;
      level += e.second;
    }
    pending_time[0] += double(last - prev);
    span_total += double(last - first);
  }
  std::printf("\nper key-tile iteration of one consumer warpgroup (SM cycles), %ld iterations:\n", iters);
  if (overlapped) {
    std::printf("(overlapped key loop: each S is issued with the previous key tile's P V, and \"O += P V\" is\n"
                "the wait for that P V left after the softmax and the V wait)\n");
  }
  std::printf("| phase | mean | p10 | p50 | p90 |\n| --- | --- | --- | --- | --- |\n");
  for (int i = 0; i < kPhases; ++i) {
    std::printf("| %s | %.0f | %.0f | %.0f | %.0f |\n", names[i], ph[i].Mean(), ph[i].Pct(0.1),
                ph[i].Pct(0.5), ph[i].Pct(0.9));
  }
  // Dense bf16 wgmma: 4096 flop per cycle per SM (989 TFLOP/s at 1.83 GHz on 132 SMs).
  const double product_cycles = 2.0 * 64 * block_n * o.d / 4096.0;
  std::printf("\none 64-row product (S or P V) at the tensor cores' peak: %.0f cycles\n", product_cycles);
  std::printf("\nshare of the CTAs' traced time with n warpgroups waiting on a product:\n");
  std::printf("| n | share |\n| --- | --- |\n");
  for (int n = 0; n <= wgs; ++n) std::printf("| %d | %.3f |\n", n, pending_time[n] / span_total);
}

std::vector<uint16_t> Download(const void* d, size_t elems) {
  std::vector<uint16_t> h(elems);
  CHECK_CUDA(cudaMemcpy(h.data(), d, elems * 2, cudaMemcpyDeviceToHost));
  return h;
}

float FromBf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Production and the variant on the same inputs, then their outputs side by side. The board's
// clock follows its power draw with a lag of tenths of a second, so blocks of one kernel's
// launches timed one after the other run at different clocks (a cool first block measured up to
// 12% faster). Both kernels therefore first run alternately for a warm-up of 1.5 s, then each
// round times one launch of each, the order alternating, and the ratio is taken per round.
int RunVariant(const Options& o, FlashParams p, int sms, size_t elems, double flop) {
  using attn::kernels::cuda::Sm90Variant;
  Sm90Variant v;
  if (o.variant == "rescale_on_change") v = Sm90Variant::kRescaleOnChange;
  else if (o.variant == "keys176") v = Sm90Variant::kKeys176;
  else if (o.variant == "keys80") v = Sm90Variant::kKeys80;
  else if (o.variant == "overlap") v = Sm90Variant::kOverlap;
  else if (o.variant == "overlap_pingpong") v = Sm90Variant::kOverlapPingPong;
  else if (o.variant == "overlap_keys176") v = Sm90Variant::kOverlapKeys176;
  else if (o.variant == "overlap_keys64") v = Sm90Variant::kOverlapKeys64;
  else if (o.variant == "cluster_kv") v = Sm90Variant::kClusterKV;
  else if (o.variant == "split_mask") v = Sm90Variant::kSplitMask;
  else if (o.variant == "release_k_early") v = Sm90Variant::kReleaseKEarly;
  else if (o.variant == "trim_edges") v = Sm90Variant::kTrimEdges;
  else if (o.variant == "fma_exp2_2") v = Sm90Variant::kFmaExp2Of8_2;
  else if (o.variant == "fma_exp2_3") v = Sm90Variant::kFmaExp2Of8_3;
  else if (o.variant == "fma_exp2_4") v = Sm90Variant::kFmaExp2Of8_4;
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
  setenv("ATTN_SM90_TILING", prod_narrow ? "2" : "1", 1);
  auto prod = [&] { return LaunchProduction(o, p); };
  auto var = [&] { return LaunchVariant(o, p, sms, v); };
  cudaEvent_t ea, eb;
  CHECK_CUDA(cudaEventCreate(&ea));
  CHECK_CUDA(cudaEventCreate(&eb));
  const auto warm_start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - warm_start < std::chrono::milliseconds(1500)) {
    OneLaunchMs(ea, eb, prod);
    OneLaunchMs(ea, eb, var);
  }
  Stat prod_ms, var_ms, ratio;
  for (int r = 0; r < 2 * o.reps; ++r) {
    double tp, tv;
    if (r % 2 == 0) {
      tp = OneLaunchMs(ea, eb, prod);
      tv = OneLaunchMs(ea, eb, var);
    } else {
      tv = OneLaunchMs(ea, eb, var);
      tp = OneLaunchMs(ea, eb, prod);
    }
    prod_ms.Add(tp);
    var_ms.Add(tv);
    ratio.Add(tp / tv);
  }
  CHECK_CUDA(cudaEventDestroy(ea));
  CHECK_CUDA(cudaEventDestroy(eb));
  // Outputs: each kernel on a poisoned O.
  CHECK_CUDA(cudaMemset(p.o, 0xff, elems * 2));
  CHECK_CUDA(LaunchProduction(o, p));
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
  const double pm = prod_ms.Pct(0.5), vm = var_ms.Pct(0.5);
  std::printf("sm90_timeline: d=%d bf16 s=%d causal=%d, variant %s on the %s tiling, production %s\n",
              o.d, o.s, int(o.causal), o.variant.c_str(), o.narrow ? "narrow" : "wide",
              prod_narrow ? "narrow" : "wide");
  std::printf("| kernel | ms (median of %zu rounds) | TFLOP/s | production / kernel per round: median "
              "(p10 - p90) |\n| --- | --- | --- | --- |\n", ratio.v.size());
  std::printf("| production | %.4f | %.0f | 1 |\n", pm, flop / pm / 1e9);
  std::printf("| %s | %.4f | %.0f | %.3f (%.3f - %.3f) |\n", o.variant.c_str(), vm, flop / vm / 1e9,
              ratio.Pct(0.5), ratio.Pct(0.1), ratio.Pct(0.9));
  std::printf("outputs: max |variant - production| = %.3g, %zu of %zu elements beyond 2e-2\n", max_diff,
              bad, elems);
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  int dev = 0, sms = 0, major = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (major != 9) {
    std::fprintf(stderr, "sm90_timeline: needs an sm_90 GPU\n");
    return 1;
  }
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

  const size_t trace_entries = size_t(sms) * 3 * Layout::kPerWarpgroup;
  unsigned long long* dtrace = nullptr;
  CHECK_CUDA(cudaMalloc(&dtrace, trace_entries * 8));
  Sm90TracedShape shape;
  const double traced_ms = MedianMs(o.reps, [&] {
    cudaMemset(dtrace, 0, trace_entries * 8);
    return LaunchTraced(o, p, sms, dtrace, &shape);
  });
  // The memset is timed with the traced launch: time it alone and take it off.
  const double memset_ms = MedianMs(o.reps, [&] { return cudaMemset(dtrace, 0, trace_entries * 8); });
  setenv("ATTN_SM90_TILING", o.narrow ? "2" : "1", 1);
  const double prod_ms = MedianMs(o.reps, [&] { return LaunchProduction(o, p); });
  // The last traced run's timeline.
  CHECK_CUDA(cudaMemset(dtrace, 0, trace_entries * 8));
  CHECK_CUDA(LaunchTraced(o, p, sms, dtrace, &shape));
  std::vector<unsigned long long> trace(trace_entries);
  CHECK_CUDA(cudaMemcpy(trace.data(), dtrace, trace_entries * 8, cudaMemcpyDeviceToHost));

  const int wgs = shape.consumer_wgs, block_m = shape.block_m;
  const int tiles = (o.s + block_m - 1) / block_m * heads * batch;
  std::printf("sm90_timeline: d=%d bf16 s=%d batch=%d heads=%d causal=%d, %d consumer warpgroups "
              "(%d-row tiles), %d tiles on %d CTAs\n",
              o.d, o.s, batch, heads, int(o.causal), wgs, block_m, tiles, std::min(tiles, sms));
  std::printf("| kernel | ms (median of %d) | TFLOP/s |\n| --- | --- | --- |\n", o.reps);
  std::printf("| production | %.4f | %.0f |\n", prod_ms, flop / prod_ms / 1e9);
  const double tr_ms = traced_ms - memset_ms;
  std::printf("| traced | %.4f | %.0f |\n", tr_ms, flop / tr_ms / 1e9);
  Analyse(o, trace, std::min(tiles, sms), wgs, shape.block_n, shape.overlap);
  return 0;
}
