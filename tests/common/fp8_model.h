// Float64 models of the FP8 tensor-core forward kernel's arithmetic (kernels::cuda::RunFp8Attention
// and the plan's FP8 tensor-core path), written apart from the kernels library: what the GPU tests
// hold that kernel to, beside the exact reference.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/kernels/attention.h"
#include "common/reference.h"

namespace attn::testing {

// How the kernel scales and sums P (kernels::cuda::Fp8SoftmaxRule, as the library reports it).
struct Fp8SoftmaxModel {
  int key_tile = 128;
  bool sums_rounded_p = false;   // the row sums are of the e4m3-rounded P
  int lazy_rescale_eighths = 0;  // > 0: the lazy rescale of 16-row groups (below)
};

// Attention as the FP8 tensor-core kernel computes it, in float64 on the values its codes stand
// for (q, k, v = code * descale): per query row, key tiles of key_tile keys from the sequence's
// first key, visited from the last, with a running max; each key's p = exp(s - m) * 256 against
// the max m the row is scaled to enters the P V product rounded to the nearest e4m3 value and the
// row sum as it is (sums_rounded_p: rounded too); o = (P V) / sum, lse = m + log(sum / 256).
// m is the running max, or, with lazy_rescale_eighths, the max of a previous tile: the rows of a
// group (16 consecutive rows of the sequence from row 0, as a warp holds them) keep theirs until
// one of the group grows past its own by more than lazy_rescale_eighths / 8 in log2 units; a
// group cut short by the sequence's end rescales on every tile.
ReferenceResult Fp8TensorCoreModel(const kernels::AttentionArgs& shape_and_flags,
                                   const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v,
                                   const std::vector<int32_t>& cu_seqlens_q,
                                   const std::vector<int32_t>& cu_seqlens_k, const Fp8SoftmaxModel& model = {});

// Where the row sums are of the rounded P (sums_rounded_p): per query row (indexed as
// ReferenceResult::lse), the interval of LSE that the model's arithmetic gives when every score
// may be off the exact one by up to score_err of its row (the tensor cores' accumulation). A
// score's error moves its p across e4m3 rounding boundaries (steps of 1/8), which a bound on
// unrounded sums does not allow for; with a lazy rescale it may also flip a group's choice to
// rescale (where a growth lies within the errors of the slack), after which the group's rows are
// bounded over every max they may be scaled to. lo is -inf for rows that see no key (and where
// every p may round to zero).
struct LseBounds {
  std::vector<double> lo, hi;
};
LseBounds Fp8TensorCoreLseBounds(const kernels::AttentionArgs& shape_and_flags, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<int32_t>& cu_seqlens_q,
                                 const std::vector<int32_t>& cu_seqlens_k, const std::vector<double>& score_err,
                                 const Fp8SoftmaxModel& model);

// Per row, the error score_err that Fp8TensorCoreLseBounds takes: rel times the row's score
// magnitude (ScoreMagnitudes), 0 for rows that see no key.
std::vector<double> ScoreErrors(const std::vector<double>& magnitudes, double rel);

}  // namespace attn::testing
