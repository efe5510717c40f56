#include "backends/kv_copy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

namespace attn {
namespace {

// blockIdx.y: 0 keys, 1 values; rows over blockIdx.x (grid-stride), 16-byte words over threads.
__global__ void KvCopyRowsKernel(const char* src_k, const char* src_v, const int64_t* src_rows,
                                 char* dst_k, char* dst_v, const int64_t* dst_rows, int64_t n,
                                 int64_t words) {
  const char* src = blockIdx.y == 0 ? src_k : src_v;
  char* dst = blockIdx.y == 0 ? dst_k : dst_v;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = src_rows != nullptr ? src_rows[i] : i;
    const uint4* from = reinterpret_cast<const uint4*>(src) + s * words;
    uint4* to = reinterpret_cast<uint4*>(dst) + dst_rows[i] * words;
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
  }
}

__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

// blockIdx.y: 0 keys, 1 values; tokens over blockIdx.x (grid-stride), a row's elements over
// threads.
template <typename T>
__global__ void KvQuantizeRowsKernel(const T* src_k, const T* src_v, const int32_t* cu_q,
                                     int32_t members, const float* k_scales,
                                     const float* v_scales, uint8_t* dst_k, uint8_t* dst_v,
                                     const int64_t* dst_rows, int64_t n, int32_t heads,
                                     int32_t head_dim, unsigned long long* saturated) {
  const bool values = blockIdx.y == 1;
  const T* src = values ? src_v : src_k;
  uint8_t* dst = values ? dst_v : dst_k;
  const float* scales = values ? v_scales : k_scales;
  const int64_t row = int64_t{heads} * head_dim;
  unsigned long long count = 0;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    // The member of token t: the last m with cu_q[m] <= t (cu_q[0] = 0 <= t < cu_q[members]).
    int32_t lo = 0, hi = members;
    while (hi - lo > 1) {
      const int32_t mid = (lo + hi) / 2;
      if (cu_q[mid] <= t) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const float* s = scales + int64_t{lo} * heads;
    const T* x = src + t * row;
    uint8_t* out = dst + dst_rows[t] * row;
    for (int64_t e = threadIdx.x; e < row; e += blockDim.x) {
      const float q = __fdiv_rn(ToFloat(x[e]), s[e / head_dim]);
      count += fabsf(q) > 448.0f;  // false for NaN
      out[e] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
    }
  }
  if (count > 0) atomicAdd(saturated, count);
}

}  // namespace

cudaError_t LaunchKvQuantizeRows(bool bf16, const void* src_k, const void* src_v,
                                 const int32_t* cu_q, int32_t members, const float* k_scales,
                                 const float* v_scales, char* dst_k, char* dst_v,
                                 const int64_t* dst_rows, int64_t n, int32_t heads,
                                 int32_t head_dim, unsigned long long* saturated,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t row = int64_t{heads} * head_dim;
  const int threads = static_cast<int>(std::min<int64_t>(256, (row + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(n, 4096)), 2);
  auto* k8 = reinterpret_cast<uint8_t*>(dst_k);
  auto* v8 = reinterpret_cast<uint8_t*>(dst_v);
  if (bf16) {
    KvQuantizeRowsKernel<<<grid, threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(src_k), static_cast<const __nv_bfloat16*>(src_v), cu_q,
        members, k_scales, v_scales, k8, v8, dst_rows, n, heads, head_dim, saturated);
  } else {
    KvQuantizeRowsKernel<<<grid, threads, 0, stream>>>(
        static_cast<const __half*>(src_k), static_cast<const __half*>(src_v), cu_q, members,
        k_scales, v_scales, k8, v8, dst_rows, n, heads, head_dim, saturated);
  }
  return cudaGetLastError();
}

cudaError_t LaunchKvCopyRows(const char* src_k, const char* src_v, const int64_t* src_rows,
                             char* dst_k, char* dst_v, const int64_t* dst_rows, int64_t n,
                             int64_t row_bytes, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (row_bytes % 16 != 0) return cudaErrorInvalidValue;
  const int64_t words = row_bytes / 16;
  const int threads = static_cast<int>(std::min<int64_t>(256, (words + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(n, 4096)), 2);
  KvCopyRowsKernel<<<grid, threads, 0, stream>>>(src_k, src_v, src_rows, dst_k, dst_v, dst_rows,
                                                  n, words);
  return cudaGetLastError();
}

}  // namespace attn
