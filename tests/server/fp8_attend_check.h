// One FP8 Attend through a real attnd, checked against the float64 reference on exactly the
// values its e4m3 codes and descales stand for: K/V in e4m3 with q of any type, or all three in
// e4m3 (then o in fp16 or bf16, the caller's choice). Shared by the CPU (attnd_e2e_test) and CUDA
// (cuda_server_test) suites.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "attn/client/client.h"
#include "attn/kernels/attention.h"

namespace attn::testing {

// x [rows, heads, d] as e4m3 codes with descales per (sequence, head), or one per tensor.
struct Fp8Tensor {
  client::Tensor codes;
  std::vector<float> descale;
  std::vector<double> values;  // what each code stands for (code value * descale)
};
Fp8Tensor QuantizeFp8(const std::vector<double>& x, const std::vector<int32_t>& cu, int heads,
                      int d, bool per_head);

struct Fp8AttendCase {
  std::vector<int32_t> cu_q, cu_k;
  int heads = 8, kv_heads = 2, head_dim = 64;
  bool causal = false;
  bool per_head = false;  // descales per (sequence, KV head); else one per tensor
  client::DType q_type = client::DType::kFloat8E4M3;
};

// A request of fresh random normal values: q in q_type (e4m3: descales per (sequence, KV head),
// o then fp16 with per-head descales, bf16 with per-tensor ones), k and v in e4m3.
struct Fp8Attend {
  client::Tensor q;
  Fp8Tensor k, v;
  client::AttendOptions options;
  client::DType out_type = client::DType::kFloat32;
  std::vector<double> q_values;
  kernels::AttentionArgs shape;
};
Fp8Attend MakeFp8Attend(const Fp8AttendCase& c, std::mt19937_64& rng);

// The relative RMS error of o against the float64 reference of the request (infinity where o
// holds a value that is not finite, or has the wrong type or shape).
double Fp8AttendError(const Fp8Attend& a, const client::Tensor& o);

}  // namespace attn::testing
