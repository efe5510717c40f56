#include "session_demo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attn::client {
namespace {

// What the client knows a session's cache holds: per layer, the keys and values it sent (as the
// dtype rounded them), [tokens, kv_heads, head_dim] each.
struct Mirror {
  std::vector<std::vector<float>> k, v;
  int64_t Tokens(int layer, int row) const { return static_cast<int64_t>(k[layer].size()) / row; }
};

struct Reference {
  std::vector<double> o;    // [n, heads, d]
  std::vector<double> lse;  // [heads, n]
};

Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return Tensor::FromFloats(dtype, std::move(shape), v);
}

// Attention of n new queries over a layer's whole cache (the new tokens already in it), causal
// aligned bottom-right, with the demo's window, in float64.
Reference Attend(const std::vector<float>& q, int n, const std::vector<float>& k, const std::vector<float>& v,
                 const SessionDemoOptions& o) {
  const int d = o.head_dim, group = o.heads / o.kv_heads;
  const int64_t total = static_cast<int64_t>(k.size()) / (int64_t(o.kv_heads) * d);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Reference r{std::vector<double>(size_t(n) * o.heads * d, 0.0), std::vector<double>(size_t(o.heads) * n)};
  std::vector<double> s(static_cast<size_t>(total));
  for (int i = 0; i < n; ++i) {
    const int64_t pos = total - n + i;  // this query's own position in the cache
    const int64_t lo = o.window_left >= 0 ? std::max<int64_t>(0, pos - o.window_left) : 0;
    for (int h = 0; h < o.heads; ++h) {
      const int kvh = h / group;
      const float* qi = &q[(size_t(i) * o.heads + h) * d];
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = lo; j <= pos; ++j) {
        const float* kj = &k[(size_t(j) * o.kv_heads + kvh) * d];
        double dot = 0;
        for (int x = 0; x < d; ++x) dot += double(qi[x]) * kj[x];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double sum = 0;
      double* oi = &r.o[(size_t(i) * o.heads + h) * d];
      for (int64_t j = lo; j <= pos; ++j) {
        const double p = std::exp(s[j] - m);
        sum += p;
        const float* vj = &v[(size_t(j) * o.kv_heads + kvh) * d];
        for (int x = 0; x < d; ++x) oi[x] += p * vj[x];
      }
      for (int x = 0; x < d; ++x) oi[x] /= sum;
      r.lse[size_t(h) * n + i] = m + std::log(sum);
    }
  }
  return r;
}

// Relative L2 error of got against want (+inf for a size mismatch or a non-finite value).
double RelativeError(const std::vector<double>& want, const std::vector<float>& got) {
  if (want.size() != got.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The o tolerance: the output's own rounding dominates (bf16 keeps 8 bits, fp16 11).
double Tolerance(DType t) { return t == DType::kFloat16 ? 3e-3 : 1.5e-2; }
// The lse is float32 on the wire whatever the dtype.
constexpr double kLseTolerance = 1e-4;

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "fp8";
  }
  return "?";
}

class Demo {
 public:
  Demo(SessionClient& sessions, const SessionDemoOptions& o) : sessions_(sessions), o_(o), rng_(o.seed) {}

  int Run();

 private:
  // One Step of n new tokens on a layer; checked when asked. False when the call failed.
  bool DoStep(const char* op, const std::string& who, const SessionInfo& s, Mirror& m, int layer, int n);
  bool Fail(const std::string& what, const absl::Status& st) {
    std::cerr << "attnctl: " << what << ": " << absl::StatusCodeToString(st.code()) << ": " << st.message()
              << std::endl;
    return false;
  }
  void Mismatch(const std::string& what) {
    std::printf("MISMATCH: %s\n", what.c_str());
    wrong_ = true;
  }
  int Row() const { return o_.kv_heads * o_.head_dim; }
  bool Prefill(const SessionInfo& s, Mirror& m);
  bool Decode(const char* op, const std::string& who, const SessionInfo& s, Mirror& m, int tokens);
  bool Truncate(const SessionInfo& s, Mirror& m);
  bool CloseAndCheckGone(const std::string& who, const SessionInfo& s);

  SessionClient& sessions_;
  const SessionDemoOptions o_;
  std::mt19937_64 rng_;
  int checked_ = 0;
  double worst_ = 0, worst_lse_ = 0;
  bool wrong_ = false;
};

bool Demo::DoStep(const char* op, const std::string& who, const SessionInfo& s, Mirror& m, int layer, int n) {
  StepInput in;
  in.session_id = s.session_id;
  in.layer = layer;
  in.q = RandomTensor(o_.dtype, {n, o_.heads, o_.head_dim}, rng_);
  in.k_new = RandomTensor(o_.dtype, {n, o_.kv_heads, o_.head_dim}, rng_);
  in.v_new = RandomTensor(o_.dtype, {n, o_.kv_heads, o_.head_dim}, rng_);
  in.options.return_lse = o_.lse;
  in.options.window_left = o_.window_left;
  const auto start = std::chrono::steady_clock::now();
  auto r = sessions_.Step(in, o_.timeout);
  const double client_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  if (!r.ok()) return Fail(absl::StrCat(op, " ", who, " layer ", layer), r.status());
  // The cache as the server now holds it: what it held, and this step's tokens.
  std::vector<float> kf = in.k_new.ToFloats(), vf = in.v_new.ToFloats();
  if (o_.kv_fp8) {  // as the FP8 cache holds them: E4M3(x / scale) * scale
    for (std::vector<float>* x : {&kf, &vf}) {
      std::vector<float> scaled(x->size());
      for (size_t i = 0; i < x->size(); ++i) scaled[i] = (*x)[i] / kFp8DemoScale;
      const std::vector<float> q =
          Tensor::FromFloats(DType::kFloat8E4M3, {int64_t(x->size())}, scaled).ToFloats();
      for (size_t i = 0; i < x->size(); ++i) (*x)[i] = q[i] * kFp8DemoScale;
    }
  }
  m.k[layer].insert(m.k[layer].end(), kf.begin(), kf.end());
  m.v[layer].insert(m.v[layer].end(), vf.begin(), vf.end());
  const auto& t = r->timing;
  std::printf("%-9s %-7s %5d %5d %7lld %10.1f %10.1f %9.1f %10.1f", op, who.c_str(), layer, n,
              static_cast<long long>(r->cached_tokens), client_us, t.total_us(), t.queue_us(), t.compute_us());
  if (o_.check) {
    const Reference ref = Attend(in.q.ToFloats(), n, m.k[layer], m.v[layer], o_);
    const double err = RelativeError(ref.o, r->o.ToFloats());
    worst_ = std::max(worst_, err);
    std::printf(" %9.2e", err);
    if (o_.lse) {
      double lse_err = r->lse ? RelativeError(ref.lse, r->lse->ToFloats()) : std::numeric_limits<double>::infinity();
      worst_lse_ = std::max(worst_lse_, lse_err);
      std::printf(" %9.2e", lse_err);
    }
    ++checked_;
  }
  std::printf("\n");
  if (o_.check) {
    if (r->cached_tokens != m.Tokens(layer, Row())) {
      Mismatch(absl::StrCat("the server reports ", r->cached_tokens, " cached tokens, the client sent ",
                            m.Tokens(layer, Row())));
    }
    if (r->o.shape != std::vector<int64_t>{n, o_.heads, o_.head_dim} || r->o.dtype != o_.dtype) {
      Mismatch("o has another shape or dtype than q");
    }
  }
  return true;
}

bool Demo::Prefill(const SessionInfo& s, Mirror& m) {
  const int chunk = o_.chunk > 0 ? o_.chunk : std::max(o_.prefill, 1);
  for (int layer = 0; layer < o_.layers; ++layer) {
    for (int done = 0; done < o_.prefill; done += chunk) {
      if (!DoStep("prefill", "parent", s, m, layer, std::min(chunk, o_.prefill - done))) return false;
    }
  }
  return true;
}

bool Demo::Decode(const char* op, const std::string& who, const SessionInfo& s, Mirror& m, int tokens) {
  for (int t = 0; t < tokens; ++t) {
    for (int layer = 0; layer < o_.layers; ++layer) {
      if (!DoStep(op, who, s, m, layer, 1)) return false;
    }
  }
  return true;
}

bool Demo::Truncate(const SessionInfo& s, Mirror& m) {
  auto r = sessions_.TruncateSession(s.session_id, o_.truncate, o_.timeout);
  if (!r.ok()) return Fail(absl::StrCat("truncate ", o_.truncate, " tokens"), r.status());
  std::vector<int64_t> want;
  for (int layer = 0; layer < o_.layers; ++layer) {
    m.k[layer].resize(m.k[layer].size() - size_t(o_.truncate) * Row());
    m.v[layer].resize(m.v[layer].size() - size_t(o_.truncate) * Row());
    want.push_back(m.Tokens(layer, Row()));
  }
  std::printf("%-9s %-7s     - %5d %7s   freed %lld pages\n", "truncate", "parent", -o_.truncate,
              absl::StrJoin(r->cached_tokens, ",").c_str(), static_cast<long long>(r->freed_pages));
  if (o_.check && r->cached_tokens != want) {
    Mismatch(absl::StrCat("after truncate the server holds ", absl::StrJoin(r->cached_tokens, ","),
                          " tokens per layer, expected ", absl::StrJoin(want, ",")));
  }
  return true;
}

bool Demo::CloseAndCheckGone(const std::string& who, const SessionInfo& s) {
  auto freed = sessions_.CloseSession(s.session_id, o_.timeout);
  if (!freed.ok()) return Fail("close " + who, freed.status());
  std::printf("%-9s %-7s   freed %lld pages\n", "close", who.c_str(), static_cast<long long>(*freed));
  if (!o_.check) return true;
  // The contract: a closed session is NOT_FOUND, and saying so.
  StepInput in;
  in.session_id = s.session_id;
  in.q = RandomTensor(o_.dtype, {1, o_.heads, o_.head_dim}, rng_);
  in.k_new = RandomTensor(o_.dtype, {1, o_.kv_heads, o_.head_dim}, rng_);
  in.v_new = RandomTensor(o_.dtype, {1, o_.kv_heads, o_.head_dim}, rng_);
  auto after = sessions_.Step(in, o_.timeout);
  if (after.ok() || after.status().code() != absl::StatusCode::kNotFound) {
    Mismatch(absl::StrCat("a step on the closed ", who, " session got ",
                          after.ok() ? "OK" : absl::StatusCodeToString(after.status().code()),
                          ", expected NOT_FOUND"));
  } else {
    std::printf("%-9s %-7s   step after close: NOT_FOUND (%s)\n", "closed", who.c_str(),
                std::string(after.status().message()).c_str());
  }
  return true;
}

int Demo::Run() {
  SessionSpec spec;
  spec.num_layers = o_.layers;
  spec.num_kv_heads = o_.kv_heads;
  spec.head_dim = o_.head_dim;
  spec.dtype = o_.dtype;
  if (o_.kv_fp8) {
    spec.cache_dtype = DType::kFloat8E4M3;
    spec.k_scales.assign(static_cast<size_t>(o_.kv_heads), kFp8DemoScale);
    spec.v_scales = spec.k_scales;
  }
  auto created = sessions_.CreateSession(spec, o_.timeout);
  if (!created.ok()) {
    Fail("CreateSession", created.status());
    return 2;
  }
  const SessionInfo parent = *created;
  std::printf("session %s on replica %s (%s): %d layers, %d KV heads x %d, %s%s; pages of %d tokens, "
              "TTL %lld s, at most %lld tokens\n",
              parent.session_id.c_str(), parent.replica_id.c_str(), parent.endpoint.c_str(), o_.layers,
              o_.kv_heads, o_.head_dim, DTypeName(o_.dtype),
              parent.cache_dtype == DType::kFloat8E4M3 ? " with an FP8 E4M3 cache" : "", parent.page_tokens,
              static_cast<long long>(parent.ttl_seconds), static_cast<long long>(parent.max_tokens));
  std::printf("%-9s %-7s %5s %5s %7s %10s %10s %9s %10s%s%s\n", "op", "session", "layer", "new", "cached",
              "client_us", "server_us", "queue_us", "compute_us", o_.check ? "   rel_err" : "",
              o_.check && o_.lse ? "   lse_err" : "");
  Mirror m{std::vector<std::vector<float>>(o_.layers), std::vector<std::vector<float>>(o_.layers)};
  auto closing = [&](bool ok) {
    if (!ok) (void)sessions_.CloseSession(parent.session_id, o_.timeout);  // best effort
    return ok;
  };
  if (!closing(Prefill(parent, m) && Decode("decode", "parent", parent, m, o_.decode))) return 2;
  if (o_.truncate > 0 && !closing(Truncate(parent, m))) return 2;
  if (o_.fork_decode > 0) {
    auto forked = sessions_.ForkSession(parent.session_id, o_.timeout);
    if (!closing(forked.ok() || Fail("fork", forked.status()))) return 2;
    std::printf("%-9s %-7s   %s on replica %s\n", "fork", "child", forked->session_id.c_str(),
                forked->replica_id.c_str());
    if (o_.check && forked->replica_id != parent.replica_id) {
      Mismatch("the fork is on replica " + forked->replica_id + ", the parent on " + parent.replica_id);
    }
    // Both append after the shared prefix: each must see only its own new tokens.
    Mirror child = m;
    const bool ok = Decode("decode", "child", *forked, child, o_.fork_decode) &&
                    Decode("decode", "parent", parent, m, o_.fork_decode) &&
                    CloseAndCheckGone("child", *forked);
    if (!ok) {
      (void)sessions_.CloseSession(forked->session_id, o_.timeout);
      closing(false);
      return 2;
    }
  }
  if (!CloseAndCheckGone("parent", parent)) return 2;
  if (!o_.check) return 0;
  const double tol = Tolerance(o_.dtype);
  const bool pass = !wrong_ && worst_ <= tol && (!o_.lse || worst_lse_ <= kLseTolerance);
  std::printf("%s: %d steps checked against a float64 reference over the cache: max relative error of o "
              "%.2e (tolerance %.1e, %s)",
              pass ? "PASS" : "FAIL", checked_, worst_, tol, DTypeName(o_.dtype));
  if (o_.lse) std::printf(", of lse %.2e (tolerance %.1e)", worst_lse_, kLseTolerance);
  std::printf("%s\n", wrong_ ? "; see MISMATCH above" : "");
  return pass ? 0 : 3;
}

}  // namespace

int RunSessionDemo(SessionClient& sessions, const SessionDemoOptions& options) {
  return Demo(sessions, options).Run();
}

}  // namespace attn::client
