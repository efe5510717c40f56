// What the kernel-variant tools (sm90_variants, fp8_variants) share: the CUDA error check, one
// launch's device time, and the alternating timing of a variant against the shipped kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    const cudaError_t err_ = (x);                                                        \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

namespace attn::bench {

// Device time of one call of fn (ms).
template <typename Fn>
float OneLaunchMs(cudaEvent_t a, cudaEvent_t b, Fn&& fn) {
  CHECK_CUDA(cudaEventRecord(a));
  CHECK_CUDA(fn());
  CHECK_CUDA(cudaEventRecord(b));
  CHECK_CUDA(cudaEventSynchronize(b));
  float t = 0;
  CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
  return t;
}

struct Samples {
  std::vector<double> v;
  void Add(double x) { v.push_back(x); }
  double Pct(double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(q * v.size()))];
  }
};

// The shipped kernel's and a variant's launch times (ms) and their ratio (shipped / variant), per
// round. The board's clock follows its power draw with a lag of tenths of a second, so blocks of
// one kernel's launches timed one after the other run at different clocks (a cool first block
// measured up to 12% faster): both first run alternately for warm_ms, then each of 2 * reps rounds
// times one launch of each, the order alternating.
struct AlternatingTimes {
  Samples shipped, variant, ratio;
};
template <typename Shipped, typename Variant>
AlternatingTimes TimeAlternating(Shipped&& shipped, Variant&& variant, int reps, int warm_ms) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  const auto warm_start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - warm_start < std::chrono::milliseconds(warm_ms)) {
    OneLaunchMs(a, b, shipped);
    OneLaunchMs(a, b, variant);
  }
  AlternatingTimes t;
  for (int r = 0; r < 2 * reps; ++r) {
    double ts, tv;
    if (r % 2 == 0) {
      ts = OneLaunchMs(a, b, shipped);
      tv = OneLaunchMs(a, b, variant);
    } else {
      tv = OneLaunchMs(a, b, variant);
      ts = OneLaunchMs(a, b, shipped);
    }
    t.shipped.Add(ts);
    t.variant.Add(tv);
    t.ratio.Add(ts / tv);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return t;
}

// The current device's multiprocessors; exits (1) where it is not an sm_90 GPU.
inline int Sm90MultiprocessorsOrExit(const char* tool) {
  int dev = 0, major = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (major != 9) {
    std::fprintf(stderr, "%s: needs an sm_90 GPU\n", tool);
    std::exit(1);
  }
  return sms;
}

inline float FromBf16(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace attn::bench
