// What the GPU suites share: whether a CUDA device is there (and why not), a skip that says why
// (scripts/test.sh counts skips by that reason), a device buffer that frees itself, and the head
// dims this build compiled.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <string>

#include "attn/kernels/cuda_attention.h"

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

}  // namespace attn::testing

#define SKIP_WITHOUT_GPU()                                    \
  do {                                                        \
    std::string why;                                          \
    if (!::attn::testing::HaveGpu(&why)) GTEST_SKIP() << why; \
  } while (0)
