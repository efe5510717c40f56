// fp8_variants: variants of the FP8 forward kernel (fp8_variant_kernels.h) timed against the
// shipped one on the standard sweep's shapes (B*S = 16k tokens, H*D = 2048, MHA, o in bf16):
// single launches (V's transposition and the kernel, as RunFlashFwdSm90Fp8 runs them) in
// alternating order on the same random e4m3 inputs, then the outputs compared. Prints one table;
// exits 1 when a variant's output disagrees with the shipped kernel's. The variant "stamped" (the
// shipped kernel with clocks per phase) adds a second table, where each warpgroup's key tile goes,
// and one CTA's timeline: whether its warpgroups' softmaxes run in step or in turns.
//
//   fp8_variants [--d 128|256]... [--s N]... [--causal] [--reps 20] [--variant NAME]...
#include <cuda_bf16.h>
#include <cuda_fp8.h>
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
#include <utility>
#include <vector>

#include "flash_fwd_sm90_fp8_layout.h"
#include "flash_params.h"
#include "fp8_variant_kernels.h"
#include "variant_timing.h"

namespace {

using attn::kernels::cuda::Fp8Variant;
using attn::bench::FromBf16;
using attn::kernels::cuda::FlashParams;

struct Options {
  std::vector<int> dims;
  std::vector<int> seqs;
  bool causal = false;
  int reps = 20;
  std::vector<Fp8Variant> variants;
};

Options Parse(int argc, char** argv) {
  Options o;
  auto usage = [] {
    std::fprintf(stderr, "usage: fp8_variants [--d 128|256]... [--s N]... [--causal] [--reps N] [--variant NAME]...\n"
                         "variants:");
    for (int v = 0; v < int(Fp8Variant::kCount); ++v)
      std::fprintf(stderr, " %s", attn::kernels::cuda::Fp8VariantName(Fp8Variant(v)));
    std::fprintf(stderr, "\n");
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--d" && has_value) o.dims.push_back(std::atoi(argv[++i]));
    else if (a == "--s" && has_value) o.seqs.push_back(std::atoi(argv[++i]));
    else if (a == "--reps" && has_value) o.reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--causal") o.causal = true;
    else if (a == "--variant" && has_value) {
      const std::string name = argv[++i];
      int found = -1;
      for (int v = 0; v < int(Fp8Variant::kCount); ++v)
        if (name == attn::kernels::cuda::Fp8VariantName(Fp8Variant(v))) found = v;
      if (found < 0) usage();
      o.variants.push_back(Fp8Variant(found));
    } else {
      usage();
    }
  }
  if (o.dims.empty()) o.dims = {128, 256};
  if (o.seqs.empty()) o.seqs = {4096, 8192};
  if (o.variants.empty())
    for (int v = 0; v < int(Fp8Variant::kCount); ++v) o.variants.push_back(Fp8Variant(v));
  for (int d : o.dims)
    if (d != 128 && d != 256) usage();
  for (int s : o.seqs)
    if (s < 1 || s > 16384) usage();
  return o;
}

// Random e4m3 codes of N(0, 1) * 32 values (descale 1/32).
void* DeviceCodes(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 32.0f);
  std::vector<uint8_t> h(n);
  for (auto& c : h) c = __nv_cvt_float_to_fp8(dist(rng), __NV_SATFINITE, __NV_E4M3);
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, n));
  CHECK_CUDA(cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice));
  return d;
}

// o of one launch of launch (a callable returning cudaError_t) on NaN-poisoned o, and its LSE
// (rows x heads floats, also poisoned first) into *lse.
template <typename Launch>
std::vector<uint16_t> OutputOf(const FlashParams& p, size_t elems, Launch&& launch, std::vector<float>* lse) {
  const size_t lse_n = size_t(p.total_q) * p.num_heads;
  CHECK_CUDA(cudaMemset(p.o, 0xff, elems * 2));  // NaN poison
  CHECK_CUDA(cudaMemset(p.lse, 0xff, lse_n * 4));
  CHECK_CUDA(launch());
  std::vector<uint16_t> h(elems);
  CHECK_CUDA(cudaMemcpy(h.data(), p.o, elems * 2, cudaMemcpyDeviceToHost));
  lse->resize(lse_n);
  CHECK_CUDA(cudaMemcpy(lse->data(), p.lse, lse_n * 4, cudaMemcpyDeviceToHost));
  return h;
}

// One role's marks of the stamped kernel's timeline: phase and SM clock.
struct Mark {
  int phase;
  uint32_t clock;
};

// The intervals [start, end) that a consumer's marks give to phase `phase` (the time since the
// previous mark), in clocks after t0.
std::vector<std::pair<double, double>> PhaseIntervals(const std::vector<Mark>& marks, int phase, uint32_t t0) {
  std::vector<std::pair<double, double>> out;
  for (size_t i = 1; i < marks.size(); ++i)
    if (marks[i].phase == phase)
      out.emplace_back(double(marks[i - 1].clock - t0), double(marks[i].clock - t0));
  return out;
}

// Clocks of `a` covered by any interval of `b`.
double Covered(const std::vector<std::pair<double, double>>& a, const std::vector<std::pair<double, double>>& b) {
  double sum = 0;
  for (const auto& x : a)
    for (const auto& y : b) sum += std::max(0.0, std::min(x.second, y.second) - std::max(x.first, y.first));
  return sum;
}

// CTA 0's timeline of its first Q tile (the stamped kernel): per consumer warpgroup and key tile,
// when S was issued, its softmax began and ended and its P V completed (clocks after the first
// role's start); then how much of each warpgroup's softmax ran beside another's softmax and beside
// another's products (S, P V), which tells whether the warpgroups take turns or run in step.
template <int D>
std::string TimelineTable(int s, const char* variant) {
  namespace k = attn::kernels::cuda;
  static uint32_t raw[k::kFp8TraceRoles][k::kFp8TraceMarks][2];
  CHECK_CUDA(k::ReadFp8Timeline<D>(raw));
  std::vector<std::vector<Mark>> roles;
  uint32_t t0 = 0;
  bool any = false;
  for (int r = 0; r < k::kFp8TraceRoles; ++r) {
    std::vector<Mark> m;
    for (int i = 0; i < k::kFp8TraceMarks && (raw[r][i][0] != 0 || raw[r][i][1] != 0); ++i)
      m.push_back({int(raw[r][i][0]), raw[r][i][1]});
    if (!m.empty() && (!any || int32_t(m[0].clock - t0) < 0)) t0 = m[0].clock, any = true;
    roles.push_back(std::move(m));
  }
  // The consumer warpgroups write roles 0.., the producer the role after them.
  int consumers = 0;
  while (consumers + 1 < k::kFp8TraceRoles && !roles[consumers + 1].empty()) ++consumers;
  std::string out = "\nd=" + std::to_string(D) + " s=" + std::to_string(s) + " " + variant +
                    ": CTA 0's first Q tile, clocks after its first role's start; per consumer warpgroup "
                    "and key tile: S issued / softmax begins / softmax ends / P V complete\n\n| key tile |";
  for (int c = 0; c < consumers; ++c) out += " WG" + std::to_string(c) + " |";
  out += "\n|---:|";
  for (int c = 0; c < consumers; ++c) out += "---|";
  out += "\n";
  std::vector<std::vector<std::pair<double, double>>> soft(consumers), s_iv(consumers), pv_iv(consumers),
      mma(consumers);
  for (int c = 0; c < consumers; ++c) {
    soft[c] = PhaseIntervals(roles[c], k::kFp8Softmax, t0);
    s_iv[c] = PhaseIntervals(roles[c], k::kFp8S, t0);
    pv_iv[c] = PhaseIntervals(roles[c], k::kFp8Pv, t0);
    mma[c] = s_iv[c];
    mma[c].insert(mma[c].end(), pv_iv[c].begin(), pv_iv[c].end());
  }
  const size_t tiles = soft.empty() ? 0 : soft[0].size();
  for (size_t j = 0; j < std::min<size_t>(tiles, 12); ++j) {
    out += "| " + std::to_string(j) + " |";
    for (int c = 0; c < consumers; ++c) {
      char cell[96];
      if (j < s_iv[c].size() && j < soft[c].size() && j < pv_iv[c].size())
        std::snprintf(cell, sizeof(cell), " %.0f / %.0f / %.0f / %.0f |", s_iv[c][j].first, soft[c][j].first,
                      soft[c][j].second, pv_iv[c][j].second);
      else
        std::snprintf(cell, sizeof(cell), " - |");
      out += cell;
    }
    out += "\n";
  }
  out += "\n| warpgroup | key tiles traced | softmax clocks | of it beside another's softmax | beside another's S or P V |\n"
         "|---:|---:|---:|---:|---:|\n";
  for (int c = 0; c < consumers; ++c) {
    double total = 0, with_soft = 0, with_mma = 0;
    for (const auto& x : soft[c]) total += x.second - x.first;
    for (int o = 0; o < consumers; ++o)
      if (o != c) with_soft += Covered(soft[c], soft[o]), with_mma += Covered(soft[c], mma[o]);
    char row[160];
    std::snprintf(row, sizeof(row), "| %d | %zu | %.0f | %.0f%% | %.0f%% |\n", c, soft[c].size(), total,
                  total > 0 ? 100.0 * with_soft / total : 0.0, total > 0 ? 100.0 * with_mma / total : 0.0);
    out += row;
  }
  return out;
}

// One launch of the stamped variant: clocks per key tile in each phase, one row of the second table;
// the launch's timeline into *timeline.
template <int D, typename Launch>
std::string PhaseRow(int s, bool causal, const char* variant, Launch&& launch, std::string* timeline) {
  namespace k = attn::kernels::cuda;
  uint64_t slots[k::kFp8PhaseSlots];
  CHECK_CUDA(k::ResetFp8PhaseClocks<D>());
  CHECK_CUDA(launch());
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(k::ReadFp8PhaseClocks<D>(slots));
  *timeline += TimelineTable<D>(s, variant);
  const double ct = std::max<double>(1, double(slots[k::kFp8ConsumerTilesSlot]));
  const double pt = std::max<double>(1, double(slots[k::kFp8ProducerTilesSlot]));
  std::string row = "| " + std::to_string(D) + " | " + std::to_string(s) + " | " + (causal ? "yes" : "no") +
                    " | " + variant + " |";
  char cell[64];
  double total = 0;
  for (int i = k::kFp8WaitQ; i <= k::kFp8Epilogue; ++i) {
    total += double(slots[i]) / ct;
    std::snprintf(cell, sizeof(cell), " %.0f |", double(slots[i]) / ct);
    row += cell;
  }
  std::snprintf(cell, sizeof(cell), " %.0f | %.0f | %.0f |", total, double(slots[k::kFp8WaitEmpty]) / pt,
                double(slots[k::kFp8Issue]) / pt);
  return row + cell;
}

// One shape: every variant against the shipped kernel. Returns the number of disagreeing variants.
int RunShape(const Options& o, int d, int s, int sms, std::vector<std::string>* phase_rows,
             std::string* timelines) {
  const int heads = 2048 / d, batch = std::max(1, 16384 / s), total = batch * s;
  const size_t elems = size_t(total) * heads * d;
  std::mt19937 rng(1234 + d + s);
  FlashParams p;
  p.q = DeviceCodes(elems, rng);
  p.k = DeviceCodes(elems, rng);
  p.v = DeviceCodes(elems, rng);
  CHECK_CUDA(cudaMalloc(&p.o, elems * 2));
  CHECK_CUDA(cudaMalloc(&p.lse, size_t(total) * heads * 4));
  std::vector<int32_t> cu(batch + 1);
  for (int b = 0; b <= batch; ++b) cu[b] = b * s;
  int32_t* dcu = nullptr;
  CHECK_CUDA(cudaMalloc(&dcu, cu.size() * 4));
  CHECK_CUDA(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  const std::vector<float> descales(size_t(batch) * heads, 1.0f / 32);
  float* ddesc = nullptr;
  CHECK_CUDA(cudaMalloc(&ddesc, descales.size() * 4));
  CHECK_CUDA(cudaMemcpy(ddesc, descales.data(), descales.size() * 4, cudaMemcpyHostToDevice));
  void* vt = nullptr;
  CHECK_CUDA(cudaMalloc(&vt, size_t(attn::kernels::cuda::Fp8VtBytes(total, batch, heads, d))));
  p.cu_seqlens_q = p.cu_seqlens_k = dcu;
  p.batch = batch;
  p.total_q = p.total_k = total;
  p.max_seqlen_q = p.max_seqlen_k = s;
  p.num_heads = p.num_kv_heads = heads;
  p.head_dim = d;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = int64_t(heads) * d;
  p.scale = 1.0f / std::sqrt(float(d));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.has_right = o.causal;
  p.q_descale = p.k_descale = p.v_descale = ddesc;
  p.vt = vt;
  const double flop = 4.0 * batch * heads * double(s) * s * d * (o.causal ? 0.5 : 1.0);
  const int rows = attn::kernels::cuda::Fp8TileRows(d, s, heads, batch, sms);
  auto shipped = [&] {
    return d == 128 ? attn::kernels::cuda::RunFlashFwdSm90Fp8<__nv_bfloat16, 128>(p, rows, sms, nullptr)
                    : attn::kernels::cuda::RunFlashFwdSm90Fp8<__nv_bfloat16, 256>(p, rows, sms, nullptr);
  };
  std::vector<float> want_lse, got_lse;
  const std::vector<uint16_t> want = OutputOf(p, elems, shipped, &want_lse);
  int disagreeing = 0;
  for (Fp8Variant v : o.variants) {
    if (!attn::kernels::cuda::Fp8VariantBuiltFor(v, d)) continue;
    auto variant = [&] {
      return d == 128 ? attn::kernels::cuda::LaunchFp8Variant<128>(p, v, sms, nullptr)
                      : attn::kernels::cuda::LaunchFp8Variant<256>(p, v, sms, nullptr);
    };
    attn::bench::AlternatingTimes t = attn::bench::TimeAlternating(shipped, variant, o.reps, 600);
    const std::vector<uint16_t> got = OutputOf(p, elems, variant, &got_lse);
    double lse_diff = 0;  // natural units; a non-finite LSE makes it infinite
    for (size_t i = 0; i < want_lse.size(); ++i) {
      const double diff = std::fabs(double(got_lse[i]) - double(want_lse[i]));
      lse_diff = std::isfinite(diff) ? std::max(lse_diff, diff) : INFINITY;
      if (!std::isfinite(lse_diff)) break;
    }
    size_t identical = 0, non_finite = 0;
    double num = 0, den = 0, max_abs = 0;
    for (size_t i = 0; i < elems; ++i) {
      identical += got[i] == want[i];
      const double g = FromBf16(got[i]), w = FromBf16(want[i]);
      if (!std::isfinite(g)) {
        ++non_finite;
        continue;
      }
      num += (g - w) * (g - w);
      den += w * w;
      max_abs = std::max(max_abs, std::fabs(g - w));
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const bool agrees = non_finite == 0 && rel <= 1e-2 && lse_diff <= 1e-2;
    disagreeing += !agrees;
    const double ps = t.shipped.Pct(0.5), pv = t.variant.Pct(0.5);
    std::printf("| %d | %d | %s | %s | %.4f | %.4f | %.0f | %.0f | %.3f (%.3f - %.3f) | %.2e | %.2e | %.1f%% | %s |\n", d,
                s, o.causal ? "yes" : "no", attn::kernels::cuda::Fp8VariantName(v), ps, pv, flop / ps / 1e9,
                flop / pv / 1e9, t.ratio.Pct(0.5), t.ratio.Pct(0.1), t.ratio.Pct(0.9), rel, lse_diff,
                100.0 * double(identical) / double(elems), agrees ? "agrees" : "DISAGREES");
    std::fflush(stdout);
    if (v == Fp8Variant::kStamped || v == Fp8Variant::kStampedAlone) {
      const char* name = attn::kernels::cuda::Fp8VariantName(v);
      phase_rows->push_back(d == 128 ? PhaseRow<128>(s, o.causal, name, variant, timelines)
                                     : PhaseRow<256>(s, o.causal, name, variant, timelines));
    }
  }
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o), static_cast<const void*>(p.lse),
                          static_cast<const void*>(dcu),
                          static_cast<const void*>(ddesc), static_cast<const void*>(vt)})
    CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
  return disagreeing;
}

}  // namespace

namespace attn::kernels::cuda {
const char* Fp8VariantName(Fp8Variant v) {
  switch (v) {
    case Fp8Variant::kMufu: return "mufu";
    case Fp8Variant::kFma2: return "fma2";
    case Fp8Variant::kFma3: return "fma3";
    case Fp8Variant::kFma4: return "fma4";
    case Fp8Variant::kFma5: return "fma5";
    case Fp8Variant::kFma6: return "fma6";
    case Fp8Variant::kFma8: return "fma8";
    case Fp8Variant::kWg2: return "wg2";
    case Fp8Variant::kOverlap: return "overlap";
    case Fp8Variant::kStamped: return "stamped";
    case Fp8Variant::kStampedAlone: return "stamped_alone";
    case Fp8Variant::kMaskFlipped: return "mask_flipped";
    case Fp8Variant::kTcSum: return "tc_sum";
    case Fp8Variant::kWg2TcSum: return "wg2_tc_sum";
    case Fp8Variant::kFloatSum: return "float_sum";
    case Fp8Variant::kLazy: return "lazy";
    case Fp8Variant::kLazyTcSum: return "lazy_tc_sum";
    case Fp8Variant::kLazyFloatSum: return "lazy_float_sum";
    default: return "?";
  }
}
}  // namespace attn::kernels::cuda

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  const int sms = attn::bench::Sm90MultiprocessorsOrExit("fp8_variants");
  std::printf("fp8_variants: MHA, B*S = 16k tokens, H*D = 2048, e4m3 q/k/v, o bf16; each time is V's "
              "transposition and the kernel; %d rounds per variant\n\n",
              2 * o.reps);
  std::printf("| d | s | causal | variant | shipped ms | variant ms | shipped TFLOP/s | variant TFLOP/s | "
              "shipped/variant per round: median (p10 - p90) | rel L2 vs shipped | max LSE diff | identical | |\n"
              "|---:|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|\n");
  int disagreeing = 0;
  std::vector<std::string> phase_rows;
  std::string timelines;
  for (int d : o.dims)
    for (int s : o.seqs) disagreeing += RunShape(o, d, s, sms, &phase_rows, &timelines);
  if (!phase_rows.empty()) {
    std::printf("\nThe stamped kernel, one launch: SM clocks per key tile of one consumer warpgroup (its "
                "thread 0) in each phase, and of the producer thread\n\n"
                "| d | s | causal | variant | wait Q | wait K | S | softmax | pack P | wait V | P V | epilogue | "
                "consumer total | producer: wait for a free stage | producer: issue |\n"
                "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const std::string& row : phase_rows) std::printf("%s\n", row.c_str());
    std::printf("%s", timelines.c_str());
  }
  return disagreeing == 0 ? 0 : 1;
}
