// The CPU backend against the float64 reference, on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <tuple>

#include "attn/kernels/cpu_attention.h"
#include "common/reference.h"

namespace attn {
namespace kernels {
// gtest prints a DType inside a GetParam() tuple with this (else as a byte dump).
void PrintTo(DType t, std::ostream* os) { *os << DTypeName(t); }
}  // namespace kernels

namespace {

using kernels::AttentionArgs;
using kernels::DType;
using testing::CuSeqlens;
using testing::HostTensor;

// Tolerances on ||o - ref|| / ||ref||: fp32 accumulation everywhere, so what remains is the
// rounding of the output to its dtype (bf16: 8 bits of mantissa, fp16: 11).
double OutputTolerance(DType t) {
  switch (t) {
    case DType::kFloat32: return 2e-6;
    case DType::kFloat16: return 1e-3;
    case DType::kBFloat16: return 6e-3;
  }
  return 0;
}
// Absolute tolerance on the LSE, per dtype. The LSE is computed and stored in float32 for every
// dtype, and the float64 reference reads the same (already rounded) q and k, so the input dtype
// adds no error of its own: what remains is float32 rounding of the d-term dot products and of
// the online softmax's exp2/log2 and rescaling, on values of magnitude ~log(s_k). Measured over
// this file's tests: at most 1.0e-6 for each of the three dtypes; the bound gives 20x margin. It
// is the same for all three on purpose, and written per dtype so that a change that computed
// scores in the input dtype would have to loosen (and justify) one entry, not all.
double LseTolerance(DType t) {
  switch (t) {
    case DType::kFloat32: return 2e-5;
    case DType::kFloat16: return 2e-5;   // fp16 inputs are exact in fp32; fp32 accumulation
    case DType::kBFloat16: return 2e-5;  // likewise
  }
  return 0;
}

struct Problem {
  DType dtype = DType::kBFloat16;
  std::vector<int32_t> len_q;
  std::vector<int32_t> len_k;
  int heads = 4;
  int kv_heads = 4;
  int head_dim = 64;
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  float scale = 0.0f;
};

struct Outcome {
  testing::ErrorStats o;
  testing::ErrorStats lse;
};

Outcome RunAndCompare(const Problem& p, uint64_t seed, kernels::cpu::CpuThreadPool* pool) {
  std::mt19937_64 rng(seed);
  const auto cu_q = CuSeqlens(p.len_q), cu_k = CuSeqlens(p.len_k);
  const int32_t total_q = cu_q.back(), total_k = cu_k.back();
  HostTensor q = HostTensor::Random(p.dtype, int64_t(total_q) * p.heads * p.head_dim, rng);
  HostTensor k = HostTensor::Random(p.dtype, int64_t(total_k) * p.kv_heads * p.head_dim, rng);
  HostTensor v = HostTensor::Random(p.dtype, int64_t(total_k) * p.kv_heads * p.head_dim, rng);
  // Poison: NaN everywhere, so an unwritten element fails the comparison.
  HostTensor o = HostTensor::Filled(p.dtype, q.elements, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse(size_t(p.heads) * total_q, std::numeric_limits<float>::quiet_NaN());

  AttentionArgs a;
  a.dtype = p.dtype;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.o = o.data();
  a.lse = lse.data();
  a.cu_seqlens_q = cu_q.data();
  a.cu_seqlens_k = cu_k.data();
  a.batch = static_cast<int32_t>(p.len_q.size());
  a.total_q = total_q;
  a.total_k = total_k;
  a.max_seqlen_q = *std::max_element(p.len_q.begin(), p.len_q.end());
  a.max_seqlen_k = *std::max_element(p.len_k.begin(), p.len_k.end());
  a.num_heads = p.heads;
  a.num_kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.softmax_scale = p.scale;
  a.causal = p.causal;
  a.window_left = p.window_left;
  a.window_right = p.window_right;

  std::vector<char> ws(kernels::cpu::WorkspaceBytes(a, pool ? pool->NumWorkers() : 1) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
  kernels::Status st = kernels::cpu::Run(a, aligned, pool);
  EXPECT_TRUE(st.ok()) << st.message();

  const auto ref = testing::ReferenceAttention(a, q.ToDouble(), k.ToDouble(), v.ToDouble(), cu_q,
                                               cu_k);
  return {testing::CompareTo(ref.o, o), testing::CompareLse(ref.lse, lse)};
}

void ExpectClose(const Problem& p, const Outcome& r) {
  EXPECT_EQ(r.o.non_finite, 0) << "unwritten or non-finite outputs";
  EXPECT_LE(r.o.rel_l2, OutputTolerance(p.dtype));
  EXPECT_EQ(r.lse.non_finite, 0) << "LSE differs in which rows see no key, or is non-finite";
  EXPECT_LE(r.lse.max_abs, LseTolerance(p.dtype));
}

class CpuAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override { pool_ = kernels::cpu::CpuThreadPool::Create(3); }
  uint64_t Seed() { return std::random_device{}() ^ (uint64_t(++counter_) << 32); }
  std::unique_ptr<kernels::cpu::CpuThreadPool> pool_;
  int counter_ = 0;
};

// dtype x causal x GQA x head dim, on a small ragged batch.
using Combo = std::tuple<DType, bool, std::pair<int, int>, int>;
class CpuAttentionComboTest : public CpuAttentionTest,
                              public ::testing::WithParamInterface<Combo> {};

TEST_P(CpuAttentionComboTest, MatchesFloat64Reference) {
  const auto [dtype, causal, heads, d] = GetParam();
  Problem p;
  p.dtype = dtype;
  p.causal = causal;
  p.heads = heads.first;
  p.kv_heads = heads.second;
  p.head_dim = d;
  p.len_q = {1, 17, 70};
  p.len_k = {1, 17, 70};
  ExpectClose(p, RunAndCompare(p, Seed(), pool_.get()));
}

std::string ComboName(const ::testing::TestParamInfo<Combo>& info) {
  const auto [dtype, causal, heads, d] = info.param;
  return std::string(kernels::DTypeName(dtype)) + (causal ? "_causal" : "_full") + "_h" +
         std::to_string(heads.first) + "kv" + std::to_string(heads.second) + "_d" +
         std::to_string(d);
}

INSTANTIATE_TEST_SUITE_P(
    AllCombos, CpuAttentionComboTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Bool(),
                       ::testing::Values(std::make_pair(4, 4), std::make_pair(4, 2),
                                         std::make_pair(4, 1)),
                       ::testing::Values(32, 64, 96, 128, 256)),
    ComboName);

TEST_F(CpuAttentionTest, RaggedVarlenWithLongSequence) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    Problem p;
    p.dtype = dtype;
    p.heads = 2;
    p.kv_heads = 1;
    p.head_dim = 64;
    p.len_q = {1, 17, 1000, 3};
    p.len_k = {1, 17, 1000, 3};
    ExpectClose(p, RunAndCompare(p, Seed(), pool_.get()));
  }
}

TEST_F(CpuAttentionTest, QueriesFewerThanKeysCausalIsBottomRightAligned) {
  Problem p;
  p.len_q = {5, 1, 64};
  p.len_k = {300, 129, 1000};
  p.causal = true;
  p.head_dim = 128;
  ExpectClose(p, RunAndCompare(p, Seed(), pool_.get()));
}

TEST_F(CpuAttentionTest, QueriesMoreThanKeysCausalLeavesEarlyRowsEmpty) {
  // s_q > s_k with the bottom-right causal mask: the first s_q - s_k rows see no key and must
  // come out as o = 0, lse = -inf (the reference says so too).
  Problem p;
  p.dtype = DType::kFloat32;
  p.len_q = {40, 17};
  p.len_k = {10, 16};
  p.causal = true;
  const Outcome r = RunAndCompare(p, Seed(), pool_.get());
  ExpectClose(p, r);
}

TEST_F(CpuAttentionTest, NonCausalDifferentLengths) {
  Problem p;
  p.dtype = DType::kFloat16;
  p.len_q = {33, 200};
  p.len_k = {100, 7};
  ExpectClose(p, RunAndCompare(p, Seed(), pool_.get()));
}

// Sliding window x dtype x heads: windows on either side, one-sided, zero-width, and with the
// causal mask, over MHA and GQA (4 query heads over 2 or 1 KV heads), on a ragged batch with
// more keys than queries in one sequence and fewer in another.
struct Window {
  const char* name;
  int left, right;
  bool causal;
};
void PrintTo(const Window& w, std::ostream* os) { *os << w.name; }
using WindowCombo = std::tuple<DType, Window, std::pair<int, int>>;
class CpuAttentionWindowTest : public CpuAttentionTest,
                               public ::testing::WithParamInterface<WindowCombo> {};

TEST_P(CpuAttentionWindowTest, MatchesFloat64Reference) {
  const auto [dtype, window, heads] = GetParam();
  Problem p;
  p.dtype = dtype;
  p.heads = heads.first;
  p.kv_heads = heads.second;
  p.len_q = {130, 1, 64};
  p.len_k = {130, 9, 200};
  p.window_left = window.left;
  p.window_right = window.right;
  p.causal = window.causal;
  ExpectClose(p, RunAndCompare(p, Seed(), pool_.get()));
}

std::string WindowComboName(const ::testing::TestParamInfo<WindowCombo>& info) {
  const auto [dtype, window, heads] = info.param;
  return std::string(kernels::DTypeName(dtype)) + "_" + window.name + "_h" +
         std::to_string(heads.first) + "kv" + std::to_string(heads.second);
}

INSTANTIATE_TEST_SUITE_P(
    AllWindows, CpuAttentionWindowTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(Window{"l16_r0_causal", 16, 0, true},
                                         Window{"l50_r20_causal", 50, 20, true},
                                         Window{"l50_r20", 50, 20, false},
                                         Window{"l0_r0", 0, 0, false},
                                         Window{"lunbounded_r5", -1, 5, false},
                                         Window{"l100_runbounded", 100, -1, false}),
                       ::testing::Values(std::make_pair(4, 4), std::make_pair(4, 2),
                                         std::make_pair(4, 1))),
    WindowComboName);

TEST_F(CpuAttentionTest, CustomScaleAndSingleThread) {
  Problem p;
  p.dtype = DType::kBFloat16;
  p.len_q = {77};
  p.len_k = {77};
  p.scale = 0.37f;
  p.heads = 8;
  p.kv_heads = 2;
  ExpectClose(p, RunAndCompare(p, Seed(), nullptr));
}

TEST_F(CpuAttentionTest, ZeroLengthSequencesInsideBatch) {
  Problem p;
  p.len_q = {0, 5, 0, 9};
  p.len_k = {3, 5, 0, 0};  // sequence 3 has queries but no keys: o = 0, lse = -inf
  ExpectClose(p, RunAndCompare(p, Seed(), pool_.get()));
}

TEST_F(CpuAttentionTest, RejectsBadArguments) {
  const std::vector<int32_t> cu = {0, 4};
  const std::vector<int32_t> bad_cu = {1, 4};
  std::vector<uint16_t> buf(4 * 4 * 64);
  AttentionArgs a;
  a.q = a.k = a.v = buf.data();
  a.o = buf.data();
  a.cu_seqlens_q = cu.data();
  a.cu_seqlens_k = cu.data();
  a.total_q = a.total_k = a.max_seqlen_q = a.max_seqlen_k = 4;
  a.num_heads = 4;
  a.num_kv_heads = 3;
  a.head_dim = 64;
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  a.num_kv_heads = 2;
  EXPECT_TRUE(kernels::cpu::CanImplement(a).ok());
  a.cu_seqlens_k = bad_cu.data();
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  a.cu_seqlens_k = cu.data();
  a.head_dim = kernels::cpu::kMaxHeadDim + 1;
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kUnimplemented);
}

// Every array must start at a multiple of its element size: a misaligned one is refused by name
// (Run never loads from it), an aligned one at any such offset is taken.
TEST_F(CpuAttentionTest, RejectsMisalignedArrays) {
  static const int32_t cu[3] = {0, 4, 0};
  std::vector<float> buf(8 * 4 * 8 + 16);
  std::vector<float> lse(4 * 4 + 4);
  char* base = reinterpret_cast<char*>(buf.data());
  auto args = [&](DType dtype) {
    AttentionArgs a;
    a.dtype = dtype;
    a.q = a.k = a.v = a.o = base + 64;
    a.lse = lse.data();
    a.cu_seqlens_q = a.cu_seqlens_k = cu;
    a.total_q = a.total_k = a.max_seqlen_q = a.max_seqlen_k = 4;
    a.num_heads = a.num_kv_heads = 2;
    a.head_dim = 8;
    return a;
  };
  auto expect_refused = [](const AttentionArgs& a, const std::string& part) {
    const kernels::Status st = kernels::cpu::CanImplement(a);
    EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument) << part;
    EXPECT_NE(st.message().find(part), std::string::npos) << st.message();
    std::vector<char> ws(kernels::cpu::WorkspaceBytes(a, 1) + 64);
    void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
    EXPECT_EQ(kernels::cpu::Run(a, aligned, nullptr).code(), kernels::StatusCode::kInvalidArgument);
  };
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const size_t elem = kernels::DTypeSize(dtype);
    EXPECT_TRUE(kernels::cpu::CanImplement(args(dtype)).ok());
    for (size_t skew = 1; skew < 4; ++skew) {
      AttentionArgs a = args(dtype);
      a.k = base + 64 + skew;  // the first fuzz finding: float32 K at an odd offset
      if (skew % elem == 0) {
        EXPECT_TRUE(kernels::cpu::CanImplement(a).ok()) << skew;
      } else {
        expect_refused(a, "k is not aligned to " + std::to_string(elem) + " bytes");
      }
    }
    AttentionArgs a = args(dtype);
    a.q = base + 1;
    expect_refused(a, "q is not aligned");
    a = args(dtype);
    a.v = base + 3;
    expect_refused(a, "v is not aligned");
    a = args(dtype);
    a.o = base + 1;
    expect_refused(a, "o is not aligned");
  }
  AttentionArgs a = args(DType::kBFloat16);
  a.lse = reinterpret_cast<float*>(reinterpret_cast<char*>(lse.data()) + 2);
  expect_refused(a, "lse is not aligned to 4 bytes");
  a = args(DType::kBFloat16);
  a.cu_seqlens_k = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(cu) + 1);
  expect_refused(a, "cu_seqlens_k is not aligned to 4 bytes");
}

// Paged K/V: each sequence's keys and values are scattered over pages of a pool in shuffled
// order (pages not contiguous, a sequence's pages not in pool order), with a partial last page,
// empty and 1-token caches, and pages shared by two sequences (a forked prefix). The output must
// equal the float64 reference over the same keys laid out contiguously; the pool's unused rows
// are NaN, so a read outside the table shows up.
struct PagedProblem {
  DType dtype = DType::kBFloat16;
  std::vector<int32_t> len_q;
  std::vector<int32_t> len_k;  // keys in each sequence's cache (its new tokens included)
  int page_size = 16;
  int heads = 4;
  int kv_heads = 2;
  int head_dim = 64;
  bool causal = true;
  int window_left = -1;
  int window_right = -1;
  int extra_pages = 7;          // unused pages in the pool, NaN-filled
  bool share_first_page = false;  // sequence 1 shares sequence 0's first (full) page
  // The last len_q keys of each sequence come through paged.append_k / append_v: their pool rows
  // are NaN before the run and must hold them after it, with every other pool byte unchanged.
  bool append = false;
};

Outcome RunPagedAndCompare(const PagedProblem& p, uint64_t seed,
                           kernels::cpu::CpuThreadPool* pool) {
  std::mt19937_64 rng(seed);
  const int32_t batch = static_cast<int32_t>(p.len_q.size());
  const auto cu_q = CuSeqlens(p.len_q), cu_k = CuSeqlens(p.len_k);
  const int64_t row = int64_t(p.kv_heads) * p.head_dim;
  HostTensor q = HostTensor::Random(p.dtype, int64_t(cu_q.back()) * p.heads * p.head_dim, rng);
  HostTensor k = HostTensor::Random(p.dtype, int64_t(cu_k.back()) * row, rng);
  HostTensor v = HostTensor::Random(p.dtype, int64_t(cu_k.back()) * row, rng);
  const size_t elem = kernels::DTypeSize(p.dtype);
  const size_t row_bytes = row * elem;
  if (p.share_first_page) {  // sequence 1's first page holds sequence 0's first keys
    std::memcpy(k.bytes.data() + cu_k[1] * row_bytes, k.bytes.data(), p.page_size * row_bytes);
    std::memcpy(v.bytes.data() + cu_k[1] * row_bytes, v.bytes.data(), p.page_size * row_bytes);
  }
  // Page ids: one per page of each sequence (the shared one once), plus unused ones, shuffled.
  std::vector<int32_t> pages_of(batch);
  int32_t num_pages = p.extra_pages;
  for (int32_t b = 0; b < batch; ++b) {
    pages_of[b] = (p.len_k[b] + p.page_size - 1) / p.page_size;
    num_pages += pages_of[b] - (p.share_first_page && b == 1 ? 1 : 0);
  }
  std::vector<int32_t> ids(num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  HostTensor k_pool = HostTensor::Filled(p.dtype, int64_t(num_pages) * p.page_size * row,
                                         std::numeric_limits<float>::quiet_NaN());
  HostTensor v_pool = k_pool;
  std::vector<int32_t> indptr = {0}, indices, seqlens(p.len_k);
  size_t next = 0;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t i = 0; i < pages_of[b]; ++i) {
      const bool shared = p.share_first_page && b == 1 && i == 0;
      const int32_t page = shared ? indices[0] : ids[next++];
      indices.push_back(page);
      const int32_t rows = std::min(p.page_size, p.len_k[b] - i * p.page_size);
      const size_t src = (size_t(cu_k[b]) + size_t(i) * p.page_size) * row_bytes;
      const size_t dst = size_t(page) * p.page_size * row_bytes;
      std::memcpy(k_pool.bytes.data() + dst, k.bytes.data() + src, rows * row_bytes);
      std::memcpy(v_pool.bytes.data() + dst, v.bytes.data() + src, rows * row_bytes);
    }
    indptr.push_back(static_cast<int32_t>(indices.size()));
  }
  if (indices.empty()) indices.push_back(0);  // keep the pointer non-null
  const HostTensor k_pool_after = k_pool, v_pool_after = v_pool;
  HostTensor k_new = HostTensor::Filled(p.dtype, int64_t(cu_q.back()) * row, 0.0f), v_new = k_new;
  if (p.append) {
    for (int32_t b = 0; b < batch; ++b) {
      for (int32_t i = 0; i < p.len_q[b]; ++i) {
        const int32_t j = p.len_k[b] - p.len_q[b] + i;
        const size_t at = (size_t(indices[indptr[b] + j / p.page_size]) * p.page_size +
                           j % p.page_size) * row_bytes;
        const size_t to = size_t(cu_q[b] + i) * row_bytes;
        std::memcpy(k_new.bytes.data() + to, k_pool.bytes.data() + at, row_bytes);
        std::memcpy(v_new.bytes.data() + to, v_pool.bytes.data() + at, row_bytes);
        std::memset(k_pool.bytes.data() + at, 0xFF, row_bytes);  // NaN in every dtype
        std::memset(v_pool.bytes.data() + at, 0xFF, row_bytes);
      }
    }
  }

  HostTensor o = HostTensor::Filled(p.dtype, q.elements, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse(size_t(p.heads) * cu_q.back(), std::numeric_limits<float>::quiet_NaN());
  AttentionArgs a;
  a.dtype = p.dtype;
  a.q = q.data();
  a.k = k_pool.data();
  a.v = v_pool.data();
  a.o = o.data();
  a.lse = lse.data();
  a.cu_seqlens_q = cu_q.data();
  a.batch = batch;
  a.total_q = cu_q.back();
  a.max_seqlen_q = *std::max_element(p.len_q.begin(), p.len_q.end());
  a.max_seqlen_k = std::max(1, *std::max_element(p.len_k.begin(), p.len_k.end()));
  a.num_heads = p.heads;
  a.num_kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.causal = p.causal;
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.paged.page_size = p.page_size;
  a.paged.num_pages = num_pages;
  a.paged.page_indptr = indptr.data();
  a.paged.page_indices = indices.data();
  a.paged.seqlens_k = seqlens.data();
  if (p.append) {
    a.paged.append_k = k_new.data();
    a.paged.append_v = v_new.data();
  }

  std::vector<char> ws(kernels::cpu::WorkspaceBytes(a, pool ? pool->NumWorkers() : 1) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
  kernels::Status st = kernels::cpu::Run(a, aligned, pool);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(k_pool.bytes == k_pool_after.bytes) << "the K pool after the run";
  EXPECT_TRUE(v_pool.bytes == v_pool_after.bytes) << "the V pool after the run";

  AttentionArgs contiguous = a;
  contiguous.paged = {};
  contiguous.total_k = cu_k.back();
  const auto ref = testing::ReferenceAttention(contiguous, q.ToDouble(), k.ToDouble(),
                                               v.ToDouble(), cu_q, cu_k);
  return {testing::CompareTo(ref.o, o), testing::CompareLse(ref.lse, lse)};
}

void ExpectPagedClose(const PagedProblem& p, const Outcome& r) {
  EXPECT_EQ(r.o.non_finite, 0) << "unwritten, non-finite, or read outside the page table";
  EXPECT_LE(r.o.rel_l2, OutputTolerance(p.dtype));
  EXPECT_EQ(r.lse.non_finite, 0);
  EXPECT_LE(r.lse.max_abs, LseTolerance(p.dtype));
}

using PagedCombo = std::tuple<DType, int, std::pair<int, int>>;
class CpuPagedAttentionTest : public CpuAttentionTest,
                              public ::testing::WithParamInterface<PagedCombo> {};

// Decode steps (one query each) and chunked prefills over shuffled pages, ragged lengths with
// partial last pages, an empty cache and 1-token caches.
TEST_P(CpuPagedAttentionTest, DecodeAndChunksMatchFloat64Reference) {
  const auto [dtype, page_size, heads] = GetParam();
  PagedProblem p;
  p.dtype = dtype;
  p.page_size = page_size;
  p.heads = heads.first;
  p.kv_heads = heads.second;
  p.len_q = {1, 1, 1, 1, 7, 40};
  p.len_k = {1, 37, 2 * page_size, 300, 7, 41};
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
}

std::string PagedComboName(const ::testing::TestParamInfo<PagedCombo>& info) {
  const auto [dtype, page_size, heads] = info.param;
  return std::string(kernels::DTypeName(dtype)) + "_page" + std::to_string(page_size) + "_h" +
         std::to_string(heads.first) + "kv" + std::to_string(heads.second);
}

INSTANTIATE_TEST_SUITE_P(
    AllPaged, CpuPagedAttentionTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(1, 3, 16, 64),
                       ::testing::Values(std::make_pair(4, 4), std::make_pair(8, 2),
                                         std::make_pair(4, 1))),
    PagedComboName);

TEST_F(CpuAttentionTest, PagedEmptyCacheRowsSeeNoKey) {
  PagedProblem p;
  p.dtype = DType::kFloat32;
  p.len_q = {3, 1, 2};
  p.len_k = {0, 5, 0};  // queries over an empty cache: o = 0, lse = -inf
  p.causal = false;
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
  p.len_k = {0, 0, 0};  // no page at all in the table
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
}

TEST_F(CpuAttentionTest, PagedSharedPrefixPageAndWindow) {
  PagedProblem p;
  p.dtype = DType::kBFloat16;
  p.page_size = 16;
  p.len_q = {1, 5};
  p.len_k = {20, 33};
  p.share_first_page = true;
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
  p.window_left = 9;
  p.window_right = 0;
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
  p.causal = false;
  p.window_left = 4;
  p.window_right = 2;
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), nullptr));
}

TEST_F(CpuAttentionTest, PagedLongCacheManyThreads) {
  PagedProblem p;
  p.dtype = DType::kFloat16;
  p.page_size = 32;
  p.head_dim = 128;
  p.heads = 8;
  p.kv_heads = 2;
  p.len_q = std::vector<int32_t>(16, 1);
  p.len_k = {4000, 1, 2, 31, 32, 33, 1000, 17, 64, 65, 500, 2048, 3, 127, 128, 129};
  ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
}

// Rows appended by the call itself: read from append_k / append_v, written into their pages.
TEST_F(CpuAttentionTest, PagedAppendedRowsAreReadAndWritten) {
  PagedProblem p;
  p.append = true;
  for (DType t : {DType::kFloat32, DType::kBFloat16}) {
    for (int page : {1, 16, 24}) {
      p.dtype = t;
      p.page_size = page;
      p.len_q = {1, 4, 1, 16, 3};
      p.len_k = {1, 37, 2 * page, 300, 3};
      ExpectPagedClose(p, RunPagedAndCompare(p, Seed(), pool_.get()));
    }
  }
}

// One bf16 sequence of cu_q.back() queries (4 heads, 2 KV heads, d = 64) over a 4-page pool of
// 16-token pages, every tensor in buf: arguments for the CanImplement checks.
AttentionArgs SmallPagedArgs(std::vector<uint16_t>& buf, const std::vector<int32_t>& cu_q,
                             std::vector<int32_t>& indptr, std::vector<int32_t>& indices,
                             std::vector<int32_t>& seqlens) {
  AttentionArgs a;
  a.q = a.k = a.v = buf.data();
  a.o = buf.data();
  a.cu_seqlens_q = cu_q.data();
  a.total_q = a.max_seqlen_q = cu_q.back();
  a.max_seqlen_k = 20;
  a.num_heads = 4;
  a.num_kv_heads = 2;
  a.head_dim = 64;
  a.paged = {16, 4, indptr.data(), indices.data(), seqlens.data()};
  return a;
}

TEST_F(CpuAttentionTest, PagedAppendRefusals) {
  std::vector<uint16_t> buf(4 * 16 * 2 * 64);
  const std::vector<int32_t> cu_q = {0, 2};
  std::vector<int32_t> indptr = {0, 2}, indices = {1, 0}, seqlens = {20};
  AttentionArgs a = SmallPagedArgs(buf, cu_q, indptr, indices, seqlens);
  a.paged.append_k = a.paged.append_v = buf.data();
  EXPECT_TRUE(kernels::cpu::CanImplement(a).ok()) << kernels::cpu::CanImplement(a).message();
  auto refused = [&](const char* words) {
    const kernels::Status st = kernels::cpu::CanImplement(a);
    EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument) << words;
    EXPECT_NE(st.message().find(words), std::string::npos) << st.message();
  };
  a.paged.append_v = nullptr;
  refused("set together");
  a.paged.append_v = buf.data();
  a.kv_dtype = DType::kFloat8E4M3;
  const float scales[2] = {1, 1};
  a.kv_scales = {scales, scales};
  refused("16-bit k and v");
  a.kv_dtype.reset();
  seqlens = {1};  // two rows appended to a cache of one key
  indptr = {0, 1};
  refused("appends more rows");
  seqlens = {20};
  indptr = {0, 2};
  a.paged.append_k = reinterpret_cast<const char*>(buf.data()) + 1;
  refused("paged.append_k is not aligned");
  a.paged.append_k = buf.data();
  AttentionArgs contiguous = a;
  contiguous.paged = {};
  contiguous.paged.append_k = contiguous.paged.append_v = buf.data();
  const std::vector<int32_t> cu_k = {0, 20};
  contiguous.cu_seqlens_k = cu_k.data();
  contiguous.total_k = 20;
  a = contiguous;
  refused("on paged k and v");
}

TEST_F(CpuAttentionTest, PagedRejectsBadPageTables) {
  std::vector<uint16_t> buf(4 * 16 * 2 * 64);
  const std::vector<int32_t> cu_q = {0, 1};
  std::vector<int32_t> indptr = {0, 2}, indices = {1, 0}, seqlens = {20};
  AttentionArgs a = SmallPagedArgs(buf, cu_q, indptr, indices, seqlens);
  EXPECT_TRUE(kernels::cpu::CanImplement(a).ok()) << kernels::cpu::CanImplement(a).message();
  indices = {1, 4};  // page out of the pool
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  indices = {1, -1};
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  indices = {1, 0};
  seqlens = {33};  // 3 pages needed, 2 given (and over max_seqlen_k)
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  a.max_seqlen_k = 40;
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  seqlens = {16};  // 1 page needed, 2 given
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
  seqlens = {17};
  EXPECT_TRUE(kernels::cpu::CanImplement(a).ok());
  indptr = {1, 2};
  EXPECT_EQ(kernels::cpu::CanImplement(a).code(), kernels::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attn
