// Helpers for session tests: random steps, and a shadow of each session's cache (the keys and
// values it must hold, as float64) that checks every Step answer against the float64 reference
// over the concatenated cache, computed independently of the server.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "attn/v1/attention.grpc.pb.h"
#include "common/reference.h"

namespace attn::testing {

struct SessionSpec {
  int layers = 2;
  int heads = 4;
  int kv_heads = 2;
  int head_dim = 64;
  v1::DType dtype = v1::DTYPE_BFLOAT16;
  // An FP8 cache (cache_dtype DTYPE_FLOAT8_E4M3) with these per-KV-head scales; fp8_k_new: steps
  // send k_new/v_new as E4M3 codes (quantized by the test) instead of in dtype.
  bool fp8_cache = false;
  std::vector<float> k_scales, v_scales;
  bool fp8_k_new = false;
};

// Test-side OCP E4M3FN quantization (from the format's definition, independent of the server's
// conversions): the code nearest to x (ties to the even code), saturating to +-448; NaN to 0x7F.
uint8_t QuantizeE4m3(double x);
double E4m3Value(uint8_t code);
// Elements of a 16-bit tensor [tokens, heads, d] whose value / scales[head] is beyond +-448.
int64_t CountSaturations(const v1::Tensor& t, const std::vector<float>& scales);

// A StepRequest with fresh random q, k_new, v_new of n new tokens.
v1::StepRequest RandomStep(const std::string& session_id, int layer, int n, const SessionSpec& s,
                           std::mt19937_64& rng);

// What one session must hold, per layer.
class SessionShadow {
 public:
  explicit SessionShadow(SessionSpec spec) : spec_(spec), k_(spec.layers), v_(spec.layers) {}
  const SessionSpec& spec() const { return spec_; }
  int64_t Tokens(int layer) const;
  // Appends the step's k_new and v_new to its layer (the step succeeded).
  void Append(const v1::StepRequest& step);
  void Truncate(int64_t tokens);
  // Relative L2 error of the step's o against the reference over this shadow (call after
  // Append), and the largest LSE error when lse is in the response (else 0).
  struct Error {
    double o = 0;
    double lse = 0;
    int64_t non_finite = 0;
  };
  Error Check(const v1::StepRequest& step, const v1::StepResponse& response) const;

 private:
  SessionSpec spec_;
  std::vector<std::vector<double>> k_, v_;  // per layer, [tokens, kv_heads, head_dim]
};

// Output tolerance (relative L2) of a session step in dtype on the CPU backend.
double StepTolerance(v1::DType dtype);

// Unary session calls on a stub, returning the status (and filling the response).
grpc::Status CreateSession(v1::Attention::Stub* stub, const SessionSpec& spec,
                           v1::CreateSessionResponse* response, int64_t max_tokens = 0,
                           const std::string& bearer = "");
grpc::Status Step(v1::Attention::Stub* stub, const v1::StepRequest& request,
                  v1::StepResponse* response, const std::string& bearer = "");
grpc::Status CloseSession(v1::Attention::Stub* stub, const std::string& id,
                          v1::CloseSessionResponse* response = nullptr,
                          const std::string& bearer = "");
grpc::Status GetKvCache(v1::Attention::Stub* stub, v1::KvCacheInfo* info);

}  // namespace attn::testing

namespace attn::testing {

// Random interleavings of Steps (decode and chunks, with LSE, scales and windows), BatchSteps
// (repeats of one (session, layer) included), truncates, forks and closes over sessions of the
// given specs, each answer checked against its shadow with gtest expectations; closes every
// session at the end. Returns a one-line summary of what it did.
struct WorkloadOptions {
  int ops = 200;
  double o_tolerance_bf16 = 1e-2;
  double o_tolerance_fp16 = 2e-3;
  double lse_tolerance = 2e-5;
  std::vector<int> chunks = {1, 1, 1, 1, 2, 3, 7, 8, 9, 16, 17, 33};
};
std::string RunRandomSessionWorkload(v1::Attention::Stub* stub,
                                     const std::vector<SessionSpec>& specs,
                                     const WorkloadOptions& options, std::mt19937_64& rng);

}  // namespace attn::testing
