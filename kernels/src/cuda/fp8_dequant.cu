// FP8 (e4m3) codes to scaled fp16/bf16 rows (fp8_dequant.h). Each thread converts 8 codes of
// one head of one row: the codes widen to float exactly, the scale is applied in float and the
// product is rounded once to the 16-bit type, as the CPU backend computes the same values.
#include "fp8_dequant.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace attn::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
constexpr int64_t kMaxBlocks = 16384;

// OCP E4M3FN code -> float, exactly: S.EEEE.MMM is (-1)^S 2^(E-7) 1.MMM, (-1)^S 2^-6 0.MMM for
// E = 0, and S.1111.111 is NaN (no infinities).
__device__ __forceinline__ float E4m3ToFloat(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 15u;
  const uint32_t m = c & 7u;
  if (e == 15u && m == 7u) return __uint_as_float(0x7fc00000u | sign);
  if (e == 0u) return __uint_as_float(__float_as_uint(float(m) * 0.001953125f) | sign);  // m 2^-9
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

template <bool kBf16>
__device__ __forceinline__ uint32_t PackPair(float a, float b) {
  if constexpr (kBf16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// The sequence of output row r: the largest b <= batch with offsets[b] <= r (batch: the tail).
__device__ __forceinline__ int32_t SequenceOf(const int32_t* offsets, int32_t batch, int64_t r) {
  int32_t lo = 0, hi = batch;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// kVector: src rows are 8-byte and dst rows 16-byte aligned (one load and one store per thread).
template <bool kBf16, bool kVector>
__global__ void __launch_bounds__(kThreads) Fp8DequantKernel(Fp8DequantParams p) {
  const int32_t row_elems = p.heads * p.head_dim;
  const int32_t chunks_per_row = row_elems / 8;
  const int64_t total = p.rows * chunks_per_row;
  const int32_t group = p.heads / p.scale_heads;
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t r = idx / chunks_per_row;
    const int32_t c = static_cast<int32_t>(idx - r * chunks_per_row);
    const int32_t h = c * 8 / p.head_dim;
    uint32_t out[4] = {0, 0, 0, 0};
    const int32_t b = SequenceOf(p.row_offsets, p.batch, r);
    if (b < p.batch) {
      int64_t src_row = r;
      if (p.page_size > 0) {
        const int32_t i = static_cast<int32_t>(r - p.row_offsets[b]);
        const int32_t page = p.page_indices[p.page_indptr[b] + i / p.page_size];
        src_row = int64_t(page) * p.page_size + i % p.page_size;
      }
      const float scale = p.scales[int64_t(b) * p.scale_heads + h / group];
      const uint8_t* src = p.src + src_row * row_elems + c * 8;
      uint32_t lo, hi;
      if constexpr (kVector) {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
        lo = v.x;
        hi = v.y;
      } else {
        lo = uint32_t(src[0]) | uint32_t(src[1]) << 8 | uint32_t(src[2]) << 16 |
             uint32_t(src[3]) << 24;
        hi = uint32_t(src[4]) | uint32_t(src[5]) << 8 | uint32_t(src[6]) << 16 |
             uint32_t(src[7]) << 24;
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t w = j == 0 ? lo : hi;
        out[2 * j] = PackPair<kBf16>(E4m3ToFloat(w & 0xffu) * scale,
                                     E4m3ToFloat((w >> 8) & 0xffu) * scale);
        out[2 * j + 1] = PackPair<kBf16>(E4m3ToFloat((w >> 16) & 0xffu) * scale,
                                         E4m3ToFloat(w >> 24) * scale);
      }
    }
    uint16_t* dst = static_cast<uint16_t*>(p.dst) + r * row_elems + c * 8;
    if constexpr (kVector) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        dst[2 * j] = static_cast<uint16_t>(out[j] & 0xffffu);
        dst[2 * j + 1] = static_cast<uint16_t>(out[j] >> 16);
      }
    }
  }
}

// One block: each thread sums a run of sequences, the block scans the runs' sums, and each
// thread writes its run's offsets.
__global__ void __launch_bounds__(kScanThreads)
    SeqlensScanKernel(const int32_t* seqlens, int32_t batch, int32_t* offsets) {
  __shared__ int32_t sums[kScanThreads];
  const int32_t per = (batch + kScanThreads - 1) / kScanThreads;
  const int32_t begin = min(batch, int32_t(threadIdx.x) * per);
  const int32_t end = min(batch, begin + per);
  int32_t local = 0;
  for (int32_t b = begin; b < end; ++b) local += seqlens[b];
  sums[threadIdx.x] = local;
  __syncthreads();
  for (int stride = 1; stride < kScanThreads; stride *= 2) {
    const int32_t add = threadIdx.x >= stride ? sums[threadIdx.x - stride] : 0;
    __syncthreads();
    sums[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t at = sums[threadIdx.x] - local;  // exclusive prefix of this run
  if (threadIdx.x == 0) offsets[0] = 0;
  for (int32_t b = begin; b < end; ++b) {
    at += seqlens[b];
    offsets[b + 1] = at;
  }
}

bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

}  // namespace

cudaError_t LaunchFp8Dequant(const Fp8DequantParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.batch < 1 || p.heads < 1 || p.scale_heads < 1 ||
      p.heads % p.scale_heads != 0 || p.head_dim < 8 || p.head_dim % 8 != 0 ||
      p.dst == nullptr || p.row_offsets == nullptr || (p.rows > 0 && p.src == nullptr) ||
      p.scales == nullptr || (p.page_size > 0 && (!p.page_indptr || !p.page_indices))) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = p.rows * (int64_t(p.heads) * p.head_dim / 8);
  if (total == 0) return cudaSuccess;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks));
  const bool vector = Aligned(p.src, 8) && Aligned(p.dst, 16);
  if (p.bf16) {
    if (vector) {
      Fp8DequantKernel<true, true><<<blocks, kThreads, 0, stream>>>(p);
    } else {
      Fp8DequantKernel<true, false><<<blocks, kThreads, 0, stream>>>(p);
    }
  } else {
    if (vector) {
      Fp8DequantKernel<false, true><<<blocks, kThreads, 0, stream>>>(p);
    } else {
      Fp8DequantKernel<false, false><<<blocks, kThreads, 0, stream>>>(p);
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchSeqlensScan(const int32_t* seqlens, int32_t batch, int32_t* offsets,
                              cudaStream_t stream) {
  if (seqlens == nullptr || offsets == nullptr || batch < 1) return cudaErrorInvalidValue;
  SeqlensScanKernel<<<1, kScanThreads, 0, stream>>>(seqlens, batch, offsets);
  return cudaGetLastError();
}

}  // namespace attn::kernels::cuda
