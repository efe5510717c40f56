// Issue rates of the instructions an FP8 softmax is made of (exp2 in f32 and f16x2, e4m3 packs from
// f32 and f16x2, f32 -> f16x2, the FMA-pipe exp2), alone and in the mixes a softmax issues, in
// elements per clock per SM. Which pipe an instruction shares with another shows as a mix's rate:
// the sum of the two alone times where they share one, the larger where they do not.
//
//   softmax_pipe_rates [--iters N]   (built with -DATTN_SM90_VARIANTS=ON)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "exp2_on_fma.cuh"

namespace {

constexpr int kChains = 8;
constexpr int kThreads = 1024;

__device__ __forceinline__ float Ex2F32(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t Ex2F16x2(uint32_t x) {
  uint32_t y;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t E4m3FromF32(float a, float b) {
  uint16_t r;
  asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ uint32_t E4m3FromF16x2(uint32_t h) {
  uint16_t r;
  asm volatile("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(h));
  return r;
}
__device__ __forceinline__ uint32_t F16x2FromF32(float a, float b) {
  uint32_t r;
  asm volatile("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float F32FromF16Low(uint32_t h) {
  float f;
  asm volatile("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(h));
  return f;
}
__device__ __forceinline__ uint32_t Hadd2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm volatile("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

enum Op : int {
  kEx2F32,
  kEx2F16x2,
  kE4m3F32,
  kE4m3F16x2,
  kF16x2F32,
  kF32F16,
  kHadd2,
  kLop,
  kFfma,
  kExp2Fma,
  kMixEx2E4m3F32,     // 2 exp2 f32 + 1 pack of 2 from f32 (2 elements)
  kMixEx2E4m3F16x2,   // 1 exp2 f16x2 + 1 pack of 2 from f16x2 (2 elements)
  kMixEx2F32F16x2,    // 2 exp2 f32 + 1 f32 -> f16x2 (2 elements)
  kMixEx2F16Full,     // f32 -> f16x2, exp2 f16x2, pack e4m3 from f16x2, hadd2 (2 elements)
  kOps
};
const char* const kNames[kOps] = {
    "ex2.approx.ftz.f32",         "ex2.approx.f16x2 (per element)", "cvt e4m3x2.f32 (per element)",
    "cvt e4m3x2.f16x2 (per elem)", "cvt f16x2.f32 (per element)",    "cvt f32.f16",
    "add f16x2 (per element)",    "lop3 (b32)",                      "ffma",
    "exp2 on the FMA pipe",       "mix: 2 ex2.f32 + e4m3x2.f32",     "mix: ex2.f16x2 + e4m3x2.f16x2",
    "mix: 2 ex2.f32 + f16x2.f32", "mix: f16x2.f32, ex2.f16x2, e4m3x2.f16x2, add.f16x2"};
// Elements each iteration of one chain produces.
constexpr int kElems[kOps] = {1, 2, 2, 2, 2, 1, 2, 1, 1, 1, 2, 2, 2, 2};

template <int kOp>
__global__ void __launch_bounds__(kThreads, 1) RateKernel(int iters, uint32_t seed, long long* cycles,
                                                          uint32_t* sink) {
  float f[kChains], g[kChains];
  uint32_t u[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    const uint32_t v = seed * (threadIdx.x + 1) + c * 2654435761u;
    f[c] = -float(v % 1000) * 1e-3f;
    g[c] = float(v % 777) * 1e-3f;
    u[c] = 0xB800B800u ^ (v & 0x03FF03FFu);  // f16 pairs in [-0.5, -1)
  }
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kOp == kEx2F32) {
        f[c] = Ex2F32(f[c]);
      } else if constexpr (kOp == kEx2F16x2) {
        u[c] = Ex2F16x2(u[c]);
      } else if constexpr (kOp == kE4m3F32) {
        const uint32_t r = E4m3FromF32(f[c], g[c]);
        f[c] = __uint_as_float(r | 0x3c000000u);
      } else if constexpr (kOp == kE4m3F16x2) {
        u[c] = E4m3FromF16x2(u[c]) | 0x3c003c00u;
      } else if constexpr (kOp == kF16x2F32) {
        const uint32_t r = F16x2FromF32(f[c], g[c]);
        f[c] = __uint_as_float(r);
      } else if constexpr (kOp == kF32F16) {
        f[c] = F32FromF16Low(__float_as_uint(f[c]));
      } else if constexpr (kOp == kHadd2) {
        u[c] = Hadd2(u[c], 0x3c003c00u);
      } else if constexpr (kOp == kLop) {
        u[c] = (u[c] ^ 0x5a5a5a5au) | u[c];
        asm volatile("" : "+r"(u[c]));
      } else if constexpr (kOp == kFfma) {
        f[c] = fmaf(f[c], 0.999f, g[c]);
        asm volatile("" : "+f"(f[c]));
      } else if constexpr (kOp == kExp2Fma) {
        f[c] = attn::kernels::cuda::Exp2OnFma<false>(f[c]);
        asm volatile("" : "+f"(f[c]));
      } else if constexpr (kOp == kMixEx2E4m3F32) {
        const float a = Ex2F32(f[c]), b = Ex2F32(g[c]);
        g[c] = b;
        f[c] = __uint_as_float(E4m3FromF32(a, b) | 0xbc000000u);
      } else if constexpr (kOp == kMixEx2E4m3F16x2) {
        u[c] = E4m3FromF16x2(Ex2F16x2(u[c])) | 0xbc00bc00u;
      } else if constexpr (kOp == kMixEx2F32F16x2) {
        const float a = Ex2F32(f[c]), b = Ex2F32(g[c]);
        g[c] = b;
        f[c] = __uint_as_float(F16x2FromF32(a, b) | 0x80008000u);
      } else if constexpr (kOp == kMixEx2F16Full) {
        const uint32_t e = Ex2F16x2(F16x2FromF32(f[c], g[c]));
        u[c] = Hadd2(u[c], e);
        f[c] = __uint_as_float(E4m3FromF16x2(e) | 0xbc000000u);
      }
    }
  }
  const long long t1 = clock64();
  __syncthreads();
  uint32_t acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc ^= __float_as_uint(f[c]) ^ __float_as_uint(g[c]) ^ u[c];
  if (acc == 0x12345678u) sink[threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// The median SM's rate over the last of three launches (the first two warm up); -1 on a CUDA error.
template <int kOp>
double Rate(int sms, int iters, long long* d_cycles, uint32_t* d_sink) {
  for (int rep = 0; rep < 3; ++rep) {
    RateKernel<kOp><<<sms, kThreads>>>(iters, 12345u + rep, d_cycles, d_sink);
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      std::fprintf(stderr, "%s: %s\n", kNames[kOp], cudaGetErrorString(err));
      return -1;
    }
  }
  std::vector<long long> cyc(sms);
  cudaMemcpy(cyc.data(), d_cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  std::sort(cyc.begin(), cyc.end());
  const double elems = double(kThreads) * kChains * iters * kElems[kOp];
  return elems / double(cyc[sms / 2]);
}

template <int kOp = 0>
void RunAll(int sms, int iters, long long* d_cycles, uint32_t* d_sink) {
  if constexpr (kOp < kOps) {
    const double r = Rate<kOp>(sms, iters, d_cycles, d_sink);
    std::printf("| %-52s | %8.2f |\n", kNames[kOp], r);
    RunAll<kOp + 1>(sms, iters, d_cycles, d_sink);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 4096;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[++i]);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  long long* d_cycles = nullptr;
  uint32_t* d_sink = nullptr;
  cudaMalloc(&d_cycles, prop.multiProcessorCount * sizeof(long long));
  cudaMalloc(&d_sink, kThreads * sizeof(uint32_t));
  std::printf("%s, %d SMs, one CTA of %d threads per SM, %d independent chains a thread\n\n", prop.name,
              prop.multiProcessorCount, kThreads, kChains);
  std::printf("| instruction(s) | elements / clock / SM |\n| --- | --- |\n");
  RunAll(prop.multiProcessorCount, iters, d_cycles, d_sink);
  cudaFree(d_cycles);
  cudaFree(d_sink);
  return 0;
}
