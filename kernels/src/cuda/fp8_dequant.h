// The FP8 (e4m3) to 16-bit conversion in front of the forward kernels: rows of e4m3 codes, each
// head scaled by its sequence's float scale, written as contiguous fp16/bf16 rows. The forward
// path for FP8 K/V (and FP8 q) converts into the caller's workspace with these, then runs the
// 16-bit forward kernel on the result.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attn::kernels::cuda {

// One conversion of `rows` rows of [heads, head_dim] codes. Output row r belongs to the sequence
// b with row_offsets[b] <= r < row_offsets[b + 1] and is its key/query i = r - row_offsets[b];
// rows at or past row_offsets[batch] (the tail of a buffer sized by a bound) are written as 0.
// Its codes are row r of src (contiguous), or, when page_size > 0, row
// page_indices[page_indptr[b] + i / page_size] * page_size + i % page_size of the page pool src.
// Head h is scaled by scales[b * scale_heads + h / (heads / scale_heads)].
struct Fp8DequantParams {
  const uint8_t* src = nullptr;
  void* dst = nullptr;
  const float* scales = nullptr;
  const int32_t* row_offsets = nullptr;  // [batch + 1], device
  const int32_t* page_indptr = nullptr;  // paged only
  const int32_t* page_indices = nullptr;
  int32_t page_size = 0;
  int32_t batch = 0;
  int64_t rows = 0;
  int32_t heads = 0;
  int32_t scale_heads = 0;
  int32_t head_dim = 0;  // a multiple of 8
  bool bf16 = false;     // dst is bf16, else fp16
};

// Enqueues the conversion on stream; no allocation, no synchronisation.
cudaError_t LaunchFp8Dequant(const Fp8DequantParams& p, cudaStream_t stream);

// The codes of rows of [heads, head_dim] e4m3 gathered as they are (no conversion, no scale) into
// contiguous rows of dst, rows past row_offsets[batch] zeroed: Fp8DequantParams's rows and pages,
// with dst holding codes (scales and bf16 unused). heads * head_dim a multiple of 16, src and dst
// 16-byte aligned.
cudaError_t LaunchFp8Gather(const Fp8DequantParams& p, cudaStream_t stream);

// 16-bit rows [rows, heads, head_dim] (sequences by cu_seqlens) quantized to e4m3 with one scale
// per (sequence, KV head) over the group of heads that KV head serves: scale = amax / 448 (at least
// FLT_MIN; 1 where amax is 0 or infinite; NaN values are left out of amax and stay NaN), code =
// E4M3(x / scale) rounded to nearest, saturating. amax_bits: batch *
// scale_heads words of workspace, zeroed by the launch.
struct Fp8QuantizeParams {
  const void* src = nullptr;  // fp16 or bf16
  uint8_t* dst = nullptr;
  float* scales = nullptr;    // [batch, scale_heads]
  uint32_t* amax_bits = nullptr;
  const int32_t* cu_seqlens = nullptr;  // [batch + 1], device
  int32_t batch = 0;
  int64_t rows = 0;
  int32_t heads = 0;
  int32_t scale_heads = 0;
  int32_t head_dim = 0;  // a multiple of 8
  bool bf16 = false;
};
cudaError_t LaunchFp8Quantize(const Fp8QuantizeParams& p, cudaStream_t stream);

// Enqueues offsets[0] = 0, offsets[b + 1] = offsets[b] + seqlens[b] for b < batch (device
// arrays): the contiguous row offsets of paged sequences.
cudaError_t LaunchSeqlensScan(const int32_t* seqlens, int32_t batch, int32_t* offsets,
                              cudaStream_t stream);

}  // namespace attn::kernels::cuda
