// Host side of the sm_90a forward kernel: TMA tensor maps (encoded through the driver entry point
// the runtime hands out, so nothing links libcuda) and the launch. Explicitly instantiated once
// per (dtype, head dim) in instantiations/flash_fwd_sm90_*.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
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

// Map of a [rows, heads, D] tensor (row stride heads * D elements unless given) as
// {64, rows, D/64, heads}, boxes of {64, box_rows, box_slabs (all D/64 unless given), 1} with the
// 128-byte swizzle; out-of-range rows read as zeros (and are not written by stores).
template <typename T, int D>
bool EncodeRowsMap(CUtensorMap* map, const void* base, int rows, int heads, int box_rows,
                   int64_t row_stride = 0, int box_slabs = D / 64) {
  const TensorMapEncodeTiledFn encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const CUtensorMapDataType type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[4] = {64, cuuint64_t(rows), D / 64, cuuint64_t(heads)};
  // Byte strides of dims 1..3: a row, a 64-column slab, a head.
  const cuuint64_t strides[3] = {cuuint64_t(row_stride > 0 ? row_stride : int64_t(heads) * D) * 2, 128,
                                 cuuint64_t(D) * 2};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), cuuint32_t(box_slabs), 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Integer value of a measurement knob, read at every launch (so one process can time the variants
// side by side); `def` when unset.
inline int Sm90EnvInt(const char* name, int def) {
  const char* e = std::getenv(name);
  return e != nullptr && *e != '\0' ? std::atoi(e) : def;
}

inline cudaError_t Sm90SmCount(int* sms) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  return err;
}

// Whether a launch's arguments suit Tr::kClusterKV: no mask, and every sequence of the same length,
// a multiple of two row blocks (a cluster's two CTAs then always have tiles of one (sequence,
// head) with the same key tiles).
inline bool Sm90ClusterKvApplies(const FlashParams& p, int block_m) {
  return !p.has_left && !p.has_right && p.max_seqlen_q > 0 && p.max_seqlen_q % (2 * block_m) == 0 &&
         int64_t(p.total_q) == int64_t(p.batch) * p.max_seqlen_q;
}

// `trace`: the timeline buffer of a traced tiling (Sm90Traced), grid * kConsumerWGs *
// Sm90TraceLayout::kPerWarpgroup entries; nullptr otherwise.
template <typename Tr>
cudaError_t LaunchFlashFwdSm90(const FlashParams& params, int sms, cudaStream_t stream,
                               unsigned long long* trace = nullptr) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  Sm90Params P;
  P.p = params;
  P.trace = trace;
  // O through shared memory and TMA stores (needs 16-byte aligned rows); ATTN_SM90_TMA_O=0 stores
  // from registers instead (a measurement knob: on the H200 that is 5-15% slower at s <= 1k).
  P.tma_o = Sm90EnvInt("ATTN_SM90_TMA_O", 1) != 0 && reinterpret_cast<uintptr_t>(params.o) % 16 == 0 &&
            params.o_row_stride % 8 == 0 &&
            EncodeRowsMap<T, D>(&P.to, params.o, params.total_q, params.num_heads, 64,
                                params.o_row_stride, 1);
  // Tr::kClusterKV: each CTA loads half a K/V tile, slab by slab (Sm90LoadHalfKV).
  constexpr int kKvBoxRows = Tr::kClusterKV ? Tr::kBlockN / 2 : Tr::kBlockN;
  constexpr int kKvBoxSlabs = Tr::kClusterKV ? 1 : D / 64;
  if (!EncodeRowsMap<T, D>(&P.tq, params.q, params.total_q, params.num_heads, Tr::kBlockM) ||
      !EncodeRowsMap<T, D>(&P.tk, params.k, params.total_k, params.num_kv_heads, kKvBoxRows, 0,
                           kKvBoxSlabs) ||
      !EncodeRowsMap<T, D>(&P.tv, params.v, params.total_k, params.num_kv_heads, kKvBoxRows, 0,
                           kKvBoxSlabs)) {
    return cudaErrorInvalidValue;
  }
  auto kernel = &FlashFwdSm90Kernel<Tr>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemAlloc);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM (or per tile when there are fewer), each looping over tiles.
  const int64_t tiles = int64_t((params.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM) *
                        params.num_heads * params.batch;
  if (tiles == 0) return cudaSuccess;
  const int grid = static_cast<int>(tiles < sms ? tiles : sms);
  if constexpr (Tr::kClusterKV) {
    if (!Sm90ClusterKvApplies(params, Tr::kBlockM)) return cudaErrorNotSupported;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(grid & ~1));  // whole clusters; tiles come in pairs
    config.blockDim = dim3(Tr::kThreads);
    config.dynamicSmemBytes = Tr::kSmemAlloc;
    config.stream = stream;
    cudaLaunchAttribute cluster = {};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    // A GPC with an odd number of free SMs leaves one idle: a persistent grid of more clusters
    // than fit at once would run its last ones as a second wave.
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    if (err != cudaSuccess) return err;
    if (clusters == 0) return cudaErrorNotSupported;
    if (2 * clusters < int(config.gridDim.x)) config.gridDim = dim3(unsigned(2 * clusters));
    return cudaLaunchKernelEx(&config, kernel, P);
  } else {
    kernel<<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(P);
    return cudaGetLastError();
  }
}

// Estimated time of a launch with the tiling Tr, in units of one 64-row x 128-key product step:
// the tiles (key tiles visited, plus a fixed cost per tile for its pipeline fill and epilogue)
// dealt to the persistent CTAs as the kernel deals them (Sm90Schedule), the busiest CTA's sum.
// Rows of the tile past the sequence end still cost (the tile quantisation of, e.g., 192-row
// tiles on s = 1k); a narrow (2-warpgroup) row costs kNarrowRowCost times a wide one (its
// softmax is hidden behind one other warpgroup's products instead of two).
template <typename Tr>
double Sm90TilingCost(const FlashParams& p, int sms) {
  constexpr double kFixedPerTile = 0.5;  // key tiles
  constexpr double kNarrowRowCost = 1.15;  // H200, s = 2k non-causal: 1.15-1.18
  const int m_blocks = (p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t hb = int64_t(p.num_heads) * p.batch;
  const int64_t tiles = m_blocks * hb;
  const int grid = int(std::min<int64_t>(tiles, sms));
  const double row_cost = (Tr::kConsumerWGs == 2 ? kNarrowRowCost : 1.0) * Tr::kConsumerWGs;
  const int off = p.max_seqlen_k - p.max_seqlen_q;
  auto key_tiles = [&](int m) {
    const int m0 = m * Tr::kBlockM;
    const int m_last = std::min(m0 + Tr::kBlockM, p.max_seqlen_q) - 1;
    const int lo = p.has_left ? std::max(0, m0 + off - p.left) : 0;
    const int hi = p.has_right ? std::min(p.max_seqlen_k, m_last + off + p.right + 1) : p.max_seqlen_k;
    return hi > lo ? (hi + Tr::kBlockN - 1) / Tr::kBlockN - lo / Tr::kBlockN : 0;
  };
  if (!p.has_right) {  // equal tiles (a left window is ignored: near-equal), dealt round-robin
    const int64_t rounds = (tiles + grid - 1) / grid;
    return double(rounds) * (key_tiles(m_blocks - 1) + kFixedPerTile) * row_cost * Tr::kBlockN / 128;
  }
  // Longest first in a snake: round r hands tile r * grid + c to CTA c (r even) or grid - 1 - c.
  // The busiest CTA is looked for among a few (the ends, the quarters, and those next to the last
  // round's edge), each walked over its rounds, so the estimate costs O(rounds), not O(tiles).
  const int rem = int(tiles % grid);
  const int cand[] = {0, 1, grid / 4, grid / 2, 3 * grid / 4, grid - 2, grid - 1,
                      rem - 1, rem, grid - 1 - rem, grid - rem};
  double busiest = 0.0;
  for (const int c : cand) {
    if (c < 0 || c >= grid) continue;
    double sum = 0.0;
    for (int64_t r = 0; r * grid < tiles; ++r) {
      const int64_t j = r * grid + ((r & 1) ? grid - 1 - c : c);
      if (j < tiles) sum += key_tiles(m_blocks - 1 - int(j / hb)) + kFixedPerTile;
    }
    busiest = std::max(busiest, sum);
  }
  return busiest * row_cost * Tr::kBlockN / 128;
}

template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, cudaStream_t stream) {
  using Wide = Sm90WideTraits<D, T>;
  using Narrow = Sm90NarrowTraits<D, T>;
  int sms = 0;
  const cudaError_t err = Sm90SmCount(&sms);
  if (err != cudaSuccess) return err;
  if constexpr (Wide::kBlockM == Narrow::kBlockM) {  // d=256: 80-key tiles but for short causal
    // ATTN_SM90_TILING (a measurement knob): 1 = wide (80 keys), 2 = narrow (64).
    const int mode = Sm90EnvInt("ATTN_SM90_TILING", 0);
    const bool narrow = mode == 2 || (mode != 1 && params.has_right &&
                                      params.max_seqlen_q <= kSm90NarrowMaxSeqlenQ);
    return narrow ? LaunchFlashFwdSm90<Narrow>(params, sms, stream)
                  : LaunchFlashFwdSm90<Wide>(params, sms, stream);
  } else {
    // ATTN_SM90_TILING (a measurement knob): 1 = wide, 2 = narrow, 3 = narrow for causal problems
    // of <= 1k queries only (the earlier rule); otherwise the cheaper by Sm90TilingCost (up to 64k
    // tiles: its walk is O(tiles / SMs) per candidate CTA), else the earlier rule.
    const int mode = Sm90EnvInt("ATTN_SM90_TILING", 0);
    bool narrow;
    if (mode == 1 || mode == 2) {
      narrow = mode == 2;
    } else if (mode == 3 || int64_t(params.max_seqlen_q / Narrow::kBlockM + 1) * params.num_heads *
                                         params.batch > (1 << 16)) {
      // Many tiles: quantisation is negligible, so only the causal diagonal's waste matters.
      narrow = params.has_right && params.max_seqlen_q <= kSm90NarrowMaxSeqlenQ;
    } else {
      narrow = Sm90TilingCost<Narrow>(params, sms) < Sm90TilingCost<Wide>(params, sms);
    }
    return narrow ? LaunchFlashFwdSm90<Narrow>(params, sms, stream)
                  : LaunchFlashFwdSm90<Wide>(params, sms, stream);
  }
}

}  // namespace attn::kernels::cuda
