// GPU flash forward vs the float64 reference and the CPU backend: every dtype x head dim x
// causal x GQA combination, ragged varlen batches with odd lengths, s_q != s_k, sliding windows,
// MQA. Inputs are drawn fresh each run (the seed is printed with any failure).
// Every suite runs once per forward generation (instantiations Gen1 and Gen2, forced through
// Run's FwdGeneration): generation 2 cases skip, with the reason, on a device other than compute
// capability 9.0, for head dims it does not implement (32, 96) or a build without sm_90a.
// Tolerances (relative L2 of O against the float64 reference): bf16 <= 1e-2, fp16 <= 2e-3;
// LSE max abs error <= 1e-2 (natural log units); -inf LSE must match exactly.
// Outputs are poisoned with NaN before each run and every element must come back finite.
// ATTN_TEST_GEN2_TILING=1 (wide) or 2 (narrow) plans every generation-2 case with that tiling
// (PlanOptions::gen2_tiling), so that both tilings' kernels are checked on every shape.
// Skips (GTEST_SKIP) when no CUDA device is present, and skips the cases whose head dim is not
// compiled into this build (ATTN_HEAD_DIMS) in RunAndCheck.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attn/kernels/attention.h"
#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/cuda_attention.h"
#include "common/reference.h"
#include "gpu/cpu_second_opinion.h"
#include "gpu/gpu_test_util.h"

namespace attn::kernels {
// gtest prints a DType inside a GetParam() tuple with this (else as a byte dump).
void PrintTo(DType t, std::ostream* os) { *os << DTypeName(t); }
}  // namespace attn::kernels

namespace {

using attn::kernels::AttentionArgs;
using attn::kernels::DType;
using attn::kernels::cuda::FwdGeneration;
using attn::testing::DeviceBuffer;
using attn::testing::Distance;
using attn::testing::HeadDimCompiled;
using attn::testing::HostTensor;
using attn::testing::RunOnCpu;

struct Case {
  DType dtype = DType::kBFloat16;
  int head_dim = 128;
  bool causal = false;
  int num_heads = 4;
  int num_kv_heads = 4;
  std::vector<int32_t> len_q;
  std::vector<int32_t> len_k;  // empty: same as len_q
  int window_left = -1;
  int window_right = -1;
  uint64_t seed = 1;
  bool with_lse = true;
  FwdGeneration gen = FwdGeneration::kAuto;
  // Run without the forward kernel's workspace: generation 2 then deals causal tiles in its fixed
  // order instead of from the tile counter.
  bool no_workspace = false;
};

// PlanOptions::gen2_tiling of every case: ATTN_TEST_GEN2_TILING, else 0 (the plan's estimate).
int TestGen2Tiling() {
  static const int tiling = [] {
    const char* e = std::getenv("ATTN_TEST_GEN2_TILING");
    return e != nullptr ? std::atoi(e) : 0;
  }();
  return tiling;
}

const char* GenName(FwdGeneration g) {
  return g == FwdGeneration::kGen1 ? "gen1" : g == FwdGeneration::kGen2 ? "gen2" : "auto";
}

std::string Describe(const Case& c) {
  std::string s = std::string(GenName(c.gen)) + " " + attn::kernels::DTypeName(c.dtype) + " d=" + std::to_string(c.head_dim) +
                  (c.causal ? " causal" : "") + " H=" + std::to_string(c.num_heads) +
                  " Hkv=" + std::to_string(c.num_kv_heads) + " win=(" + std::to_string(c.window_left) +
                  "," + std::to_string(c.window_right) + ") seed=" + std::to_string(c.seed) +
                  (c.no_workspace ? " no-workspace" : "") + " lq=[";
  for (int l : c.len_q) s += std::to_string(l) + ",";
  s += "] lk=[";
  for (int l : (c.len_k.empty() ? c.len_q : c.len_k)) s += std::to_string(l) + ",";
  return s + "]";
}


// Runs one case. A head dim this build does not compile (ATTN_HEAD_DIMS) skips the case: the test
// is reported as skipped with the reason, and the caller's other cases still run.
void RunAndCheck(Case c) {
  if (!HeadDimCompiled(c.head_dim)) {
    GTEST_SKIP() << "head dim " << c.head_dim
                 << " is not compiled into this build (ATTN_HEAD_DIMS); skipped that case";
  }
  c.seed ^= std::random_device{}();
  SCOPED_TRACE(Describe(c));
  const std::vector<int32_t>& lk = c.len_k.empty() ? c.len_q : c.len_k;
  ASSERT_EQ(c.len_q.size(), lk.size());
  const std::vector<int32_t> cu_q = attn::testing::CuSeqlens(c.len_q);
  const std::vector<int32_t> cu_k = attn::testing::CuSeqlens(lk);
  AttentionArgs a;
  a.dtype = c.dtype;
  a.batch = static_cast<int32_t>(c.len_q.size());
  a.total_q = cu_q.back();
  a.total_k = cu_k.back();
  for (int l : c.len_q) a.max_seqlen_q = std::max(a.max_seqlen_q, l);
  for (int l : lk) a.max_seqlen_k = std::max(a.max_seqlen_k, l);
  a.num_heads = c.num_heads;
  a.num_kv_heads = c.num_kv_heads;
  a.head_dim = c.head_dim;
  a.causal = c.causal;
  a.window_left = c.window_left;
  a.window_right = c.window_right;

  std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ull + 12345);
  const int64_t nq = int64_t(a.total_q) * a.num_heads * a.head_dim;
  const int64_t nk = int64_t(a.total_k) * a.num_kv_heads * a.head_dim;
  HostTensor q = HostTensor::Random(c.dtype, nq, rng);
  HostTensor k = HostTensor::Random(c.dtype, nk, rng);
  HostTensor v = HostTensor::Random(c.dtype, nk, rng);
  const size_t es = attn::kernels::DTypeSize(c.dtype);

  DeviceBuffer dq(nq * es), dk(nk * es), dv(nk * es), dout(nq * es),
      dlse(sizeof(float) * size_t(a.num_heads) * a.total_q), dcq(4 * cu_q.size()), dck(4 * cu_k.size());
  ASSERT_TRUE(dq.ptr && dk.ptr && dv.ptr && dout.ptr && dlse.ptr && dcq.ptr && dck.ptr);
  ASSERT_EQ(cudaMemcpy(dq.ptr, q.data(), nq * es, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk.ptr, k.data(), nk * es, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.ptr, v.data(), nk * es, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dcq.ptr, cu_q.data(), 4 * cu_q.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dck.ptr, cu_k.data(), 4 * cu_k.size(), cudaMemcpyHostToDevice), cudaSuccess);
  // Poison: 0xFFFF is a NaN in fp16 and bf16, 0xFFFFFFFF a NaN in float32.
  ASSERT_EQ(cudaMemset(dout.ptr, 0xFF, nq * es), cudaSuccess);
  ASSERT_EQ(cudaMemset(dlse.ptr, 0xFF, sizeof(float) * size_t(a.num_heads) * a.total_q), cudaSuccess);

  a.q = dq.ptr;
  a.k = dk.ptr;
  a.v = dv.ptr;
  a.o = dout.ptr;
  a.lse = c.with_lse ? static_cast<float*>(dlse.ptr) : nullptr;
  a.cu_seqlens_q = static_cast<const int32_t*>(dcq.ptr);
  a.cu_seqlens_k = static_cast<const int32_t*>(dck.ptr);

  const attn::kernels::Status st = attn::kernels::cuda::CanImplement(a);
  ASSERT_TRUE(st.ok()) << st.message();
  if (c.gen == FwdGeneration::kGen2) {
    const attn::kernels::Status st2 = attn::kernels::cuda::CanImplementGen2(a);
    if (!st2.ok()) {
      // Only these reasons are expected; any other refusal of these arguments is a failure.
      const bool expected = !attn::testing::IsHopper() || (c.head_dim != 64 && c.head_dim != 128 &&
                                                           c.head_dim != 256) ||
                            st2.message().find("not compiled") != std::string::npos;
      ASSERT_TRUE(expected) << st2.message();
      GTEST_SKIP() << st2.message();
    }
  }
  // Decode: the split-KV partials; forward: generation 2's tile counter.
  const size_t ws_bytes = attn::kernels::cuda::WorkspaceBytes(a);
  DeviceBuffer dws(ws_bytes);
  ASSERT_TRUE(dws.ptr);
  void* ws = ws_bytes > 0 && !c.no_workspace ? dws.ptr : nullptr;
  attn::kernels::cuda::PlanOptions options;
  options.generation = c.gen;
  options.gen2_tiling = TestGen2Tiling();
  options.gen2_tile_counter = ws != nullptr;
  attn::kernels::cuda::Plan plan;
  const attn::kernels::Status ps = attn::kernels::cuda::MakePlan(a, options, &plan);
  ASSERT_TRUE(ps.ok()) << ps.message();
  ASSERT_LE(plan.workspace_bytes, ws_bytes) << "the plan needs more workspace than WorkspaceBytes";
  const cudaError_t err = attn::kernels::cuda::Run(a, plan, ws, nullptr);
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  HostTensor out = HostTensor::Filled(c.dtype, nq, 0.0f);
  ASSERT_EQ(cudaMemcpy(out.data(), dout.ptr, nq * es, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> lse(size_t(a.num_heads) * a.total_q);
  ASSERT_EQ(cudaMemcpy(lse.data(), dlse.ptr, 4 * lse.size(), cudaMemcpyDeviceToHost), cudaSuccess);

  const attn::testing::ReferenceResult ref =
      attn::testing::ReferenceAttention(a, q.ToDouble(), k.ToDouble(), v.ToDouble(), cu_q, cu_k);
  const attn::testing::ErrorStats eo = attn::testing::CompareTo(ref.o, out);
  const double tol = c.dtype == DType::kBFloat16 ? 1e-2 : 2e-3;
  EXPECT_EQ(eo.non_finite, 0) << "unwritten or non-finite O elements";
  EXPECT_LE(eo.rel_l2, tol) << "O rel L2 " << eo.rel_l2 << " max abs " << eo.max_abs;
  // Both backends round to the same dtype: they agree to within two roundings.
  EXPECT_LE(Distance(out, RunOnCpu(a, q, k.data(), v.data(), cu_q, cu_k)), 2 * tol) << "GPU vs CPU backend";
  if (c.with_lse) {
    const attn::testing::ErrorStats el = attn::testing::CompareLse(ref.lse, lse);
    EXPECT_EQ(el.non_finite, 0) << "unwritten, non-finite or wrongly -inf LSE elements";
    EXPECT_LE(el.max_abs, 1e-2) << "LSE max abs " << el.max_abs;
  } else {
    // lse == nullptr: the poisoned buffer must be untouched.
    for (float x : lse) {
      ASSERT_TRUE(std::isnan(x)) << "LSE written although args.lse was nullptr";
    }
  }
}

uint64_t NextSeed() {
  static uint64_t seed = 1000;
  return ++seed;
}

// ---- The full matrix: dtype x head dim x causal x GQA -------------------------------------
struct MatrixParam {
  DType dtype;
  int head_dim;
  bool causal;
  int kv_div;  // num_kv_heads = 4 / kv_div (1: MHA, 2: GQA, 4: MQA)
  FwdGeneration gen;
};

class GpuMatrix : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(GpuMatrix, RaggedBatchMatchesReference) {
  SKIP_WITHOUT_GPU();
  const MatrixParam mp = GetParam();
  if (!HeadDimCompiled(mp.head_dim)) {
    GTEST_SKIP() << "head dim " << mp.head_dim << " is not compiled into this build (ATTN_HEAD_DIMS)";
  }
  Case c;
  c.gen = mp.gen;
  c.dtype = mp.dtype;
  c.head_dim = mp.head_dim;
  c.causal = mp.causal;
  c.num_heads = 4;
  c.num_kv_heads = 4 / mp.kv_div;
  c.len_q = {1, 7, 127, 129, 300};
  c.seed = NextSeed() + mp.head_dim * 7 + mp.kv_div * 131 + (mp.causal ? 17 : 0) +
           (mp.dtype == DType::kFloat16 ? 3 : 0);
  RunAndCheck(c);
  // s_q != s_k in the same batch, both directions.
  c.len_q = {5, 200, 64, 1};
  c.len_k = {77, 130, 64, 33};
  c.seed += 1;
  RunAndCheck(c);
  c.len_q = {150, 9};
  c.len_k = {40, 3};
  c.seed += 1;
  RunAndCheck(c);
}

std::vector<MatrixParam> AllMatrix(FwdGeneration gen) {
  std::vector<MatrixParam> v;
  for (DType t : {DType::kFloat16, DType::kBFloat16})
    for (int d : {32, 64, 96, 128, 256})
      for (bool causal : {false, true})
        for (int div : {1, 2, 4}) v.push_back({t, d, causal, div, gen});
  return v;
}

std::string MatrixName(const ::testing::TestParamInfo<MatrixParam>& info) {
  const MatrixParam& p = info.param;
  return std::string(p.dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" + std::to_string(p.head_dim) +
         (p.causal ? "_causal" : "_full") + (p.kv_div == 1 ? "_mha" : p.kv_div == 2 ? "_gqa" : "_mqa");
}
// gtest prints GetParam() with this (else as a byte dump) in listings and failures.
void PrintTo(const MatrixParam& p, std::ostream* os) { *os << MatrixName({p, 0}); }

INSTANTIATE_TEST_SUITE_P(Gen1, GpuMatrix, ::testing::ValuesIn(AllMatrix(FwdGeneration::kGen1)), MatrixName);
INSTANTIATE_TEST_SUITE_P(Gen2, GpuMatrix, ::testing::ValuesIn(AllMatrix(FwdGeneration::kGen2)), MatrixName);

// ---- Long and odd sequences ----------------------------------------------------------------
class GpuLong : public ::testing::TestWithParam<std::tuple<DType, int, bool, FwdGeneration>> {};

TEST_P(GpuLong, LongRaggedBatch) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = std::get<0>(GetParam());
  c.head_dim = std::get<1>(GetParam());
  c.causal = std::get<2>(GetParam());
  c.gen = std::get<3>(GetParam());
  c.num_heads = 1;  // keeps the float64 reference cheap on 4097-long sequences
  c.num_kv_heads = 1;
  c.len_q = {1000, 4097, 129};
  c.seed = NextSeed() * 3 + c.head_dim;
  RunAndCheck(c);
}

std::string LongName(const ::testing::TestParamInfo<std::tuple<DType, int, bool, FwdGeneration>>& info) {
  const auto& [dtype, head_dim, causal, gen] = info.param;
  return std::string(dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" + std::to_string(head_dim) +
         (causal ? "_causal" : "_full");
}

INSTANTIATE_TEST_SUITE_P(Gen1, GpuLong,
                         ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(64, 128), ::testing::Bool(),
                                            ::testing::Values(FwdGeneration::kGen1)),
                         LongName);
INSTANTIATE_TEST_SUITE_P(Gen2, GpuLong,
                         ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(64, 128, 256), ::testing::Bool(),
                                            ::testing::Values(FwdGeneration::kGen2)),
                         LongName);

// ---- Causal with s_q != s_k (long), sliding windows ---------------------------------------
class GpuCausal : public ::testing::TestWithParam<FwdGeneration> {
 protected:
  // A causal case of head dim d on this suite's generation, with a fresh seed.
  Case CausalCase(int d) const {
    Case c;
    c.gen = GetParam();
    c.head_dim = d;
    c.causal = true;
    c.seed = NextSeed();
    return c;
  }
};

TEST_P(GpuCausal, QueriesFewerThanKeys) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128}) {
    Case c = CausalCase(d);
    c.num_heads = 2;
    c.num_kv_heads = 2;
    c.len_q = {1, 17, 300};
    c.len_k = {1000, 513, 1200};
    RunAndCheck(c);
  }
}

// Causal tiles in the fixed order (no counter) and from the counter, on ragged batches with more
// tiles than SMs: both orders cover every tile once.
TEST_P(GpuCausal, FixedAndCountedTileOrders) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128}) {
    for (bool no_workspace : {true, false}) {
      Case c = CausalCase(d);
      c.num_heads = 8;
      c.num_kv_heads = 2;
      c.len_q = {700, 1, 1025, 333, 2048, 129};
      c.no_workspace = no_workspace;
      RunAndCheck(c);
    }
  }
}

TEST_P(GpuCausal, QueriesMoreThanKeysRowsWithoutKeys) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    Case c = CausalCase(64);
    c.dtype = t;
    c.num_heads = 3;
    c.num_kv_heads = 1;
    c.len_q = {1000, 300, 129};
    c.len_k = {200, 7, 1};  // many rows see no key: o = 0, lse = -inf
    RunAndCheck(c);
  }
}

std::string GenParamName(const ::testing::TestParamInfo<FwdGeneration>& info) { return GenName(info.param); }
INSTANTIATE_TEST_SUITE_P(Gen1, GpuCausal, ::testing::Values(FwdGeneration::kGen1), GenParamName);
INSTANTIATE_TEST_SUITE_P(Gen2, GpuCausal, ::testing::Values(FwdGeneration::kGen2), GenParamName);

struct WindowParam {
  bool causal;
  int left;
  int right;
  FwdGeneration gen = FwdGeneration::kGen1;
};

class GpuWindow : public ::testing::TestWithParam<WindowParam> {};

TEST_P(GpuWindow, SlidingWindow) {
  SKIP_WITHOUT_GPU();
  const WindowParam w = GetParam();
  for (int d : {64, 128, 256}) {
    for (DType t : {DType::kFloat16, DType::kBFloat16}) {
      Case c;
      c.gen = w.gen;
      c.dtype = t;
      c.head_dim = d;
      c.causal = w.causal;
      c.window_left = w.left;
      c.window_right = w.right;
      c.num_heads = 4;
      c.num_kv_heads = 2;
      c.len_q = {700, 1, 130, 64};
      c.len_k = {700, 50, 260, 20};
      c.seed = NextSeed();
      RunAndCheck(c);
    }
  }
}

// e.g. causal_left100_rightinf: a window side of -1 is unbounded.
std::string WindowName(const ::testing::TestParamInfo<WindowParam>& info) {
  const WindowParam& w = info.param;
  const auto side = [](int n) { return n < 0 ? std::string("inf") : std::to_string(n); };
  return std::string(w.causal ? "causal" : "full") + "_left" + side(w.left) + "_right" +
         side(w.right);
}
void PrintTo(const WindowParam& w, std::ostream* os) { *os << WindowName({w, 0}); }

std::vector<WindowParam> AllWindows(FwdGeneration gen) {
  std::vector<WindowParam> v = {{true, 100, -1}, {false, 64, 0}, {false, 33, 17}, {false, -1, 5},
                                {false, 0, 0},   {true, 0, -1},  {false, 200, 300}, {true, 5000, 3}};
  for (WindowParam& w : v) w.gen = gen;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Gen1, GpuWindow, ::testing::ValuesIn(AllWindows(FwdGeneration::kGen1)), WindowName);
INSTANTIATE_TEST_SUITE_P(Gen2, GpuWindow, ::testing::ValuesIn(AllWindows(FwdGeneration::kGen2)), WindowName);

TEST(GpuMisc, NoLseAndExplicitScale) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.head_dim = 128;
  c.len_q = {333, 65};
  c.with_lse = false;
  c.seed = NextSeed();
  RunAndCheck(c);
}

TEST(GpuMisc, CanImplementRejects) {
  AttentionArgs a;
  int dummy = 0;
  a.q = a.k = a.v = &dummy;
  a.o = &dummy;
  a.cu_seqlens_q = a.cu_seqlens_k = &dummy;
  a.total_q = a.total_k = a.max_seqlen_q = a.max_seqlen_k = 8;
  a.num_heads = 4;
  a.num_kv_heads = 2;
  int n = 0;
  const int* dims = attn::kernels::cuda::CompiledHeadDims(&n);
  ASSERT_GT(n, 0) << "no head dim compiled";
  a.head_dim = dims[0];
  a.dtype = DType::kBFloat16;
  EXPECT_TRUE(attn::kernels::cuda::CanImplement(a).ok()) << attn::kernels::cuda::CanImplement(a).message();
  a.dtype = DType::kFloat32;
  EXPECT_EQ(attn::kernels::cuda::CanImplement(a).code(), attn::kernels::StatusCode::kUnimplemented);
  a.dtype = DType::kFloat16;
  a.head_dim = 80;
  EXPECT_EQ(attn::kernels::cuda::CanImplement(a).code(), attn::kernels::StatusCode::kUnimplemented);
  a.head_dim = 64;
  a.num_kv_heads = 3;
  EXPECT_EQ(attn::kernels::cuda::CanImplement(a).code(), attn::kernels::StatusCode::kInvalidArgument);
  EXPECT_TRUE(attn::kernels::cuda::Compiled());
}

// ---- Small shapes for compute-sanitizer (memcheck, racecheck): --gtest_filter=*GpuSmoke.* ---
class GpuSmoke : public ::testing::TestWithParam<FwdGeneration> {};

TEST_P(GpuSmoke, SmallShapes) {
  SKIP_WITHOUT_GPU();
  int n = 0;
  const int* dims = attn::kernels::cuda::CompiledHeadDims(&n);
  for (int i = 0; i < n; ++i) {
    for (DType t : {DType::kFloat16, DType::kBFloat16}) {
      for (bool causal : {false, true}) {
        Case c;
        c.gen = GetParam();
        c.dtype = t;
        c.head_dim = dims[i];
        c.causal = causal;
        c.num_heads = 2;
        c.num_kv_heads = 1;
        c.len_q = {1, 70, 130, 250};
        c.len_k = {9, 70, 150, 250};
        c.window_left = causal ? 40 : -1;
        c.seed = NextSeed();
        RunAndCheck(c);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gen1, GpuSmoke, ::testing::Values(FwdGeneration::kGen1), GenParamName);
INSTANTIATE_TEST_SUITE_P(Gen2, GpuSmoke, ::testing::Values(FwdGeneration::kGen2), GenParamName);

}  // namespace
