// The CPU backend's answer to a problem the GPU suites run, and the distance between two outputs:
// a second opinion beside the float64 reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attn/kernels/attention.h"
#include "attn/kernels/cpu_attention.h"
#include "common/reference.h"

namespace attn::testing {

// The same problem on the CPU backend over contiguous host K/V (of a.kv_dtype; FP8 with host
// scales), for a second opinion.
inline HostTensor RunOnCpu(kernels::AttentionArgs a, const HostTensor& q, const void* k, const void* v,
                           const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                           const float* k_scales = nullptr, const float* v_scales = nullptr) {
  HostTensor o = HostTensor::Filled(a.dtype, q.elements, std::numeric_limits<float>::quiet_NaN());
  a.q = q.data();
  a.k = k;
  a.v = v;
  a.kv_scales = {k_scales, v_scales};
  a.o = o.data();
  a.lse = nullptr;
  a.cu_seqlens_q = cu_q.data();
  a.cu_seqlens_k = cu_k.data();
  a.total_k = cu_k.back();
  a.paged = {};
  static auto pool = kernels::cpu::CpuThreadPool::Create(0);
  std::vector<char> ws(kernels::cpu::WorkspaceBytes(a, pool->NumWorkers()) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
  const kernels::Status st = kernels::cpu::Run(a, aligned, pool.get());
  EXPECT_TRUE(st.ok()) << st.message();
  return o;
}

// Relative L2 distance between two outputs of the same dtype (+inf where either is not finite).
inline double Distance(const HostTensor& x, const HostTensor& y) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.elements; ++i) {
    const double a = x.At(i), b = y.At(i);
    if (!std::isfinite(a) || !std::isfinite(b)) return INFINITY;
    num += (a - b) * (a - b);
    den += b * b;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace attn::testing
