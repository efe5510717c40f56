#include "common/fp8_model.h"

#include <algorithm>
#include <cmath>

#include "common/score_rows.h"

namespace attn::testing {
namespace {

constexpr double kBias = 256.0;  // P is rounded as p * 2^8
constexpr int kGroupRows = 16;   // a warp's rows
constexpr double kLog2e = 1.4426950408889634;

// Whether a group whose rows moved from max m to mt (per row) rescales: always without a lazy
// rescale or where the group is cut short by the sequence's end (its warp holds rows past it),
// else where one row grew past its max by more than the slack (log2 units). A row that sees its
// first key always grows; -inf to -inf is no growth.
bool GroupRescales(const std::vector<double>& m, const std::vector<double>& mt, double slack) {
  if (slack <= 0 || m.size() < size_t(kGroupRows)) return true;
  for (size_t r = 0; r < m.size(); ++r) {
    if (mt[r] == kNegInf) continue;
    if (m[r] == kNegInf || (mt[r] - m[r]) * kLog2e > slack) return true;
  }
  return false;
}

// Each row's running max mt over keys [j0, j1) of its scores s, from the max m it had.
void TileMaxima(const std::vector<std::vector<double>>& s, const std::vector<double>& m, int64_t j0, int64_t j1,
                std::vector<double>* mt) {
  for (size_t r = 0; r < m.size(); ++r) {
    (*mt)[r] = m[r];
    for (int64_t j = j0; j < j1; ++j) (*mt)[r] = std::max((*mt)[r], s[r][j]);
  }
}

// The e4m3 step at x >= 0 (an e4m3 value or not): 2^-9 below 2^-6, else 1/8 of x's binade.
double E4m3Step(double x) {
  if (x < 0.015625) return 1.0 / 512;
  int e = 0;
  std::frexp(x, &e);  // x in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 3);
}

// The extremes of R(y) / y (R: rounding to e4m3) over y in [ya, yb], 0 < ya <= yb <= 448: R is a
// step function, so R(y) / y falls inside each step and jumps at the midpoints between e4m3
// values (c / mid just below one, next / mid just above).
void RoundingRatioRange(double ya, double yb, double* lo, double* hi) {
  *lo = std::min(RoundToE4m3(ya) / ya, RoundToE4m3(yb) / yb);
  *hi = std::max(RoundToE4m3(ya) / ya, RoundToE4m3(yb) / yb);
  double c = std::floor(ya / E4m3Step(ya)) * E4m3Step(ya);  // the e4m3 value at or below ya
  for (;;) {
    const double next = c + E4m3Step(c), mid = 0.5 * (c + next);
    if (mid > yb) break;
    if (mid >= ya) {
      *lo = std::min(*lo, c / mid);
      *hi = std::max(*hi, next / mid);
    }
    c = next;
  }
}

}  // namespace

ReferenceResult Fp8TensorCoreModel(const kernels::AttentionArgs& a, const std::vector<double>& q,
                                   const std::vector<double>& k, const std::vector<double>& v,
                                   const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                                   const Fp8SoftmaxModel& model) {
  const int h_kv = a.num_kv_heads, d = a.head_dim, tile = model.key_tile;
  const double slack = model.lazy_rescale_eighths / 8.0;
  std::vector<double> m, mt, sum;
  std::vector<std::vector<double>> acc;
  return ForEachScoreGroup(
      a, q, k, cu_q, cu_k, kGroupRows,
      [&](const std::vector<ScoreRow>& rows, int64_t k0, const std::vector<std::vector<double>>& s,
          int hk) ATTN_TEST_THREAD_PRIVATE {
        const size_t n = rows.size();
        const int64_t sk = static_cast<int64_t>(s[0].size());
        m.assign(n, kNegInf);
        mt.assign(n, kNegInf);
        sum.assign(n, 0.0);
        acc.assign(n, std::vector<double>(d, 0.0));
        for (int64_t t = (sk + tile - 1) / tile - 1; t >= 0; --t) {
          const int64_t j0 = t * tile, j1 = std::min(sk, j0 + tile);
          TileMaxima(s, m, j0, j1, &mt);
          const bool rescale = GroupRescales(m, mt, slack);
          for (size_t r = 0; r < n; ++r) {
            const double mr = rescale ? mt[r] : m[r];
            if (mr == kNegInf) continue;
            const double corr = m[r] == kNegInf ? 0.0 : std::exp(m[r] - mr);
            sum[r] *= corr;
            for (double& x : acc[r]) x *= corr;
            for (int64_t j = j0; j < j1; ++j) {
              if (s[r][j] == kNegInf) continue;
              const double pj = std::exp(s[r][j] - mr) * kBias;
              const double pr = RoundToE4m3(pj);
              sum[r] += model.sums_rounded_p ? pr : pj;
              for (int c = 0; c < d; ++c) acc[r][c] += pr * v[((k0 + j) * h_kv + hk) * d + c];
            }
            m[r] = mr;
          }
        }
        for (size_t r = 0; r < n; ++r) {
          if (m[r] == kNegInf) continue;
          for (int c = 0; c < d; ++c) rows[r].o[c] = acc[r][c] / sum[r];
          *rows[r].lse = m[r] + std::log(sum[r] / kBias);
        }
      });
}

std::vector<double> ScoreErrors(const std::vector<double>& magnitudes, double rel) {
  std::vector<double> err(magnitudes.size());
  for (size_t i = 0; i < magnitudes.size(); ++i) err[i] = std::isinf(magnitudes[i]) ? 0.0 : rel * magnitudes[i];
  return err;
}

LseBounds Fp8TensorCoreLseBounds(const kernels::AttentionArgs& a, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<int32_t>& cu_q,
                                 const std::vector<int32_t>& cu_k, const std::vector<double>& score_err,
                                 const Fp8SoftmaxModel& model) {
  const int tile = model.key_tile;
  const double slack = model.lazy_rescale_eighths / 8.0, slack_ln = slack / kLog2e;
  LseBounds b;
  b.hi.assign(score_err.size(), kNegInf);
  std::vector<double> m, mt, top, lo, hi;
  b.lo = ForEachScoreGroup(
             a, q, k, cu_q, cu_k, kGroupRows,
             [&](const std::vector<ScoreRow>& rows, int64_t, const std::vector<std::vector<double>>& s,
                 int) ATTN_TEST_THREAD_PRIVATE {
               const size_t n = rows.size();
               const int64_t sk = static_cast<int64_t>(s[0].size());
               m.assign(n, kNegInf);
               mt.assign(n, kNegInf);
               top.assign(n, kNegInf);  // each row's final max: the sums' unit, exp(top)
               lo.assign(n, 0.0);
               hi.assign(n, 0.0);
               for (size_t r = 0; r < n; ++r)
                 for (double x : s[r]) top[r] = std::max(top[r], x);
               // The kernel's scores s' lie within e of s, so each max it keeps within e of the
               // model's, each exponent s' - max' within 2e of s - max, and each growth within 2e:
               // its choices to rescale are the model's until a growth lies within 2e of the slack.
               bool certain = true;
               for (int64_t t = (sk + tile - 1) / tile - 1; t >= 0; --t) {
                 const int64_t j0 = t * tile, j1 = std::min(sk, j0 + tile);
                 TileMaxima(s, m, j0, j1, &mt);
                 const bool rescale = GroupRescales(m, mt, slack);
                 if (slack > 0 && certain) {
                   for (size_t r = 0; r < n; ++r) {
                     if (mt[r] == kNegInf || m[r] == kNegInf) continue;
                     if (std::fabs(mt[r] - m[r] - slack_ln) <= 2 * score_err[rows[r].at]) certain = false;
                   }
                 }
                 for (size_t r = 0; r < n; ++r) {
                   const double e = score_err[rows[r].at];
                   const double mr = rescale ? mt[r] : m[r];
                   for (int64_t j = j0; j < j1; ++j) {
                     if (s[r][j] == kNegInf) continue;
                     if (certain) {
                       // p' = 256 exp(s' - m'), m' within e of mr, and s' - m' <= 0 (rescaled) or
                       // <= the slack (kept); rounding is monotone.
                       const double cap = rescale ? 0.0 : slack_ln;
                       lo[r] += std::exp(mr - e - top[r]) * RoundToE4m3(kBias * std::exp(s[r][j] - mr - 2 * e)) / kBias;
                       hi[r] += std::exp(mr + e - top[r]) *
                                RoundToE4m3(kBias * std::exp(std::min(cap, s[r][j] - mr + 2 * e))) / kBias;
                     } else {
                       // The max it is scaled to lies anywhere in [max' - slack, max']: the term
                       // exp(s') R(y) / y with y = 256 exp(s' - m') between these ends.
                       const double ya = kBias * std::exp(s[r][j] - mt[r] - 2 * e);
                       const double yb = kBias * std::exp(std::min(slack_ln, s[r][j] - mt[r] + slack_ln + 2 * e));
                       double rlo = 0, rhi = 0;
                       RoundingRatioRange(ya, yb, &rlo, &rhi);
                       lo[r] += std::exp(s[r][j] - e - top[r]) * rlo;
                       hi[r] += std::exp(s[r][j] + e - top[r]) * rhi;
                     }
                   }
                   m[r] = mr;
                 }
               }
               for (size_t r = 0; r < n; ++r) {
                 if (top[r] == kNegInf) continue;
                 *rows[r].lse = lo[r] > 0 ? top[r] + std::log(lo[r]) : kNegInf;
                 b.hi[rows[r].at] = top[r] + std::log(hi[r]);
               }
             })
             .lse;
  return b;
}

}  // namespace attn::testing
