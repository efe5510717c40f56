#include "session_util.h"

#include <grpcpp/client_context.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>

#include <chrono>
#include <cmath>
#include <cstring>

namespace attn::testing {
namespace {

kernels::DType KernelDType(v1::DType t) {
  return t == v1::DTYPE_FLOAT16 ? kernels::DType::kFloat16
         : t == v1::DTYPE_FLOAT32 ? kernels::DType::kFloat32
                                  : kernels::DType::kBFloat16;
}

void FillRandom(v1::Tensor* t, v1::DType dtype, int64_t tokens, int heads, int d,
                std::mt19937_64& rng) {
  t->set_dtype(dtype);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  HostTensor h = HostTensor::Random(KernelDType(dtype), tokens * heads * d, rng);
  t->set_data(h.bytes.data(), h.bytes.size());
}

std::vector<double> ToDouble(const v1::Tensor& t) {
  HostTensor h;
  h.dtype = KernelDType(t.dtype());
  h.elements = static_cast<int64_t>(t.data().size() / kernels::DTypeSize(h.dtype));
  h.bytes.assign(t.data().begin(), t.data().end());
  return h.ToDouble();
}

// t's elements as double, dequantized with per-head scales when t holds E4M3 codes.
std::vector<double> Values(const v1::Tensor& t, const std::vector<float>& scales) {
  if (t.dtype() != v1::DTYPE_FLOAT8_E4M3) return ToDouble(t);
  const int64_t d = t.shape(2), heads = t.shape(1);
  std::vector<double> out(t.data().size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = E4m3Value(static_cast<uint8_t>(t.data()[i])) *
             scales[static_cast<size_t>((static_cast<int64_t>(i) / d) % heads)];
  }
  return out;
}

// The values an FP8 cache holds for a 16-bit tensor: each quantized with its head's scale.
std::vector<double> Quantized(const std::vector<double>& x, int64_t heads, int64_t d,
                              const std::vector<float>& scales) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double s = scales[static_cast<size_t>((static_cast<int64_t>(i) / d) % heads)];
    out[i] = E4m3Value(QuantizeE4m3(static_cast<double>(static_cast<float>(x[i]) / float(s)))) * s;
  }
  return out;
}

// A tensor of fresh random values [tokens, heads, d], sent as E4M3 codes of value / scales[head].
void FillRandomFp8(v1::Tensor* t, int64_t tokens, int heads, int d,
                   const std::vector<float>& scales, std::mt19937_64& rng) {
  t->set_dtype(v1::DTYPE_FLOAT8_E4M3);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::string codes(static_cast<size_t>(tokens * heads * d), '\0');
  for (size_t i = 0; i < codes.size(); ++i) {
    const double s = scales[(i / static_cast<size_t>(d)) % static_cast<size_t>(heads)];
    codes[i] = static_cast<char>(QuantizeE4m3(u(rng) / s));
  }
  t->set_data(codes);
}

void Context(grpc::ClientContext* ctx, const std::string& bearer) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!bearer.empty()) ctx->AddMetadata("authorization", "Bearer " + bearer);
}

}  // namespace

double E4m3Value(uint8_t code) {
  const int mag = code & 0x7F, e = mag >> 3, m = mag & 7;
  if (mag == 0x7F) return NAN;
  const double v = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

uint8_t QuantizeE4m3(double x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | 126;
  // Codes 0..126 are increasing in value: the two around a, the nearer (ties: the even code).
  uint8_t hi = 0;
  while (hi < 126 && E4m3Value(hi) < a) ++hi;
  if (hi == 0) return sign;
  const uint8_t lo = hi - 1;
  const double dlo = a - E4m3Value(lo), dhi = E4m3Value(hi) - a;
  const uint8_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | pick;
}

int64_t CountSaturations(const v1::Tensor& t, const std::vector<float>& scales) {
  const auto x = ToDouble(t);
  const int64_t d = t.shape(2), heads = t.shape(1);
  int64_t n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float s = scales[static_cast<size_t>((static_cast<int64_t>(i) / d) % heads)];
    n += std::fabs(static_cast<float>(x[i]) / s) > 448.0f;
  }
  return n;
}

v1::StepRequest RandomStep(const std::string& session_id, int layer, int n, const SessionSpec& s,
                           std::mt19937_64& rng) {
  v1::StepRequest r;
  r.set_session_id(session_id);
  r.set_layer(layer);
  FillRandom(r.mutable_q(), s.dtype, n, s.heads, s.head_dim, rng);
  if (s.fp8_cache && s.fp8_k_new) {
    FillRandomFp8(r.mutable_k_new(), n, s.kv_heads, s.head_dim, s.k_scales, rng);
    FillRandomFp8(r.mutable_v_new(), n, s.kv_heads, s.head_dim, s.v_scales, rng);
    r.mutable_k_new_scales()->Add(s.k_scales.begin(), s.k_scales.end());
    r.mutable_v_new_scales()->Add(s.v_scales.begin(), s.v_scales.end());
    return r;
  }
  FillRandom(r.mutable_k_new(), s.dtype, n, s.kv_heads, s.head_dim, rng);
  FillRandom(r.mutable_v_new(), s.dtype, n, s.kv_heads, s.head_dim, rng);
  return r;
}

int64_t SessionShadow::Tokens(int layer) const {
  return static_cast<int64_t>(k_[layer].size()) / (int64_t{spec_.kv_heads} * spec_.head_dim);
}

void SessionShadow::Append(const v1::StepRequest& step) {
  auto k = Values(step.k_new(), spec_.k_scales), v = Values(step.v_new(), spec_.v_scales);
  if (spec_.fp8_cache && step.k_new().dtype() != v1::DTYPE_FLOAT8_E4M3) {
    k = Quantized(k, spec_.kv_heads, spec_.head_dim, spec_.k_scales);
    v = Quantized(v, spec_.kv_heads, spec_.head_dim, spec_.v_scales);
  }
  k_[step.layer()].insert(k_[step.layer()].end(), k.begin(), k.end());
  v_[step.layer()].insert(v_[step.layer()].end(), v.begin(), v.end());
}

void SessionShadow::Truncate(int64_t tokens) {
  const int64_t row = int64_t{spec_.kv_heads} * spec_.head_dim;
  for (int l = 0; l < spec_.layers; ++l) {
    k_[l].resize(k_[l].size() - tokens * row);
    v_[l].resize(v_[l].size() - tokens * row);
  }
}

SessionShadow::Error SessionShadow::Check(const v1::StepRequest& step,
                                          const v1::StepResponse& response) const {
  Error e;
  const int layer = step.layer();
  const int32_t n = static_cast<int32_t>(step.q().shape(0));
  const int32_t cached = static_cast<int32_t>(Tokens(layer));
  kernels::AttentionArgs a;
  a.batch = 1;
  a.total_q = a.max_seqlen_q = n;
  a.total_k = a.max_seqlen_k = cached;
  a.num_heads = static_cast<int32_t>(step.q().shape(1));
  a.num_kv_heads = spec_.kv_heads;
  a.head_dim = spec_.head_dim;
  a.softmax_scale = step.softmax_scale();
  a.causal = true;
  if (step.has_window()) {
    a.window_left = step.window().left();
    a.window_right = step.window().right();
  }
  const auto ref = ReferenceAttention(a, ToDouble(step.q()), k_[layer], v_[layer], {0, n},
                                      {0, cached});
  HostTensor got;
  got.dtype = KernelDType(response.o().dtype());
  got.elements = static_cast<int64_t>(ref.o.size());
  got.bytes.assign(response.o().data().begin(), response.o().data().end());
  if (got.bytes.size() != ref.o.size() * kernels::DTypeSize(got.dtype)) {
    e.o = INFINITY;
    return e;
  }
  const ErrorStats o = CompareTo(ref.o, got);
  e.o = o.rel_l2;
  e.non_finite = o.non_finite;
  if (step.return_lse()) {
    std::vector<float> lse(response.lse().data().size() / 4);
    std::memcpy(lse.data(), response.lse().data().data(), lse.size() * 4);
    if (lse.size() != ref.lse.size()) {
      e.lse = INFINITY;
    } else {
      const ErrorStats l = CompareLse(ref.lse, lse);
      e.lse = l.max_abs;
      e.non_finite += l.non_finite;
    }
  }
  return e;
}

double StepTolerance(v1::DType dtype) {
  return dtype == v1::DTYPE_FLOAT16 ? 2e-3 : 1e-2;
}

grpc::Status CreateSession(v1::Attention::Stub* stub, const SessionSpec& spec,
                           v1::CreateSessionResponse* response, int64_t max_tokens,
                           const std::string& bearer) {
  grpc::ClientContext ctx;
  Context(&ctx, bearer);
  v1::CreateSessionRequest r;
  r.set_num_layers(spec.layers);
  r.set_num_kv_heads(spec.kv_heads);
  r.set_head_dim(spec.head_dim);
  r.set_dtype(spec.dtype);
  r.set_max_tokens(max_tokens);
  if (spec.fp8_cache) {
    r.set_cache_dtype(v1::DTYPE_FLOAT8_E4M3);
    r.mutable_k_scales()->Add(spec.k_scales.begin(), spec.k_scales.end());
    r.mutable_v_scales()->Add(spec.v_scales.begin(), spec.v_scales.end());
  }
  return stub->CreateSession(&ctx, r, response);
}

grpc::Status Step(v1::Attention::Stub* stub, const v1::StepRequest& request,
                  v1::StepResponse* response, const std::string& bearer) {
  grpc::ClientContext ctx;
  Context(&ctx, bearer);
  return stub->Step(&ctx, request, response);
}

grpc::Status CloseSession(v1::Attention::Stub* stub, const std::string& id,
                          v1::CloseSessionResponse* response, const std::string& bearer) {
  grpc::ClientContext ctx;
  Context(&ctx, bearer);
  v1::CloseSessionRequest r;
  r.set_session_id(id);
  v1::CloseSessionResponse local;
  return stub->CloseSession(&ctx, r, response ? response : &local);
}

grpc::Status GetKvCache(v1::Attention::Stub* stub, v1::KvCacheInfo* info) {
  grpc::ClientContext ctx;
  Context(&ctx, "");
  v1::GetServerInfoResponse r;
  grpc::Status st = stub->GetServerInfo(&ctx, {}, &r);
  *info = r.kv_cache();
  return st;
}

}  // namespace attn::testing

namespace attn::testing {
namespace {

// Random step options: LSE, a custom scale, a window.
void RandomOptions(v1::StepRequest& r, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 9);
  r.set_return_lse(pick(rng) < 5);
  if (pick(rng) < 2) r.set_softmax_scale(0.05f + 0.1f * pick(rng));
  if (pick(rng) < 2) {
    r.mutable_window()->set_left(pick(rng) < 5 ? -1 : 3 * pick(rng));
    r.mutable_window()->set_right(pick(rng) < 5 ? -1 : pick(rng));
  }
}

class Workload {
 public:
  Workload(v1::Attention::Stub* stub, const WorkloadOptions& o, std::mt19937_64& rng)
      : stub_(stub), o_(o), rng_(rng) {}

  void Create(const SessionSpec& spec) {
    v1::CreateSessionResponse r;
    const grpc::Status st = CreateSession(stub_, spec, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    live_.emplace(r.session_id(), SessionShadow(spec));
  }
  void Expect(const SessionShadow& shadow, const v1::StepRequest& step,
              const v1::StepResponse& response) {
    EXPECT_EQ(response.cached_tokens(), shadow.Tokens(step.layer()));
    const auto e = shadow.Check(step, response);
    EXPECT_EQ(e.non_finite, 0);
    const double tol = shadow.spec().dtype == v1::DTYPE_FLOAT16 ? o_.o_tolerance_fp16
                                                                 : o_.o_tolerance_bf16;
    EXPECT_LE(e.o, tol) << "layer " << step.layer() << ", " << step.q().shape(0)
                        << " new tokens over a cache of " << shadow.Tokens(step.layer());
    EXPECT_LE(e.lse, o_.lse_tolerance);
  }
  std::pair<const std::string, SessionShadow>& Any() {
    auto it = live_.begin();
    std::advance(it, Uniform(0, static_cast<int>(live_.size()) - 1));
    return *it;
  }
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  int Chunk() { return o_.chunks[Uniform(0, static_cast<int>(o_.chunks.size()) - 1)]; }

  void StepOne() {
    auto& [id, shadow] = Any();
    v1::StepRequest step =
        RandomStep(id, Uniform(0, shadow.spec().layers - 1), Chunk(), shadow.spec(), rng_);
    RandomOptions(step, rng_);
    v1::StepResponse response;
    const grpc::Status st = Step(stub_, step, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    shadow.Append(step);
    Expect(shadow, step, response);
    ++steps_;
  }
  void BatchStepSome() {
    v1::BatchStepRequest req;
    std::vector<SessionShadow*> owners;
    const int items = Uniform(2, 7);
    const int n = Uniform(0, 1) ? 1 : Chunk();
    for (int j = 0; j < items; ++j) {
      auto& [sid, sh] = Any();
      *req.add_steps() = RandomStep(sid, Uniform(0, sh.spec().layers - 1), n, sh.spec(), rng_);
      RandomOptions(*req.mutable_steps(j), rng_);
      owners.push_back(&sh);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::BatchStepResponse resp;
    const grpc::Status st = stub_->BatchStep(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.results_size(), items);
    for (int j = 0; j < items; ++j) {  // items of one (session, layer) apply in order
      ASSERT_EQ(resp.results(j).status_code(), 0) << resp.results(j).status_message();
      owners[j]->Append(req.steps(j));
      Expect(*owners[j], req.steps(j), resp.results(j).response());
    }
    items_ += items;
  }
  void TruncateOne() {
    auto& [id, shadow] = Any();
    int64_t least = INT64_MAX;
    for (int l = 0; l < shadow.spec().layers; ++l) least = std::min(least, shadow.Tokens(l));
    const int64_t drop = Uniform(0, static_cast<int>(least));
    grpc::ClientContext ctx;
    v1::TruncateSessionRequest req;
    req.set_session_id(id);
    req.set_tokens(drop);
    v1::TruncateSessionResponse r;
    ASSERT_TRUE(stub_->TruncateSession(&ctx, req, &r).ok());
    shadow.Truncate(drop);
    for (int l = 0; l < shadow.spec().layers; ++l) EXPECT_EQ(r.cached_tokens(l), shadow.Tokens(l));
    ++truncates_;
  }
  void ForkOne() {
    auto& [id, shadow] = Any();
    grpc::ClientContext ctx;
    v1::ForkSessionRequest req;
    req.set_session_id(id);
    v1::ForkSessionResponse r;
    ASSERT_TRUE(stub_->ForkSession(&ctx, req, &r).ok());
    EXPECT_EQ(r.session_id().rfind(r.replica_id() + ".", 0), 0u) << r.session_id();
    SessionShadow copy = shadow;
    live_.emplace(r.session_id(), std::move(copy));
    ++forks_;
  }
  void CloseAndReplaceOne() {
    auto& [id, shadow] = Any();
    const SessionSpec spec = shadow.spec();
    ASSERT_TRUE(CloseSession(stub_, id).ok());
    live_.erase(id);
    Create(spec);
    ++closes_;
  }
  void CloseAll() {
    for (const auto& [id, shadow] : live_) EXPECT_TRUE(CloseSession(stub_, id).ok());
    live_.clear();
  }
  size_t Live() const { return live_.size(); }
  std::string Summary() const {
    return std::to_string(steps_) + " steps, " + std::to_string(items_) + " BatchStep items, " +
           std::to_string(truncates_) + " truncates, " + std::to_string(forks_) + " forks, " +
           std::to_string(closes_) + " closes";
  }

 private:
  v1::Attention::Stub* stub_;
  const WorkloadOptions& o_;
  std::mt19937_64& rng_;
  std::map<std::string, SessionShadow> live_;
  int steps_ = 0, items_ = 0, truncates_ = 0, forks_ = 0, closes_ = 0;
};

}  // namespace

std::string RunRandomSessionWorkload(v1::Attention::Stub* stub,
                                     const std::vector<SessionSpec>& specs,
                                     const WorkloadOptions& options, std::mt19937_64& rng) {
  Workload w(stub, options, rng);
  for (const auto& s : specs) w.Create(s);
  for (int i = 0; i < options.ops && !::testing::Test::HasFatalFailure(); ++i) {
    const int op = w.Uniform(0, 99);
    if (op < 55) {
      w.StepOne();
    } else if (op < 70) {
      w.BatchStepSome();
    } else if (op < 80) {
      w.TruncateOne();
    } else if (op < 90 && w.Live() < 8) {
      w.ForkOne();
    } else if (w.Live() > 1) {
      w.CloseAndReplaceOne();
    }
  }
  w.CloseAll();
  return w.Summary();
}

}  // namespace attn::testing
