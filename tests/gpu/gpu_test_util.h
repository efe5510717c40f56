// What the GPU suites share: whether a CUDA device is there (and why not), a skip that says why
// (scripts/test.sh counts skips by that reason), a device buffer that frees itself, the head
// dims this build compiled, and the CPU backend's answer to compare with.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/cuda_attention.h"
#include "common/reference.h"

namespace attn::testing {

inline bool HaveGpu(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    *why = std::string("no CUDA device: cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    return false;
  }
  if (n == 0) {
    *why = "no CUDA device: cudaGetDeviceCount returned 0";
    return false;
  }
  return true;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes == 0 ? 1 : bytes) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// True when the current device has compute capability 9.0 (H100, H200).
inline bool IsHopper() {
  int dev = 0;
  cudaDeviceProp prop;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return false;
  return prop.major == 9 && prop.minor == 0;
}

inline bool HeadDimCompiled(int d) {
  int n = 0;
  const int* dims = kernels::cuda::CompiledHeadDims(&n);
  return std::find(dims, dims + n, d) != dims + n;
}

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

#define SKIP_WITHOUT_GPU()                                    \
  do {                                                        \
    std::string why;                                          \
    if (!::attn::testing::HaveGpu(&why)) GTEST_SKIP() << why; \
  } while (0)
