// The float64 references' walk over query rows (reference.cc, fp8_model.cc): each row's scaled
// scores under the batch's masks, one row or a group of consecutive rows of a sequence at a time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attn/kernels/attention.h"
#include "common/reference.h"

// The reference runs on one test thread over data that thread owns; under TSan its loops are
// left uninstrumented (they made the sanitized end-to-end tests minutes long, for nothing).
#if defined(__SANITIZE_THREAD__)
#define ATTN_TEST_THREAD_PRIVATE __attribute__((no_sanitize("thread")))
#else
#define ATTN_TEST_THREAD_PRIVATE
#endif

namespace attn::testing {

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// One query row of a group: its d outputs in ReferenceResult::o, its element of lse (at index at).
struct ScoreRow {
  double* o;
  double* lse;
  int64_t at;
};

// Calls group(rows, k0, scores, hk) for every run of up to group_rows consecutive query rows of a
// sequence (rows 0.., group_rows.. of each sequence and head): scores[r][j] is the scaled score of
// row r's key j (-inf where the mask hides it), k0 the sequence's first key row and hk the KV head
// the query head reads.
template <typename GroupFn>
ATTN_TEST_THREAD_PRIVATE ReferenceResult ForEachScoreGroup(const kernels::AttentionArgs& a,
                                                           const std::vector<double>& q,
                                                           const std::vector<double>& k,
                                                           const std::vector<int32_t>& cu_q,
                                                           const std::vector<int32_t>& cu_k, int group_rows,
                                                           GroupFn&& group) {
  const int h_q = a.num_heads, h_kv = a.num_kv_heads, d = a.head_dim;
  const int per_kv = h_q / h_kv;
  const double scale = a.softmax_scale != 0.0f ? a.softmax_scale : 1.0 / std::sqrt(double(d));
  const int64_t total_q = cu_q.back();
  ReferenceResult r;
  r.o.assign(total_q * h_q * d, 0.0);
  r.lse.assign(h_q * total_q, kNegInf);
  std::vector<std::vector<double>> s;
  std::vector<ScoreRow> rows;
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const int64_t q0 = cu_q[b], sq = cu_q[b + 1] - cu_q[b];
    const int64_t k0 = cu_k[b], sk = cu_k[b + 1] - cu_k[b];
    for (int h = 0; h < h_q; ++h) {
      const int hk = h / per_kv;
      for (int64_t g = 0; g < sq; g += group_rows) {
        const int64_t n = std::min<int64_t>(group_rows, sq - g);
        s.resize(n);
        rows.resize(n);
        for (int64_t ri = 0; ri < n; ++ri) {
          const int64_t i = g + ri, p = i + sk - sq;
          s[ri].assign(sk, kNegInf);
          for (int64_t j = 0; j < sk; ++j) {
            if (a.causal && j > p) continue;
            if (a.window_left >= 0 && j < p - a.window_left) continue;
            if (a.window_right >= 0 && j > p + a.window_right) continue;
            double dot = 0;
            for (int c = 0; c < d; ++c)
              dot += q[((q0 + i) * h_q + h) * d + c] * k[((k0 + j) * h_kv + hk) * d + c];
            s[ri][j] = dot * scale;
          }
          const int64_t at = h * total_q + q0 + i;
          rows[ri] = {&r.o[((q0 + i) * h_q + h) * d], &r.lse[at], at};
        }
        group(rows, k0, s, hk);
      }
    }
  }
  return r;
}

// ForEachScoreGroup one row at a time: row(out_row, lse_at, k0, scores, hk, row_index).
template <typename RowFn>
ATTN_TEST_THREAD_PRIVATE ReferenceResult ForEachScoreRow(const kernels::AttentionArgs& a,
                                                         const std::vector<double>& q,
                                                         const std::vector<double>& k,
                                                         const std::vector<int32_t>& cu_q,
                                                         const std::vector<int32_t>& cu_k, RowFn&& row) {
  return ForEachScoreGroup(a, q, k, cu_q, cu_k, 1,
                           [&](const std::vector<ScoreRow>& rows, int64_t k0,
                               const std::vector<std::vector<double>>& s, int hk) ATTN_TEST_THREAD_PRIVATE {
                             row(rows[0].o, rows[0].lse, k0, s[0], hk, rows[0].at);
                           });
}

}  // namespace attn::testing
