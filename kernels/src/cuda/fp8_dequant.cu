// FP8 (e4m3) codes to scaled fp16/bf16 rows (fp8_dequant.h). Each thread converts 8 codes of
// one head of one row: the codes widen to float exactly, the scale is applied in float and the
// product is rounded once to the 16-bit type, as the CPU backend computes the same values.
#include "fp8_dequant.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>

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

// The source row of output row r of sequence b: r itself, or its row in the page pools.
__device__ __forceinline__ int64_t SourceRow(const Fp8DequantParams& p, int32_t b, int64_t r) {
  if (p.page_size <= 0) return r;
  const int32_t i = static_cast<int32_t>(r - p.row_offsets[b]);
  const int32_t page = p.page_indices[p.page_indptr[b] + i / p.page_size];
  return int64_t(page) * p.page_size + i % p.page_size;
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
      const int64_t src_row = SourceRow(p, b, r);
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

// 16 codes per thread, copied; rows past the sequences zeroed.
__global__ void __launch_bounds__(kThreads) Fp8GatherKernel(Fp8DequantParams p) {
  const int32_t row_bytes = p.heads * p.head_dim;
  const int32_t chunks_per_row = row_bytes / 16;
  const int64_t total = p.rows * chunks_per_row;
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t r = idx / chunks_per_row;
    const int32_t c = static_cast<int32_t>(idx - r * chunks_per_row);
    uint4 v = make_uint4(0, 0, 0, 0);
    const int32_t b = SequenceOf(p.row_offsets, p.batch, r);
    if (b < p.batch) {
      const int64_t src_row = SourceRow(p, b, r);
      v = *reinterpret_cast<const uint4*>(p.src + src_row * row_bytes + c * 16);
    }
    *reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.dst) + r * row_bytes + c * 16) = v;
  }
}

// Eight 16-bit values of a row as floats.
template <bool kBf16>
__device__ __forceinline__ void Load8(const void* src, int64_t at, float (&x)[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(src) + at);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (kBf16) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[j]));
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  }
}

// The (sequence, KV head) of a chunk of 8 values: idx -> row r, chunk c of the row.
struct QuantizeSlot {
  int64_t r;
  int32_t c;
  int32_t key;  // b * scale_heads + KV head, or -1 for a row past the sequences
};

__device__ __forceinline__ QuantizeSlot SlotOf(const Fp8QuantizeParams& p, int64_t idx) {
  const int32_t chunks_per_row = p.heads * p.head_dim / 8;
  QuantizeSlot s;
  s.r = idx / chunks_per_row;
  s.c = static_cast<int32_t>(idx - s.r * chunks_per_row);
  const int32_t b = SequenceOf(p.cu_seqlens, p.batch, s.r);
  const int32_t group = p.heads / p.scale_heads;
  s.key = b < p.batch ? b * p.scale_heads + (s.c * 8 / p.head_dim) / group : -1;
  return s;
}

// amax / 448, kept a normal float (fast math flushes subnormals: 0 would make the codes 0 * inf);
// 1 for an amax of 0 or infinity.
__device__ __forceinline__ float ScaleOfAmax(uint32_t bits) {
  const float amax = __uint_as_float(bits);
  return amax > 0.0f && amax <= FLT_MAX ? fmaxf(amax / 448.0f, FLT_MIN) : 1.0f;
}

// Pass 1: amax of each (sequence, KV head), lanes of one key reduced together before one atomic.
template <bool kBf16>
__global__ void __launch_bounds__(kThreads) Fp8AmaxKernel(Fp8QuantizeParams p) {
  const int64_t total = p.rows * (p.heads * p.head_dim / 8);
  for (int64_t base = int64_t(blockIdx.x) * kThreads; base < total; base += int64_t(gridDim.x) * kThreads) {
    const int64_t idx = base + threadIdx.x;
    int32_t key = -1;
    uint32_t bits = 0;
    if (idx < total) {
      const QuantizeSlot s = SlotOf(p, idx);
      key = s.key;
      if (key >= 0) {
        float x[8];
        Load8<kBf16>(p.src, s.r * p.heads * p.head_dim + s.c * 8, x);
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(x[j]));  // NaN is left out (and stays NaN)
        bits = __float_as_uint(m);
      }
    }
    // Non-negative floats (and NaN above them) order as their bits.
    const unsigned same = __match_any_sync(0xffffffffu, key);
    const uint32_t m = __reduce_max_sync(same, bits);
    if (key >= 0 && (threadIdx.x & 31) == __ffs(same) - 1) atomicMax(p.amax_bits + key, m);
  }
}

// Pass 2: the codes, and (block 0) the scales.
template <bool kBf16>
__global__ void __launch_bounds__(kThreads) Fp8QuantizeKernel(Fp8QuantizeParams p) {
  if (blockIdx.x == 0) {
    for (int32_t i = threadIdx.x; i < p.batch * p.scale_heads; i += kThreads) {
      p.scales[i] = ScaleOfAmax(p.amax_bits[i]);
    }
  }
  const int64_t total = p.rows * (p.heads * p.head_dim / 8);
  for (int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * kThreads) {
    const QuantizeSlot s = SlotOf(p, idx);
    const int64_t at = s.r * p.heads * p.head_dim + s.c * 8;
    uint2 codes = make_uint2(0, 0);
    if (s.key >= 0) {
      float x[8];
      Load8<kBf16>(p.src, at, x);
      const float inv = 1.0f / ScaleOfAmax(p.amax_bits[s.key]);
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint16_t pair = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        // cvt's first source lands in the upper byte.
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n"
            : "=h"(pair)
            : "f"(x[2 * j] * inv), "f"(x[2 * j + 1] * inv));
#else
        __trap();  // FP8 tensor-core launches are planned on compute capability 9.0 only
#endif
        w[j] = pair;
      }
      codes = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
    }
    *reinterpret_cast<uint2*>(p.dst + at) = codes;
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

cudaError_t LaunchFp8Gather(const Fp8DequantParams& p, cudaStream_t stream) {
  const int64_t row_bytes = int64_t(p.heads) * p.head_dim;
  if (p.rows < 0 || p.batch < 1 || p.heads < 1 || row_bytes % 16 != 0 || p.dst == nullptr ||
      p.row_offsets == nullptr || (p.rows > 0 && p.src == nullptr) || !Aligned(p.src, 16) ||
      !Aligned(p.dst, 16) || (p.page_size > 0 && (!p.page_indptr || !p.page_indices))) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = p.rows * (row_bytes / 16);
  if (total == 0) return cudaSuccess;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks));
  Fp8GatherKernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchFp8Quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.batch < 1 || p.heads < 1 || p.scale_heads < 1 ||
      p.heads % p.scale_heads != 0 || p.head_dim < 8 || p.head_dim % 8 != 0 || p.dst == nullptr ||
      p.scales == nullptr || p.amax_bits == nullptr || p.cu_seqlens == nullptr ||
      (p.rows > 0 && p.src == nullptr) || !Aligned(p.src, 16) || !Aligned(p.dst, 8)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err =
      cudaMemsetAsync(p.amax_bits, 0, sizeof(uint32_t) * size_t(p.batch) * p.scale_heads, stream);
  if (err != cudaSuccess) return err;
  const int64_t total = p.rows * (int64_t(p.heads) * p.head_dim / 8);
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks)));
  if (p.bf16) {
    Fp8AmaxKernel<true><<<blocks, kThreads, 0, stream>>>(p);
    Fp8QuantizeKernel<true><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    Fp8AmaxKernel<false><<<blocks, kThreads, 0, stream>>>(p);
    Fp8QuantizeKernel<false><<<blocks, kThreads, 0, stream>>>(p);
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
