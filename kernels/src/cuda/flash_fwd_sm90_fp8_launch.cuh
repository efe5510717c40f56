// Host side of the FP8 forward kernel: V's transposition into the workspace, the TMA maps over the
// e4m3 tensors, and the persistent launch. Explicitly instantiated once per (o type, head dim) in
// instantiations/flash_fwd_sm90_fp8_*.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "flash_fwd_sm90_fp8_kernel.cuh"
#include "flash_fwd_sm90_fp8_layout.h"
#include "flash_fwd_sm90_launch.cuh"
#include "flash_params.h"

namespace attn::kernels::cuda {

// Map of a [rows, heads, D] e4m3 tensor (row stride in codes) as {128, rows, D/128, heads}, boxes
// of {128, box_rows, D/128, 1} with the 128-byte swizzle; rows past the end read as zeros.
template <int D>
bool EncodeFp8RowsMap(CUtensorMap* map, const void* base, int rows, int heads, int box_rows,
                      int64_t row_stride) {
  const TensorMapEncodeTiledFn encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {128, cuuint64_t(std::max(rows, 1)), D / 128, cuuint64_t(heads)};
  const cuuint64_t strides[3] = {cuuint64_t(row_stride), 128, cuuint64_t(D)};
  const cuuint32_t box[4] = {128, cuuint32_t(box_rows), D / 128, 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box,
                elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Map of Vt [num_kv_heads][D][cols] as {cols, D, num_kv_heads}, boxes of {128 keys, D, 1}.
template <int D>
bool EncodeFp8VtMap(CUtensorMap* map, const void* vt, int64_t cols, int kv_heads) {
  const TensorMapEncodeTiledFn encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(cols), D, cuuint64_t(kv_heads)};
  const cuuint64_t strides[2] = {cuuint64_t(cols), cuuint64_t(cols) * D};
  const cuuint32_t box[3] = {kFp8BlockN, D, 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(vt), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The kernel of traits Tr (kernels/bench/fp8_variants times others against the shipped one).
template <typename Tr>
cudaError_t RunFlashFwdSm90Fp8With(const FlashParams& params, int sms, cudaStream_t stream) {
  constexpr int D = Tr::kHeadDim;
  if (params.vt == nullptr || params.q_descale == nullptr || params.k_descale == nullptr ||
      params.v_descale == nullptr || params.batch < 1 || sms < 1) {
    return cudaErrorInvalidValue;
  }
  if ((reinterpret_cast<uintptr_t>(params.vt) & 255) != 0) return cudaErrorInvalidValue;
  const int64_t vt_cols = Fp8VtColumns(params.total_k, params.batch);
  Sm90Fp8Params P;
  P.p = params;
  if (!EncodeFp8RowsMap<D>(&P.tq, params.q, params.total_q, params.num_heads, Tr::kBlockM,
                           params.q_row_stride) ||
      !EncodeFp8RowsMap<D>(&P.tk, params.k, params.total_k, params.num_kv_heads, Tr::kBlockN,
                           params.k_row_stride) ||
      !EncodeFp8VtMap<D>(&P.tvt, params.vt, vt_cols, params.num_kv_heads)) {
    return cudaErrorInvalidValue;
  }
  // V transposed first. Every block of the transposition holds 128 columns; a sequence's range
  // spans at most its keys rounded up plus two alignments (Fp8VtSeqStart), its keys at most
  // max_seqlen_k (the bound AttentionArgs promises).
  const dim3 tgrid((params.max_seqlen_k + 2 * kFp8VtAlign - 1) / kFp8VtAlign + 1, params.num_kv_heads,
                   params.batch);
  Fp8TransposeVKernel<D><<<tgrid, 256, 0, stream>>>(static_cast<const uint8_t*>(params.v),
                                                    params.v_row_stride, params.cu_seqlens_k,
                                                    params.batch, static_cast<uint8_t*>(params.vt),
                                                    vt_cols);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  constexpr auto kernel = &FlashFwdSm90Fp8Kernel<Tr>;
  err = SetSharedMemoryOnce<kernel>(Tr::kSmemAlloc, false);
  if (err != cudaSuccess) return err;
  const int64_t m_blocks = (params.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t tiles = m_blocks * params.num_heads * params.batch;
  if (tiles == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>(tiles, sms));
  kernel<<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(P);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t RunFlashFwdSm90Fp8(const FlashParams& params, int tile_rows, int sms, cudaStream_t stream) {
  using Wide = Sm90Fp8Shipped<D, T>;
  if (tile_rows == Wide::kBlockM) return RunFlashFwdSm90Fp8With<Wide>(params, sms, stream);
  if constexpr (Wide::kBlockM != 128) {
    if (tile_rows == 128) return RunFlashFwdSm90Fp8With<Sm90Fp8ShippedNarrow<D, T>>(params, sms, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace attn::kernels::cuda
