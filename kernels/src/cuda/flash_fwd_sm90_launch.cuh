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

// The L2 groups and phases of the cost-ordered schedule for a launch (Sm90L2GroupPairs,
// Sm90PhasedOrder), with the measurement knobs ATTN_SM90_L2_MB and ATTN_SM90_L2_PHASES.
inline int Sm90HbGroup(const FlashParams& p, int d) {
  // K and V of one pair, in 16-bit elements; the heads of one KV head (GQA) share theirs.
  const int64_t kv_bytes = int64_t(p.max_seqlen_k) * d * 2 * 2 / std::max(1, p.heads_per_kv);
  return Sm90L2GroupPairs(p.num_heads * p.batch, kv_bytes, Sm90EnvInt("ATTN_SM90_L2_MB", -1));
}
inline bool Sm90Phased(int m_blocks, bool counter) {
  return Sm90PhasedOrder(m_blocks, counter, Sm90EnvInt("ATTN_SM90_L2_PHASES", -1));
}

// How a launch of the tiling Tr cuts its row blocks (Sm90RowCut): the three-warpgroup tilings with
// a narrow tail, but with a short head where the tiling trims its edge tiles (kTrimEdgeTiles) and
// the launch has a right (causal) edge; the others plainly. H200, d=64 causal, short head against
// narrow tail: +1.5-3.6% at 1k-2k sustained, +0.5-2% per clock. d=128's untrimmed wide tiling
// gained 0-4.6% at causal 2k-8k, but the estimate then chose it over the narrow tiling at causal
// 1k, where it ran 7% slower. ATTN_SM90_ROW_CUT (a measurement knob: 0 plain, 1 narrow tail, 2
// short head) overrides it for the three-warpgroup tilings.
template <typename Tr>
int Sm90RowCutFor(const FlashParams& p) {
  if (Tr::kConsumerWGs != 3 || Tr::kClusterKV) return kSm90CutPlain;
  const int knob = Sm90EnvInt("ATTN_SM90_ROW_CUT", -1);
  if (knob >= kSm90CutPlain && knob <= kSm90CutShortHead) return knob;
  return Tr::kTrimEdgeTiles && p.has_right ? kSm90CutShortHead : kSm90CutNarrowTail;
}

// Whether the CTAs take tiles from the counter as they finish (Sm90Schedule), given a counter: for
// the cost-ordered (causal or right-windowed) schedule, and for any schedule whose cut leaves
// blocks with a warpgroup sitting out, whose tiles differ in cost (a fixed round-robin over
// row-block-fastest tiles gives a CTA the same row block each round when the grid is a multiple
// of the row-block count: the narrow tail's time would go to waiting for the others).
// ATTN_SM90_DYNAMIC=0 (a measurement knob) keeps the fixed order.
template <typename Tr>
bool Sm90DynamicSchedule(const FlashParams& p) {
  return Tr::kDynamicSchedule && !Tr::kClusterKV &&
         (p.has_right || Sm90RowCutFor<Tr>(p) != kSm90CutPlain) && p.tile_counter != nullptr &&
         Sm90EnvInt("ATTN_SM90_DYNAMIC", 1) != 0;
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
  const int m_blocks = (params.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  P.hb_group = Sm90HbGroup(params, D);
  P.tile_counter = Sm90DynamicSchedule<Tr>(params) ? params.tile_counter : nullptr;
  P.l2_phases = Sm90Phased(m_blocks, P.tile_counter != nullptr && params.has_right);
  P.row_cut = Sm90RowCutFor<Tr>(params);
  if (P.tile_counter != nullptr) {
    const cudaError_t zero = cudaMemsetAsync(P.tile_counter, 0, sizeof(unsigned int), stream);
    if (zero != cudaSuccess) return zero;
  }
  // O through shared memory and TMA stores (needs 16-byte aligned rows); ATTN_SM90_TMA_O=0 stores
  // from registers instead (a measurement knob: on the H200 that is 5-15% slower at s <= 1k).
  P.tma_o = Sm90EnvInt("ATTN_SM90_TMA_O", 1) != 0 && reinterpret_cast<uintptr_t>(params.o) % 16 == 0 &&
            params.o_row_stride % 8 == 0 &&
            EncodeRowsMap<T, D>(&P.to, params.o, params.total_q, params.num_heads, 64,
                                params.o_row_stride, 1);
  // Tr::kClusterKV: each CTA loads half a K/V tile, slab by slab (Sm90LoadHalfKV). Tr::kPaged: a
  // chunk of rows of one page per box, slab by slab (Sm90ProducePaged), over the pools' rows.
  const int kv_box_rows = Tr::kPaged       ? Sm90PagedBoxRows(params.page_size, Tr::kBlockN)
                          : Tr::kClusterKV ? Tr::kBlockN / 2
                                           : Tr::kBlockN;
  constexpr int kKvBoxSlabs = Tr::kClusterKV || Tr::kPaged ? 1 : D / 64;
  const int kv_rows = Tr::kPaged ? std::max(1, params.total_k) : params.total_k;
  P.kv_box_rows = kv_box_rows;
  if (!EncodeRowsMap<T, D>(&P.tq, params.q, params.total_q, params.num_heads, Tr::kBlockM) ||
      !EncodeRowsMap<T, D>(&P.tk, params.k, kv_rows, params.num_kv_heads, kv_box_rows, 0,
                           kKvBoxSlabs) ||
      !EncodeRowsMap<T, D>(&P.tv, params.v, kv_rows, params.num_kv_heads, kv_box_rows, 0,
                           kKvBoxSlabs)) {
    return cudaErrorInvalidValue;
  }
  auto kernel = &FlashFwdSm90Kernel<Tr>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemAlloc);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM (or per tile when there are fewer), each looping over tiles.
  const int64_t tiles = int64_t(m_blocks) * params.num_heads * params.batch;
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
// the tiles (the key tiles each warpgroup computes, plus a fixed cost per tile for its pipeline
// fill and epilogue) dealt to the persistent CTAs as the kernel deals them (Sm90Schedule), the
// busiest CTA's sum. Rows of the tile past the sequence end still cost (but for a warpgroup that
// sits a tile out under a narrow tail or short head), and so do the key tiles beyond a
// warpgroup's causal or window edge unless the tiling trims them (kTrimEdgeTiles: skipped, and a
// half-width edge tile costs kHalfTileCost); a row of the narrow (2-warpgroup) tiling costs
// kNarrowRowCost times a wide one (its softmax is hidden behind one other warpgroup's products
// instead of two), and a row of a wide tile that one warpgroup sits out kSitOutRowCost (the wide
// tiling's consumers have fewer registers, and spill at d=128).
template <typename Tr>
double Sm90TilingCost(const FlashParams& p, int sms) {
  constexpr double kFixedPerTile = 0.5;  // key tiles
  constexpr double kNarrowRowCost = 1.15;  // H200, s = 2k non-causal: 1.15-1.18
  // H200, bf16, s = 1k, d=64/128: what the narrow tail's gain non-causal implies (5-10%); at 1.15
  // the estimate chose the wide tiling for causal 1k, 5-9% slower than the narrow one.
  constexpr double kSitOutRowCost = 1.4;
  constexpr double kHalfTileCost = 0.5;
  // Only the fixed snake is walked below, and it never runs in phases.
  const Sm90Schedule sched{(p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, p.num_heads, p.batch,
                           p.has_right, Sm90HbGroup(p, Tr::kHeadDim), false};
  const int m_blocks = sched.m_blocks;
  const int64_t tiles = sched.Total();
  const int grid = int(std::min<int64_t>(tiles, sms));
  const int off = p.max_seqlen_k - p.max_seqlen_q;
  // Key tiles seen by query rows [first, last] (none when first > last).
  // Past the last key query row `last` may see.
  auto key_end = [&](int last) {
    return p.has_right ? std::min(p.max_seqlen_k, last + off + p.right + 1) : p.max_seqlen_k;
  };
  auto key_tiles = [&](int first, int last) {
    if (first > last) return 0;
    const int lo = p.has_left ? std::max(0, first + off - p.left) : 0;
    const int hi = key_end(last);
    return hi > lo ? (hi + Tr::kBlockN - 1) / Tr::kBlockN - lo / Tr::kBlockN : 0;
  };
  const int cut = Sm90RowCutFor<Tr>(p);
  auto tile_cost = [&](int m) {
    int m0 = 0, m_end = 0;
    if (!Sm90RowBlock(m, p.max_seqlen_q, Tr::kBlockM, cut, &m0, &m_end)) return 0.0;
    double sum = 0.0;
    // The warpgroups that compute (the others sit the tile out).
    const int wgs =
        cut != kSm90CutPlain ? std::min(Tr::kConsumerWGs, (m_end - m0 + 63) / 64) : Tr::kConsumerWGs;
    if constexpr (Tr::kTrimEdgeTiles) {  // rows past the end compute the CTA's key tiles
      const int all = key_tiles(m0, m_end - 1);
      for (int w = 0; w < wgs; ++w) {
        const int first = m0 + 64 * w;
        if (first >= m_end) {
          sum += all + kFixedPerTile;
          continue;
        }
        const int last = std::min(first + 63, m_end - 1);
        const int tiles = key_tiles(first, last);
        // Whether the last key this warpgroup's rows may see lies in its tile's first half.
        const bool half = tiles > 0 && (key_end(last) - 1) % Tr::kBlockN < Tr::kBlockN / 2;
        sum += tiles - (half ? 1.0 - kHalfTileCost : 0.0) + kFixedPerTile;
      }
    } else {
      sum = (key_tiles(m0, m_end - 1) + kFixedPerTile) * wgs;
    }
    const double row_cost =
        Tr::kConsumerWGs == 2 ? kNarrowRowCost : (wgs < Tr::kConsumerWGs ? kSitOutRowCost : 1.0);
    return sum * row_cost * Tr::kBlockN / 128;
  };
  if (Sm90DynamicSchedule<Tr>(p)) {  // to the first free CTA (longest first if causal): the average
    double sum = 0.0;
    for (int m = 0; m < m_blocks; ++m) sum += tile_cost(m);
    return sum * double(p.num_heads) * p.batch / grid;
  }
  if (!p.has_right) {  // equal tiles but the last row block (a left window: near-equal), round-robin
    const int64_t rounds = (tiles + grid - 1) / grid;
    return double(rounds) * std::max(tile_cost(m_blocks - 1), tile_cost(std::max(0, m_blocks - 2)));
  }
  // Longest first in a snake. The busiest CTA is looked for among a few (the ends, the quarters,
  // and those next to the last round's edge), each walked over its rounds, so the estimate costs
  // O(rounds), not O(tiles).
  const int rem = int(tiles % grid);
  const int cand[] = {0, 1, grid / 4, grid / 2, 3 * grid / 4, grid - 2, grid - 1,
                      rem - 1, rem, grid - 1 - rem, grid - rem};
  double busiest = 0.0;
  for (const int c : cand) {
    if (c < 0 || c >= grid) continue;
    double sum = 0.0;
    for (int r = 0; int64_t(r) * grid < tiles; ++r) {
      const int j = sched.Tile(r, c, grid);
      if (j >= tiles) continue;
      int m, h, b;
      sched.Decode(j, &m, &h, &b);
      sum += tile_cost(m);
    }
    busiest = std::max(busiest, sum);
  }
  return busiest;
}

// One launch on the tiling Wide or Narrow of one head dim.
template <typename Wide, typename Narrow>
cudaError_t RunFlashFwdSm90Tilings(const FlashParams& params, cudaStream_t stream) {
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
    // of <= 1k queries only (the earlier rule); otherwise the cheaper by Sm90TilingCost. With a
    // tile counter that estimate costs O(row blocks); without one, a causal launch's walks the
    // snake, O(tiles / SMs) per candidate CTA, so past 64k tiles the earlier rule decides.
    const int mode = Sm90EnvInt("ATTN_SM90_TILING", 0);
    bool narrow;
    if (mode == 1 || mode == 2) {
      narrow = mode == 2;
    } else if (mode == 3 || (params.tile_counter == nullptr &&
                             int64_t(params.max_seqlen_q / Narrow::kBlockM + 1) * params.num_heads *
                                     params.batch > (1 << 16))) {
      // Many tiles: quantisation is negligible, so only the causal diagonal's waste matters.
      narrow = params.has_right && params.max_seqlen_q <= kSm90NarrowMaxSeqlenQ;
    } else {
      narrow = Sm90TilingCost<Narrow>(params, sms) < Sm90TilingCost<Wide>(params, sms);
    }
    return narrow ? LaunchFlashFwdSm90<Narrow>(params, sms, stream)
                  : LaunchFlashFwdSm90<Wide>(params, sms, stream);
  }
}

template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, cudaStream_t stream) {
  if (params.has_left || params.has_right) {
    return RunFlashFwdSm90Tilings<Sm90MaskedWideTraits<D, T>, Sm90NarrowTraits<D, T>>(params, stream);
  }
  return RunFlashFwdSm90Tilings<Sm90WideTraits<D, T>, Sm90NarrowTraits<D, T>>(params, stream);
}

// Paged K/V: the masked launches' two tilings serve every launch (chunked prefill and steps over
// a cache are causal; an unmasked paged launch runs d=64's trimmed wide tiling, whose trim then
// skips nothing), two kernels per (dtype, head dim) instead of three.
template <typename T, int D>
cudaError_t RunFlashFwdSm90Paged(const FlashParams& params, cudaStream_t stream) {
  return RunFlashFwdSm90Tilings<Sm90PagedTraits<Sm90MaskedWideTraits<D, T>>,
                                Sm90PagedTraits<Sm90NarrowTraits<D, T>>>(params, stream);
}

}  // namespace attn::kernels::cuda
