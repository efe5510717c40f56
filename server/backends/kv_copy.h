// Row copies inside the CUDA backend's KV region, for session steps: the copy-on-write of a
// shared page's rows, and the scatter of a launch's new keys and values into their page rows.
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

}  // namespace attn
