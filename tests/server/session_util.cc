#include "session_util.h"

#include <grpcpp/client_context.h>

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

void Context(grpc::ClientContext* ctx, const std::string& bearer) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!bearer.empty()) ctx->AddMetadata("authorization", "Bearer " + bearer);
}

}  // namespace

v1::StepRequest RandomStep(const std::string& session_id, int layer, int n, const SessionSpec& s,
                           std::mt19937_64& rng) {
  v1::StepRequest r;
  r.set_session_id(session_id);
  r.set_layer(layer);
  FillRandom(r.mutable_q(), s.dtype, n, s.heads, s.head_dim, rng);
  FillRandom(r.mutable_k_new(), s.dtype, n, s.kv_heads, s.head_dim, rng);
  FillRandom(r.mutable_v_new(), s.dtype, n, s.kv_heads, s.head_dim, rng);
  return r;
}

int64_t SessionShadow::Tokens(int layer) const {
  return static_cast<int64_t>(k_[layer].size()) / (int64_t{spec_.kv_heads} * spec_.head_dim);
}

void SessionShadow::Append(const v1::StepRequest& step) {
  const auto k = ToDouble(step.k_new()), v = ToDouble(step.v_new());
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
