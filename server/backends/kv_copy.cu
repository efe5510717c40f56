#include "backends/kv_copy.h"

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

}  // namespace

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
