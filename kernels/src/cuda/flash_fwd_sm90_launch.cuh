// Host side of the sm_90a forward kernel: its plan (the tiling by Sm90TilingCost, the row cut, L2
// groups and tile order, from host-known values: PlanFlashFwdSm90), TMA tensor maps (encoded
// through the driver entry point the runtime hands out, so nothing links libcuda) and the launch
// of a plan (RunFlashFwdSm90). Explicitly instantiated once per (dtype, head dim) and K/V layout in
// instantiations/flash_fwd_sm90_*.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "flash_fwd_sm90_kernel.cuh"
#include "flash_fwd_sm90_traits.cuh"
#include "func_attributes.cuh"
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

// The L2 groups of the cost-ordered schedule for a launch (Sm90L2GroupPairs); l2_mib as there.
inline int Sm90HbGroup(const FlashParams& p, int d, int l2_mib) {
  // K and V of one pair, in 16-bit elements; the heads of one KV head (GQA) share theirs.
  const int64_t kv_bytes = int64_t(p.max_seqlen_k) * d * 2 * 2 / std::max(1, p.heads_per_kv);
  return Sm90L2GroupPairs(p.num_heads * p.batch, kv_bytes, l2_mib);
}

// How a launch of the tiling Tr cuts its row blocks (Sm90RowCut): the three-warpgroup tilings with
// a narrow tail, but with a short head where the tiling trims its edge tiles (kTrimEdgeTiles) and
// the launch has a right (causal) edge; the others plainly. H200, d=64 causal, short head against
// narrow tail: +1.5-3.6% at 1k-2k sustained, +0.5-2% per clock. d=128's untrimmed wide tiling
// gained 0-4.6% at causal 2k-8k, but the estimate then chose it over the narrow tiling at causal
// 1k, where it ran 7% slower. `choice` (Sm90Choices::row_cut) overrides it for the
// three-warpgroup tilings.
template <typename Tr>
int Sm90RowCutFor(const FlashParams& p, int choice) {
  if (Tr::kConsumerWGs != 3) return kSm90CutPlain;
  if (choice >= kSm90CutPlain && choice <= kSm90CutShortHead) return choice;
  return Tr::kTrimEdgeTiles && p.has_right ? kSm90CutShortHead : kSm90CutNarrowTail;
}

// The launch of the tiling Tr for p: its row cut, L2 groups and tile order. The CTAs take tiles
// from the counter as they finish (Sm90Schedule), given a counter, for the cost-ordered (causal
// or right-windowed) schedule, and for any schedule whose cut leaves blocks with a warpgroup
// sitting out, whose tiles differ in cost (a fixed round-robin over row-block-fastest tiles gives
// a CTA the same row block each round when the grid is a multiple of the row-block count: the
// narrow tail's time would go to waiting for the others).
template <typename Tr>
Sm90Launch Sm90LaunchOf(const FlashParams& p, const Sm90Choices& c, int sms) {
  Sm90Launch L;
  L.narrow = false;
  L.row_cut = Sm90RowCutFor<Tr>(p, c.row_cut);
  L.hb_group = Sm90HbGroup(p, Tr::kHeadDim, c.l2_group_mib);
  L.dynamic = Tr::kDynamicSchedule && (p.has_right || L.row_cut != kSm90CutPlain) && c.counter &&
              c.dynamic;
  const int m_blocks = (p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  L.l2_phases = Sm90PhasedOrder(m_blocks, L.dynamic && p.has_right, c.l2_phases);
  L.tma_o = c.tma_o;
  L.sms = sms;
  return L;
}

// One launch of the tiling Tr as L says (Sm90LaunchOf). L.dynamic needs params.tile_counter (4
// bytes of the caller's workspace, zeroed here); without one the tiles keep the fixed order.
template <typename Tr>
cudaError_t LaunchFlashFwdSm90(const FlashParams& params, const Sm90Launch& L, cudaStream_t stream) {
  using T = typename Tr::T;
  constexpr int D = Tr::kHeadDim;
  Sm90Params P;
  P.p = params;
  const int m_blocks = (params.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  P.hb_group = L.hb_group;
  P.tile_counter = L.dynamic ? params.tile_counter : nullptr;
  P.l2_phases = L.l2_phases && P.tile_counter != nullptr;
  P.row_cut = Tr::kConsumerWGs == 3 ? L.row_cut : int(kSm90CutPlain);
  if (P.tile_counter != nullptr) {
    const cudaError_t zero = cudaMemsetAsync(P.tile_counter, 0, sizeof(unsigned int), stream);
    if (zero != cudaSuccess) return zero;
  }
  // O through shared memory and TMA stores where its rows are 16-byte aligned, else (or with
  // L.tma_o off: on the H200 5-15% slower at s <= 1k) from registers.
  P.tma_o = L.tma_o && reinterpret_cast<uintptr_t>(params.o) % 16 == 0 && params.o_row_stride % 8 == 0 &&
            EncodeRowsMap<T, D>(&P.to, params.o, params.total_q, params.num_heads, 64,
                                params.o_row_stride, 1);
  // Tr::kPaged: a chunk of rows of one page per box, slab by slab (Sm90ProducePaged), over the
  // pools' rows.
  const int kv_box_rows = Tr::kPaged ? Sm90PagedBoxRows(params.page_size, Tr::kBlockN) : Tr::kBlockN;
  constexpr int kKvBoxSlabs = Tr::kPaged ? 1 : D / 64;
  const int kv_rows = Tr::kPaged ? std::max(1, params.total_k) : params.total_k;
  P.kv_box_rows = kv_box_rows;
  if (!EncodeRowsMap<T, D>(&P.tq, params.q, params.total_q, params.num_heads, Tr::kBlockM) ||
      !EncodeRowsMap<T, D>(&P.tk, params.k, kv_rows, params.num_kv_heads, kv_box_rows, 0,
                           kKvBoxSlabs) ||
      !EncodeRowsMap<T, D>(&P.tv, params.v, kv_rows, params.num_kv_heads, kv_box_rows, 0,
                           kKvBoxSlabs)) {
    return cudaErrorInvalidValue;
  }
  constexpr auto kernel = &FlashFwdSm90Kernel<Tr>;
  if (const cudaError_t err = SetSharedMemoryOnce<kernel>(Tr::kSmemAlloc, false); err != cudaSuccess) {
    return err;
  }
  // Persistent: one CTA per SM (or per tile when there are fewer), each looping over tiles.
  const int64_t tiles = int64_t(m_blocks) * params.num_heads * params.batch;
  if (tiles == 0) return cudaSuccess;
  const int grid = static_cast<int>(tiles < L.sms ? tiles : L.sms);
  kernel<<<grid, Tr::kThreads, Tr::kSmemAlloc, stream>>>(P);
  return cudaGetLastError();
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
double Sm90TilingCost(const FlashParams& p, const Sm90Launch& L) {
  constexpr double kFixedPerTile = 0.5;  // key tiles
  constexpr double kNarrowRowCost = 1.15;  // H200, s = 2k non-causal: 1.15-1.18
  // H200, bf16, s = 1k, d=64/128: what the narrow tail's gain non-causal implies (5-10%); at 1.15
  // the estimate chose the wide tiling for causal 1k, 5-9% slower than the narrow one.
  constexpr double kSitOutRowCost = 1.4;
  constexpr double kHalfTileCost = 0.5;
  // Only the fixed snake is walked below, and it never runs in phases.
  const Sm90Schedule sched{(p.max_seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, p.num_heads, p.batch,
                           p.has_right, L.hb_group, false};
  const int m_blocks = sched.m_blocks;
  const int64_t tiles = sched.Total();
  const int grid = int(std::min<int64_t>(tiles, L.sms));
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
  const int cut = Tr::kConsumerWGs == 3 ? L.row_cut : int(kSm90CutPlain);
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
  if (L.dynamic) {  // to the first free CTA (longest first if causal): the average
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

// The plan of a launch on the tiling Wide or Narrow of one head dim (c.tiling: 0 the rule below,
// 1 wide, 2 narrow, 3 narrow for causal problems of <= 1k queries, the earlier rule).
//  - d=256 (both tilings of 128 rows): 80-key tiles but for short causal problems.
//  - d=64/128: the cheaper by Sm90TilingCost. With a tile counter that estimate costs O(row
//    blocks); without one, a causal launch's walks the snake, O(tiles / SMs) per candidate CTA, so
//    past 64k tiles the earlier rule decides (quantisation is negligible there, so only the causal
//    diagonal's waste matters).
template <typename Wide, typename Narrow>
Sm90Launch PlanFlashFwdSm90Tilings(const FlashParams& p, const Sm90Choices& c, int sms) {
  const Sm90Launch wide = Sm90LaunchOf<Wide>(p, c, sms);
  const Sm90Launch narrow = Sm90LaunchOf<Narrow>(p, c, sms);
  const bool short_causal = p.has_right && p.max_seqlen_q <= kSm90NarrowMaxSeqlenQ;
  bool use_narrow;
  if constexpr (Wide::kBlockM == Narrow::kBlockM) {
    use_narrow = c.tiling == 2 || (c.tiling != 1 && short_causal);
  } else if (c.tiling == 1 || c.tiling == 2) {
    use_narrow = c.tiling == 2;
  } else if (c.tiling == 3 ||
             (!c.counter &&
              int64_t(p.max_seqlen_q / Narrow::kBlockM + 1) * p.num_heads * p.batch > (1 << 16))) {
    use_narrow = short_causal;
  } else {
    use_narrow = Sm90TilingCost<Narrow>(p, narrow) < Sm90TilingCost<Wide>(p, wide);
  }
  Sm90Launch L = use_narrow ? narrow : wide;
  L.narrow = use_narrow;
  return L;
}

template <typename Wide, typename Narrow>
cudaError_t RunFlashFwdSm90Tilings(const FlashParams& params, const Sm90Launch& L, cudaStream_t stream) {
  return L.narrow ? LaunchFlashFwdSm90<Narrow>(params, L, stream)
                  : LaunchFlashFwdSm90<Wide>(params, L, stream);
}

// Contiguous K/V: launches with a causal or window mask run their own wide tiling
// (Sm90MaskedWideTraits).
template <typename T, int D>
Sm90Launch PlanFlashFwdSm90(const FlashParams& params, const Sm90Choices& choices, int sms) {
  if (params.has_left || params.has_right) {
    return PlanFlashFwdSm90Tilings<Sm90MaskedWideTraits<D, T>, Sm90NarrowTraits<D, T>>(params, choices,
                                                                                     sms);
  }
  return PlanFlashFwdSm90Tilings<Sm90WideTraits<D, T>, Sm90NarrowTraits<D, T>>(params, choices, sms);
}

template <typename T, int D>
cudaError_t RunFlashFwdSm90(const FlashParams& params, const Sm90Launch& launch, cudaStream_t stream) {
  if (params.has_left || params.has_right) {
    return RunFlashFwdSm90Tilings<Sm90MaskedWideTraits<D, T>, Sm90NarrowTraits<D, T>>(params, launch,
                                                                                    stream);
  }
  return RunFlashFwdSm90Tilings<Sm90WideTraits<D, T>, Sm90NarrowTraits<D, T>>(params, launch, stream);
}

// Paged K/V: the masked launches' two tilings serve every launch (chunked prefill and steps over
// a cache are causal; an unmasked paged launch runs d=64's trimmed wide tiling, whose trim then
// skips nothing), two kernels per (dtype, head dim) instead of three.
template <typename T, int D>
using Sm90PagedWide = Sm90PagedTraits<Sm90MaskedWideTraits<D, T>>;
template <typename T, int D>
using Sm90PagedNarrow = Sm90PagedTraits<Sm90NarrowTraits<D, T>>;

template <typename T, int D>
Sm90Launch PlanFlashFwdSm90Paged(const FlashParams& params, const Sm90Choices& choices, int sms) {
  return PlanFlashFwdSm90Tilings<Sm90PagedWide<T, D>, Sm90PagedNarrow<T, D>>(params, choices, sms);
}

template <typename T, int D>
cudaError_t RunFlashFwdSm90Paged(const FlashParams& params, const Sm90Launch& launch, cudaStream_t stream) {
  return RunFlashFwdSm90Tilings<Sm90PagedWide<T, D>, Sm90PagedNarrow<T, D>>(params, launch, stream);
}

}  // namespace attn::kernels::cuda
