// Host side of the sm_90a forward kernel: TMA tensor maps (encoded through the driver entry point
// the runtime hands out, so nothing links libcuda) and the launch. Explicitly instantiated once
// per (dtype, head dim) in instantiations/flash_fwd_sm90_*.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "flash_fwd_sm90_kernel.cuh"
#include "flash_fwd_sm90_traits.cuh"
#include "flash_params.h"

namespace attn::kernels::cuda {

using TensorMapEncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                            const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                            const cuuint32_t*, CUtensorMapInterleave,
                                            CUtensorMapSwizzle, CUtensorMapL2promotion,
                                            CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, looked up once; nullptr when the driver lacks it.
inline TensorMapEncodeTiledFn TensorMapEncoder() {
  static const TensorMapEncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return TensorMapEncodeTiledFn(nullptr);
    }
    return reinterpret_cast<TensorMapEncodeTiledFn>(f);
  }();
  return fn;
}

// Map of a [rows, heads, D] tensor (row stride heads * D elements) as {64, rows, D/64, heads},
// boxes of {64, box_rows, D/64, 1} with the 128-byte swizzle; out-of-range rows read as zeros.
template <typename T, int D>
bool EncodeRowsMap(CUtensorMap* map, const void* base, int rows, int heads, int box_rows) {
  const TensorMapEncodeTiledFn encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const CUtensorMapDataType type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[4] = {64, cuuint64_t(rows), D / 64, cuuint64_t(heads)};
  // Byte strides of dims 1..3: a row, a 64-column slab, a head.
  const cuuint64_t strides[3] = {cuuint64_t(heads) * D * 2, 128, cuuint64_t(D) * 2};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), D / 64, 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename Tr>
cudaError_t LaunchFlashFwdSm90(const FlashParams& params, cudaStream_t stream) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  Sm90Params P;
  P.p = params;
  if (!EncodeRowsMap<T, D>(&P.tq, params.q, params.total_q, params.num_heads, Tr::kBlockM) ||
      !EncodeRowsMap<T, D>(&P.tk, params.k, params.total_k, params.num_kv_heads, Tr::kBlockN) ||
      !EncodeRowsMap<T, D>(&P.tv, params.v, params.total_k, params.num_kv_heads, Tr::kBlockN)) {
    return cudaErrorInvalidValue;
  }
  // ATTN_SM90_OVERLAP=1 runs the variant with the softmax / P V overlap and ping-pong (a
  // measurement knob: on the H200 it measured slower, docs/PERF.md). It pairs two consumer
  // warpgroups, so it exists for the narrow tiling only.
  static const bool overlap = [] {
    const char* e = std::getenv("ATTN_SM90_OVERLAP");
    return e != nullptr && std::atoi(e) != 0;
  }();
  auto kernel = &FlashFwdSm90Kernel<Tr, false>;
  if constexpr (Tr::kConsumerWGs == 2) {
    if (overlap) kernel = &FlashFwdSm90Kernel<Tr, true>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemAlloc);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM (or per tile when there are fewer), each looping over tiles.
  const int64_t tiles = int64_t((params.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM) *
                        params.num_heads * params.batch;
  if (tiles == 0) return cudaSuccess;
  int dev = 0;
  int sms = 0;
  err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  const int grid = static_cast<int>(tiles < sms ? tiles : sms);
  kernel<<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(P);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, cudaStream_t stream) {
  using Wide = Sm90WideTraits<D, T>;
  using Narrow = Sm90NarrowTraits<D, T>;
  if constexpr (Wide::kBlockM == Narrow::kBlockM) {  // one tiling (d=256)
    return LaunchFlashFwdSm90<Wide>(params, stream);
  } else {
    if (params.has_right && params.max_seqlen_q <= kSm90NarrowMaxSeqlenQ) {
      return LaunchFlashFwdSm90<Narrow>(params, stream);
    }
    return LaunchFlashFwdSm90<Wide>(params, stream);
  }
}

}  // namespace attn::kernels::cuda
