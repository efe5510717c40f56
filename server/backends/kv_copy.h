// Row copies inside the CUDA backend's KV region, for session steps: the copy-on-write of a
// shared page's rows, and the scatter of a launch's new keys and values into their page rows (as
// they are, or quantized into an FP8 cache).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attn {

// For i in [0, n): the row of keys dst_k + dst_rows[i] * row_bytes gets src_k + s * row_bytes,
// with s = src_rows[i] (or i when src_rows is null), and the same for values. Device pointers;
// row_bytes a multiple of 16 and every pointer 16-byte aligned. Enqueued on stream.
cudaError_t LaunchKvCopyRows(const char* src_k, const char* src_v, const int64_t* src_rows,
                             char* dst_k, char* dst_v, const int64_t* dst_rows, int64_t n,
                             int64_t row_bytes, cudaStream_t stream);

// The quantizing scatter into an FP8 (E4M3) cache: for token t in [0, n), the 16-bit row t of
// src_k ([n, heads, head_dim], bf16 when bf16 else fp16) becomes the codes E4M3(x / scale) at
// dst_k + dst_rows[t] * heads * head_dim, rounded to nearest even and saturating to +-448, with
// scale = k_scales[m * heads + g] for KV head g of the member m that token t belongs to
// (cu_q[m] <= t < cu_q[m + 1], cu_q [members + 1]); the same for values. Elements with
// |x / scale| > 448 (infinities too) are added to *saturated. Device pointers; enqueued on stream.
cudaError_t LaunchKvQuantizeRows(bool bf16, const void* src_k, const void* src_v,
                                 const int32_t* cu_q, int32_t members, const float* k_scales,
                                 const float* v_scales, char* dst_k, char* dst_v,
                                 const int64_t* dst_rows, int64_t n, int32_t heads,
                                 int32_t head_dim, unsigned long long* saturated,
                                 cudaStream_t stream);

}  // namespace attn
