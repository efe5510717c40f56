// Exp2OnFma (kernels/src/cuda/exp2_on_fma.cuh), the exp2 the sm_90a softmax computes on the FMA
// pipe, against std::exp2 in double over the range a softmax feeds it (x <= 8), on the device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "exp2_on_fma.cuh"
#include "gpu_test_util.h"

namespace {

__global__ void Exp2OnFmaKernel(const float* x, float* exact_zero, float* clamped, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  exact_zero[i] = attn::kernels::cuda::Exp2OnFma<true>(x[i]);
  clamped[i] = attn::kernels::cuda::Exp2OnFma<false>(x[i]);
}

struct Results {
  std::vector<float> exact_zero, clamped;
};

Results RunOnDevice(const std::vector<float>& x) {
  const int n = static_cast<int>(x.size());
  attn::testing::DeviceBuffer dx(n * sizeof(float)), dz(n * sizeof(float)), dc(n * sizeof(float));
  EXPECT_TRUE(dx.ptr && dz.ptr && dc.ptr);
  EXPECT_EQ(cudaMemcpy(dx.ptr, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(dz.ptr, 0xff, n * sizeof(float)), cudaSuccess);  // NaN poison
  EXPECT_EQ(cudaMemset(dc.ptr, 0xff, n * sizeof(float)), cudaSuccess);
  Exp2OnFmaKernel<<<(n + 255) / 256, 256>>>(static_cast<const float*>(dx.ptr), static_cast<float*>(dz.ptr),
                                            static_cast<float*>(dc.ptr), n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Results r{std::vector<float>(n), std::vector<float>(n)};
  EXPECT_EQ(cudaMemcpy(r.exact_zero.data(), dz.ptr, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(r.clamped.data(), dc.ptr, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return r;
}

class Exp2OnFmaTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

// Every float step of 2^-12 in [-125, 8] (and the integers, where the rounding to j changes):
// within the cubic's relative error of the exact value.
TEST_F(Exp2OnFmaTest, MatchesExp2WithinTheCubicsError) {
  std::vector<float> x;
  for (double v = -125.0; v <= 8.0; v += 1.0 / 4096) x.push_back(static_cast<float>(v));
  for (int j = -125; j <= 8; ++j) {
    x.push_back(std::nextafter(static_cast<float>(j) + 0.5f, -1e9f));
    x.push_back(static_cast<float>(j) + 0.5f);
  }
  const Results r = RunOnDevice(x);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp2(static_cast<double>(x[i]));
    const double rel = std::fabs(r.exact_zero[i] - want) / want;
    worst = std::max(worst, rel);
    ASSERT_LE(rel, 8e-5) << "x " << x[i] << " got " << r.exact_zero[i] << " want " << want;
    ASSERT_EQ(r.exact_zero[i], r.clamped[i]) << "x " << x[i];
  }
  std::printf("  Exp2OnFma: largest relative error %.3g over %zu points\n", worst, x.size());
}

// Below the range (masked scores are -inf): exactly 0 with kExactZero, else 2^-125 within the
// cubic's error; never negative, NaN or large.
TEST_F(Exp2OnFmaTest, BelowTheRangeGivesZeroOrTheClamp) {
  const std::vector<float> x = {-125.5f, -126.0f, -200.0f, -1e30f,
                                -std::numeric_limits<float>::infinity()};
  const Results r = RunOnDevice(x);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(r.exact_zero[i], 0.0f) << "x " << x[i];
    EXPECT_NEAR(r.clamped[i], std::exp2(-125.0), std::exp2(-125.0) * 8e-5) << "x " << x[i];
  }
}

}  // namespace
