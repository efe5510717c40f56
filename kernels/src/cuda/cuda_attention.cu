// The one runtime-to-template dispatch of the CUDA backend, for the (dtype, head dim) pairs
// compiled into this build (ATTN_HDIM_<d>). MakePlan decides, from host-known values:
//   max_seqlen_q <= kDecodeMaxSeqlenQ: the split-KV decode kernel (contiguous or paged K/V; FP8
//     K/V: its FP8 variant, RunDecodeFp8), with its row blocks and splits (PlanDecode);
//   otherwise: generation 2 (sm_90a, where CanImplementGen2 holds; ATTN_SM90_HDIM_<d>), with its
//     tiling and tile order (PlanFlashFwdSm90[Paged]<T, D>), else generation 1; FP8 K/V: the
//     same choice on the 16-bit K/V that Run first converts them to in the workspace
//     (PlanFp8Forward, fp8_dequant.h).
// Run turns AttentionArgs into the kernel's parameters (FlashParams, DecodeParams) and launches
// RunDecode<T, D>, RunFlashFwdSm90[Paged]<T, D> or RunFlashFwd[Paged]<T, D> as the plan says.
#include "attn/kernels/cuda_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <mutex>
#include <string>

#include "decode_params.h"
#include "decode_plan.h"
#include "flash_fwd_sm90_fp8_layout.h"
#include "flash_params.h"
#include "fp8_dequant.h"

namespace attn::kernels::cuda {
namespace {

constexpr int kCompiledHeadDims[] = {
#ifdef ATTN_HDIM_32
    32,
#endif
#ifdef ATTN_HDIM_64
    64,
#endif
#ifdef ATTN_HDIM_96
    96,
#endif
#ifdef ATTN_HDIM_128
    128,
#endif
#ifdef ATTN_HDIM_256
    256,
#endif
    0,  // sentinel, not counted
};
constexpr int kNumCompiledHeadDims = sizeof(kCompiledHeadDims) / sizeof(int) - 1;

bool HeadDimCompiled(int d) {
  for (int i = 0; i < kNumCompiledHeadDims; ++i) {
    if (kCompiledHeadDims[i] == d) return true;
  }
  return false;
}

int Log2IfPow2(int x) {
  if (x <= 0 || (x & (x - 1)) != 0) return -1;
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

// The parameters every kernel reads, from the call's arguments.
void MakeAttentionParams(const AttentionArgs& a, AttentionParams* out) {
  AttentionParams& p = *out;
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.o = a.o;
  p.lse = a.lse;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.cu_seqlens_k = a.cu_seqlens_k;
  if (IsPaged(a)) {
    p.page_indptr = a.paged.page_indptr;
    p.page_indices = a.paged.page_indices;
    p.seqlens_k = a.paged.seqlens_k;
    p.page_size = a.paged.page_size;
    p.page_shift = Log2IfPow2(a.paged.page_size);
  }
  p.batch = a.batch;
  p.total_q = a.total_q;
  // Paged K/V: rows of each page pool, < 2^31 (CanImplement).
  p.total_k = IsPaged(a) ? a.paged.num_pages * a.paged.page_size : a.total_k;
  p.max_seqlen_q = a.max_seqlen_q;
  p.max_seqlen_k = a.max_seqlen_k;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.head_dim = a.head_dim;
  p.heads_per_kv = a.num_heads / a.num_kv_heads;
  p.q_row_stride = int64_t(a.num_heads) * a.head_dim;
  p.o_row_stride = p.q_row_stride;
  p.k_row_stride = int64_t(a.num_kv_heads) * a.head_dim;
  p.v_row_stride = p.k_row_stride;
  p.scale = EffectiveSoftmaxScale(a);
  p.scale_log2 = p.scale * 1.4426950408889634f;
  // Windows wide enough to never cut anything are dropped (this also keeps the kernel's
  // index arithmetic far from int32 overflow). Query i sits at p = i + s_k - s_q, with
  // -max_seqlen_q <= p < max_seqlen_k.
  const int64_t span = int64_t(a.max_seqlen_q) + a.max_seqlen_k;
  if (a.window_left >= 0 && a.window_left < span) {
    p.has_left = true;
    p.left = a.window_left;
  }
  int64_t right = -1;
  if (a.window_right >= 0) right = a.window_right;
  if (a.causal) right = right >= 0 ? std::min<int64_t>(right, 0) : 0;
  if (right >= 0 && right < span) {
    p.has_right = true;
    p.right = static_cast<int32_t>(right);
  }
  p.k_descale = a.kv_scales.k;
  p.v_descale = a.kv_scales.v;
}

FlashParams MakeParams(const AttentionArgs& a) {
  FlashParams p;
  MakeAttentionParams(a, &p);
  return p;
}

// Per-device facts the planner needs, read once per device.
struct DeviceInfo {
  int sms = 0;
  int major = 0;
  int minor = 0;
};

bool GetDeviceInfo(DeviceInfo* out) {
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static DeviceInfo cache[kMaxDevices];
  static bool have[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < kMaxDevices && have[dev]) {
    *out = cache[dev];
    return true;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return false;
  DeviceInfo info;
  info.sms = prop.multiProcessorCount;
  info.major = prop.major;
  info.minor = prop.minor;
  if (dev < kMaxDevices) {
    cache[dev] = info;
    have[dev] = true;
  }
  *out = info;
  return true;
}

size_t AlignTo256(size_t n) { return (n + 255) / 256 * 256; }

// The decode kernel's plan for args (max_seqlen_q <= kDecodeMaxSeqlenQ), from host-known values
// only (batch, heads, max lengths, the SM count): its row blocks and KV splits (DecodeSplits, of
// the 16-bit or the FP8 kernel's tiles and occupancy), and the workspace the splits need.
// PlanOptions::decode_splits > 0 overrides the rule; decode_fused_combine puts the split counters
// at the workspace's start.
void PlanDecode(const AttentionArgs& a, const PlanOptions& options, Plan* plan) {
  const int forced_splits = options.decode_splits;
  plan->kernel = Plan::Kernel::kDecode;
  const int group = a.num_heads / a.num_kv_heads;
  plan->decode_m_blocks =
      static_cast<int>((int64_t(a.max_seqlen_q) * group + kDecodeRows - 1) / kDecodeRows);
  plan->decode_splits = 1;
  plan->decode_fused_combine = false;
  plan->decode_counter_bytes = 0;
  plan->workspace_bytes = 0;
  DeviceInfo info;
  if (!GetDeviceInfo(&info)) return;  // Run reports the device error at launch
  plan->decode_pdl = info.major >= 9;
  const bool fp8 = IsFp8Kv(a);
  DecodeSplitShape shape;
  shape.batch = a.batch;
  shape.num_kv_heads = a.num_kv_heads;
  shape.m_blocks = plan->decode_m_blocks;
  shape.max_seqlen_k = a.max_seqlen_k;
  shape.warp_n = fp8 ? DecodeFp8WarpN(a.head_dim) : DecodeWarpN(a.head_dim);
  shape.warps = kDecodeWarps;
  shape.ctas_per_sm = fp8 ? DecodeFp8MinBlocks(a.head_dim) : DecodeMinBlocks(a.head_dim);
  shape.sms = info.sms;
  shape.max_splits = kDecodeMaxSplits;
  int splits = DecodeSplits(shape);
  if (forced_splits > 0) splits = std::min(forced_splits, kDecodeMaxSplits);
  plan->decode_splits = splits;
  if (splits > 1) {
    const size_t rows = size_t(a.total_q) * a.num_heads;
    if (options.decode_fused_combine) {
      plan->decode_fused_combine = true;
      const size_t groups = size_t(a.batch) * a.num_kv_heads * plan->decode_m_blocks;
      plan->decode_counter_bytes = AlignTo256(groups * sizeof(uint32_t));
    }
    plan->workspace_bytes = plan->decode_counter_bytes +
                            size_t(splits) * rows * (size_t(a.head_dim) + 1) * sizeof(float);
  }
}

DecodeParams MakeDecodeParams(const AttentionArgs& a, const Plan& plan, void* workspace) {
  DecodeParams p;
  MakeAttentionParams(a, &p);
  p.append_k = a.paged.append_k;
  p.append_v = a.paged.append_v;
  p.m_blocks = plan.decode_m_blocks;
  p.num_splits = plan.decode_splits;
  if (plan.decode_splits > 1) {
    const size_t rows = size_t(a.total_q) * a.num_heads;
    char* ws = static_cast<char*>(workspace);
    if (plan.decode_fused_combine) p.split_counters = reinterpret_cast<uint32_t*>(ws);
    p.part_o = reinterpret_cast<float*>(ws + plan.decode_counter_bytes);
    p.part_lse = p.part_o + size_t(plan.decode_splits) * rows * a.head_dim;
  }
  p.pdl = plan.decode_pdl;
  return p;
}

template <typename T>
cudaError_t RunTyped(const FlashParams& p, bool paged, cudaStream_t stream) {
  switch (p.head_dim) {
#define ATTN_FWD_CASE(D) \
  case D: return paged ? RunFlashFwdPaged<T, D>(p, stream) : RunFlashFwd<T, D>(p, stream);
#ifdef ATTN_HDIM_32
    ATTN_FWD_CASE(32)
#endif
#ifdef ATTN_HDIM_64
    ATTN_FWD_CASE(64)
#endif
#ifdef ATTN_HDIM_96
    ATTN_FWD_CASE(96)
#endif
#ifdef ATTN_HDIM_128
    ATTN_FWD_CASE(128)
#endif
#ifdef ATTN_HDIM_256
    ATTN_FWD_CASE(256)
#endif
#undef ATTN_FWD_CASE
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
Sm90Launch PlanSm90Typed(const FlashParams& p, const Sm90Choices& c, int sms, bool paged) {
  switch (p.head_dim) {
#define ATTN_SM90_CASE(D)                                                   \
  case D:                                                                   \
    return paged ? PlanFlashFwdSm90Paged<T, D>(p, c, sms) : PlanFlashFwdSm90<T, D>(p, c, sms);
#ifdef ATTN_SM90_HDIM_64
    ATTN_SM90_CASE(64)
#endif
#ifdef ATTN_SM90_HDIM_128
    ATTN_SM90_CASE(128)
#endif
#ifdef ATTN_SM90_HDIM_256
    ATTN_SM90_CASE(256)
#endif
#undef ATTN_SM90_CASE
    default: return Sm90Launch{};
  }
}

template <typename T>
cudaError_t RunSm90Typed(const FlashParams& p, const Sm90Launch& launch, bool paged,
                         cudaStream_t stream) {
  switch (p.head_dim) {
#define ATTN_SM90_CASE(D)                                                                \
  case D:                                                                                \
    return paged ? RunFlashFwdSm90Paged<T, D>(p, launch, stream) : RunFlashFwdSm90<T, D>(p, launch, stream);
#ifdef ATTN_SM90_HDIM_64
    ATTN_SM90_CASE(64)
#endif
#ifdef ATTN_SM90_HDIM_128
    ATTN_SM90_CASE(128)
#endif
#ifdef ATTN_SM90_HDIM_256
    ATTN_SM90_CASE(256)
#endif
#undef ATTN_SM90_CASE
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t RunDecodeFp8Typed(const DecodeParams& p, int head_dim, bool paged, cudaStream_t stream) {
  switch (head_dim) {
#ifdef ATTN_FP8_HDIM_64
    case 64: return RunDecodeFp8<T, 64>(p, paged, stream);
#endif
#ifdef ATTN_FP8_HDIM_128
    case 128: return RunDecodeFp8<T, 128>(p, paged, stream);
#endif
#ifdef ATTN_FP8_HDIM_256
    case 256: return RunDecodeFp8<T, 256>(p, paged, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

bool Fp8HeadDimCompiled(int d) {
  switch (d) {
#ifdef ATTN_FP8_HDIM_64
    case 64: return true;
#endif
#ifdef ATTN_FP8_HDIM_128
    case 128: return true;
#endif
#ifdef ATTN_FP8_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

bool Sm90HeadDimCompiled(int d) {
  switch (d) {
#ifdef ATTN_SM90_HDIM_64
    case 64: return true;
#endif
#ifdef ATTN_SM90_HDIM_128
    case 128: return true;
#endif
#ifdef ATTN_SM90_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T>
cudaError_t RunDecodeTyped(const DecodeParams& p, int head_dim, bool paged, cudaStream_t stream) {
  switch (head_dim) {
#ifdef ATTN_HDIM_32
    case 32: return RunDecode<T, 32>(p, paged, stream);
#endif
#ifdef ATTN_HDIM_64
    case 64: return RunDecode<T, 64>(p, paged, stream);
#endif
#ifdef ATTN_HDIM_96
    case 96: return RunDecode<T, 96>(p, paged, stream);
#endif
#ifdef ATTN_HDIM_128
    case 128: return RunDecode<T, 128>(p, paged, stream);
#endif
#ifdef ATTN_HDIM_256
    case 256: return RunDecode<T, 256>(p, paged, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

// Where Run puts what the FP8 forward path converts, inside the workspace (256-byte aligned
// parts): the forward kernel's own workspace, the paged sequences' row offsets, then K and V.
struct Fp8Workspace {
  size_t offsets = 0, k = 0, v = 0, bytes = 0;
};

int64_t Fp8KvRows(const AttentionArgs& a) {
  return IsPaged(a) ? int64_t(a.batch) * a.max_seqlen_k : a.total_k;
}

Fp8Workspace Fp8WorkspaceLayout(const AttentionArgs& a, size_t inner_bytes) {
  Fp8Workspace w;
  w.offsets = AlignTo256(inner_bytes);
  const size_t offsets_bytes = IsPaged(a) ? sizeof(int32_t) * (size_t(a.batch) + 1) : 0;
  w.k = w.offsets + AlignTo256(offsets_bytes);
  const size_t kv_bytes =
      size_t(Fp8KvRows(a)) * a.num_kv_heads * a.head_dim * DTypeSize(a.dtype);
  w.v = w.k + AlignTo256(kv_bytes);
  w.bytes = w.v + AlignTo256(kv_bytes);
  return w;
}

// The 16-bit arguments the forward kernel runs on after the conversion of FP8 K/V: contiguous
// K/V in the workspace at the sequences' offsets. workspace null: placeholders, for planning
// (aligned, never read).
AttentionArgs Fp8InnerArgs(const AttentionArgs& a, char* workspace) {
  AttentionArgs in = a;
  in.kv_dtype.reset();
  in.kv_scales = {};
  in.paged = PagedKv{};
  in.total_k = static_cast<int32_t>(Fp8KvRows(a));
  if (workspace == nullptr) {
    static const char* const kPlaceholder = reinterpret_cast<const char*>(uintptr_t{256});
    in.k = kPlaceholder;
    in.v = kPlaceholder;
    if (IsPaged(a)) in.cu_seqlens_k = reinterpret_cast<const int32_t*>(kPlaceholder);
    return in;
  }
  const Fp8Workspace w = Fp8WorkspaceLayout(a, 0);  // offsets relative to the conversion's part
  in.k = workspace + w.k;
  in.v = workspace + w.v;
  if (IsPaged(a)) in.cu_seqlens_k = reinterpret_cast<const int32_t*>(workspace + w.offsets);
  return in;
}

// Where Run puts what the FP8 tensor-core path (Plan::Kernel::kFp8TensorCores) writes, inside the
// workspace (256-byte aligned parts): q's codes and its per-(sequence, KV head) amax and scales;
// paged K/V: the sequences' row offsets and K's and V's codes gathered into rows; then Vt.
struct Fp8TcWorkspace {
  size_t q = 0, amax = 0, q_scales = 0, offsets = 0, k = 0, v = 0, vt = 0, bytes = 0;
};

Fp8TcWorkspace Fp8TcWorkspaceLayout(const AttentionArgs& a) {
  Fp8TcWorkspace w;
  const size_t per_seq_head = sizeof(float) * size_t(a.batch) * a.num_kv_heads;
  const int64_t kv_rows = Fp8KvRows(a);
  const size_t kv_bytes = IsPaged(a) ? size_t(kv_rows) * a.num_kv_heads * a.head_dim : 0;
  w.q = 0;
  w.amax = w.q + AlignTo256(size_t(a.total_q) * a.num_heads * a.head_dim);
  w.q_scales = w.amax + AlignTo256(per_seq_head);
  w.offsets = w.q_scales + AlignTo256(per_seq_head);
  w.k = w.offsets + AlignTo256(IsPaged(a) ? sizeof(int32_t) * (size_t(a.batch) + 1) : 0);
  w.v = w.k + AlignTo256(kv_bytes);
  w.vt = w.v + AlignTo256(kv_bytes);
  w.bytes = w.vt + AlignTo256(size_t(Fp8VtBytes(kv_rows, a.batch, a.num_kv_heads, a.head_dim)));
  return w;
}

bool Fp8ForwardHeadDimCompiled(int d) {
  switch (d) {
#ifdef ATTN_SM90_FP8_FWD_HDIM_128
    case 128: return true;
#endif
#ifdef ATTN_SM90_FP8_FWD_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

template <typename T>
cudaError_t RunFp8AttentionTyped(const FlashParams& p, int head_dim, int tile_rows, int sms,
                                 cudaStream_t stream) {
  switch (head_dim) {
#ifdef ATTN_SM90_FP8_FWD_HDIM_128
    case 128: return RunFlashFwdSm90Fp8<T, 128>(p, tile_rows, sms, stream);
#endif
#ifdef ATTN_SM90_FP8_FWD_HDIM_256
    case 256: return RunFlashFwdSm90Fp8<T, 256>(p, tile_rows, sms, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool Compiled() { return true; }

Status CanImplement(const AttentionArgs& args) {
  Status s = ValidateCommon(args);
  if (!s.ok()) return s;
  if (IsPaged(args) && int64_t(args.paged.num_pages) * args.paged.page_size > INT32_MAX) {
    return {StatusCode::kInvalidArgument,
            "CUDA backend: paged.num_pages * paged.page_size must be < 2^31 (token rows per pool)"};
  }
  if (args.dtype != DType::kFloat16 && args.dtype != DType::kBFloat16) {
    return {StatusCode::kUnimplemented,
            std::string("CUDA backend: dtype ") + DTypeName(args.dtype) + " is not supported (fp16, bf16 only)"};
  }
  if (!HeadDimCompiled(args.head_dim)) {
    return {StatusCode::kUnimplemented,
            "CUDA backend: head_dim " + std::to_string(args.head_dim) + " is not compiled into this build"};
  }
  if (args.batch > 65535 || args.num_heads > 65535 || args.num_kv_heads > 65535) {
    return {StatusCode::kInvalidArgument, "CUDA backend: batch and num_heads must be <= 65535 (grid limit)"};
  }
  if (Appends(args.paged)) {
    if (args.max_seqlen_q > kDecodeMaxSeqlenQ) {
      return {StatusCode::kUnimplemented,
              "CUDA backend: paged.append_k and append_v are written by the decode kernel, for at "
              "most " + std::to_string(kDecodeMaxSeqlenQ) + " queries per sequence"};
    }
    if (reinterpret_cast<uintptr_t>(args.paged.append_k) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(args.paged.append_v) % 16 != 0) {
      return {StatusCode::kInvalidArgument,
              "CUDA backend: paged.append_k and append_v must be 16-byte aligned"};
    }
  }
  if (IsFp8Kv(args) && args.max_seqlen_q > kDecodeMaxSeqlenQ) {
    // The forward path: K/V converted to 16 bits into [batch * max_seqlen_k] rows (paged) or
    // [total_k] rows, then a forward kernel of this head dim.
    if (IsPaged(args) && int64_t(args.batch) * args.max_seqlen_k > INT32_MAX) {
      return {StatusCode::kInvalidArgument,
              "CUDA backend: float8_e4m3 paged k and v with more than " +
                  std::to_string(kDecodeMaxSeqlenQ) +
                  " queries per sequence need batch * max_seqlen_k < 2^31"};
    }
  } else if (IsFp8Kv(args)) {
    if (!Fp8HeadDimCompiled(args.head_dim)) {
      return {StatusCode::kUnimplemented, "CUDA backend: float8_e4m3 k and v with head_dim " +
                                              std::to_string(args.head_dim) +
                                              " are not compiled into this build (head dims 64, "
                                              "128, 256 of ATTN_HEAD_DIMS, for sm_90a)"};
    }
    DeviceInfo info;
    if (!GetDeviceInfo(&info) || info.major != 9 || info.minor != 0) {
      return {StatusCode::kUnimplemented,
              "CUDA backend: float8_e4m3 k and v with at most " +
                  std::to_string(kDecodeMaxSeqlenQ) +
                  " queries per sequence (the FP8 decode kernel) need a compute capability 9.0 "
                  "device (the kernel is compiled for sm_90a)"};
    }
  }
  return Status::Ok();
}

Status CanImplementGen2(const AttentionArgs& args) {
  Status s = CanImplement(args);
  if (!s.ok()) return s;
  // FP8 K/V: generation 2 runs on the 16-bit K/V they are converted to.
  if (IsFp8Kv(args)) return CanImplementGen2(Fp8InnerArgs(args, nullptr));
  if (!Sm90HeadDimCompiled(args.head_dim)) {
    return {StatusCode::kUnimplemented, "CUDA generation 2: head_dim " + std::to_string(args.head_dim) +
                                            " is not compiled for sm_90a in this build"};
  }
  // Paged K/V: each TMA box holds rows of one page, whole 1024-byte swizzle atoms (8 rows).
  if (IsPaged(args) && args.paged.page_size % 8 != 0) {
    return {StatusCode::kUnimplemented, "CUDA generation 2: paged.page_size " +
                                            std::to_string(args.paged.page_size) +
                                            " is not a multiple of 8"};
  }
  // The persistent schedule numbers (64-row block, head, sequence) tiles in an int.
  if ((int64_t(args.max_seqlen_q) + 63) / 64 * args.num_heads * args.batch > INT32_MAX) {
    return {StatusCode::kUnimplemented, "CUDA generation 2: too many query tiles for one launch"};
  }
  if (!Aligned16(args.q) || !Aligned16(args.k) || !Aligned16(args.v)) {
    return {StatusCode::kUnimplemented, "CUDA generation 2: q, k and v must be 16-byte aligned (TMA)"};
  }
  DeviceInfo info;
  if (!GetDeviceInfo(&info) || info.major != 9 || info.minor != 0) {
    return {StatusCode::kUnimplemented, "CUDA generation 2: the device is not compute capability 9.0"};
  }
  return Status::Ok();
}

// Generation 2's workspace: its tile counter (FlashParams), where its plan takes tiles from one.
constexpr size_t kFwdWorkspaceBytes = 16;

// The FP8 tensor-core kernel's query tile rows: `forced` (PlanOptions::fp8_tile_rows) where the
// head dim has such tiles, else the FP8 tile rules (Fp8TileRows) for this device.
Status PlanFp8TileRows(const AttentionArgs& args, int forced, int* tile_rows) {
  if (forced != 0) {
    if (forced != 128 && !(forced == 192 && args.head_dim == 128)) {
      return {StatusCode::kInvalidArgument,
              "CUDA FP8 attention kernel: fp8_tile_rows " + std::to_string(forced) +
                  " (128, or 192 at head_dim 128)"};
    }
    *tile_rows = forced;
    return Status::Ok();
  }
  DeviceInfo info;
  if (!GetDeviceInfo(&info)) {
    return {StatusCode::kInternal, "CUDA backend: cannot read the device's properties"};
  }
  *tile_rows = Fp8TileRows(args.head_dim, args.max_seqlen_q, args.num_heads, args.batch, info.sms);
  return Status::Ok();
}

Status MakePlan(const AttentionArgs& args, const PlanOptions& options, Plan* plan) {
  Status s = CanImplement(args);
  if (!s.ok()) return s;
  Plan p;
  p.paged = IsPaged(args);
  if (options.generation == FwdGeneration::kAuto && args.max_seqlen_q <= kDecodeMaxSeqlenQ) {
    PlanDecode(args, options, &p);
    *plan = p;
    return Status::Ok();
  }
  if (IsFp8Kv(args) && options.fp8_tensor_cores && CanImplementFp8TensorCores(args).ok()) {
    p.kernel = Plan::Kernel::kFp8TensorCores;
    p.fp8_kv_rows = Fp8KvRows(args);
    p.workspace_bytes = Fp8TcWorkspaceLayout(args).bytes;
    s = PlanFp8TileRows(args, options.fp8_tile_rows, &p.fp8_tile_rows);
    if (!s.ok()) return s;
    *plan = p;
    return Status::Ok();
  }
  if (IsFp8Kv(args)) {
    // The forward kernel's plan on the 16-bit K/V Run converts FP8 K/V to, and room for them.
    if (Fp8KvRows(args) > INT32_MAX) {
      return {StatusCode::kInvalidArgument,
              "CUDA backend: float8_e4m3 paged k and v on a forward kernel need batch * "
              "max_seqlen_k < 2^31"};
    }
    Plan inner;
    s = MakePlan(Fp8InnerArgs(args, nullptr), options, &inner);
    if (!s.ok()) return s;
    p = inner;
    p.paged = IsPaged(args);
    p.fp8_dequant = true;
    p.fp8_kv_rows = Fp8KvRows(args);
    p.fp8_inner_workspace_bytes = inner.workspace_bytes;
    p.workspace_bytes = Fp8WorkspaceLayout(args, inner.workspace_bytes).bytes;
    *plan = p;
    return Status::Ok();
  }
  bool gen2 = false;
  if (options.generation == FwdGeneration::kGen2) {
    s = CanImplementGen2(args);
    if (!s.ok()) return s;
    gen2 = true;
  } else if (options.generation == FwdGeneration::kAuto) {
    gen2 = CanImplementGen2(args).ok();
  }
  if (!gen2) {
    p.kernel = Plan::Kernel::kGen1;
    *plan = p;
    return Status::Ok();
  }
  DeviceInfo info;
  if (!GetDeviceInfo(&info)) {
    return {StatusCode::kInternal, "CUDA backend: cannot read the device's properties"};
  }
  Sm90Choices c;
  c.tiling = options.gen2_tiling;
  c.row_cut = options.gen2_row_cut;
  c.l2_group_mib = options.gen2_l2_group_mib;
  c.l2_phases = options.gen2_l2_phases;
  c.counter = options.gen2_tile_counter;
  c.dynamic = options.gen2_dynamic;
  c.tma_o = options.gen2_tma_store_o;
  const FlashParams fp = MakeParams(args);
  const Sm90Launch L = args.dtype == DType::kFloat16 ? PlanSm90Typed<__half>(fp, c, info.sms, p.paged)
                                                     : PlanSm90Typed<__nv_bfloat16>(fp, c, info.sms, p.paged);
  p.kernel = Plan::Kernel::kGen2;
  p.gen2_narrow = L.narrow;
  p.gen2_row_cut = L.row_cut;
  p.gen2_l2_group_pairs = L.hb_group;
  p.gen2_l2_phases = L.l2_phases;
  p.gen2_tile_counter = L.dynamic;
  p.gen2_tma_store_o = L.tma_o;
  p.gen2_sms = L.sms;
  p.workspace_bytes = L.dynamic ? kFwdWorkspaceBytes : 0;
  *plan = p;
  return Status::Ok();
}

namespace {

// FP8 K/V on a forward kernel: K and V converted into the workspace, then the 16-bit forward
// kernel on them, all on stream.
cudaError_t RunFp8Forward(const AttentionArgs& args, const Plan& plan, void* workspace,
                          cudaStream_t stream) {
  if (workspace == nullptr || plan.fp8_kv_rows != Fp8KvRows(args)) return cudaErrorInvalidValue;
  char* conversion = static_cast<char*>(workspace) + AlignTo256(plan.fp8_inner_workspace_bytes);
  const AttentionArgs inner = Fp8InnerArgs(args, conversion);
  if (IsPaged(args)) {
    cudaError_t err = LaunchSeqlensScan(args.paged.seqlens_k, args.batch,
                                        const_cast<int32_t*>(inner.cu_seqlens_k), stream);
    if (err != cudaSuccess) return err;
  }
  Fp8DequantParams d;
  d.row_offsets = inner.cu_seqlens_k;
  d.page_indptr = args.paged.page_indptr;
  d.page_indices = args.paged.page_indices;
  d.page_size = args.paged.page_size;
  d.batch = args.batch;
  d.rows = plan.fp8_kv_rows;
  d.heads = args.num_kv_heads;
  d.scale_heads = args.num_kv_heads;
  d.head_dim = args.head_dim;
  d.bf16 = args.dtype == DType::kBFloat16;
  for (int part = 0; part < 2; ++part) {
    d.src = static_cast<const uint8_t*>(part == 0 ? args.k : args.v);
    d.dst = const_cast<void*>(part == 0 ? inner.k : inner.v);
    d.scales = part == 0 ? args.kv_scales.k : args.kv_scales.v;
    cudaError_t err = LaunchFp8Dequant(d, stream);
    if (err != cudaSuccess) return err;
  }
  Plan inner_plan = plan;
  inner_plan.paged = false;
  inner_plan.fp8_dequant = false;
  inner_plan.fp8_kv_rows = 0;
  inner_plan.fp8_inner_workspace_bytes = 0;
  inner_plan.workspace_bytes = plan.fp8_inner_workspace_bytes;
  return Run(inner, inner_plan, plan.fp8_inner_workspace_bytes > 0 ? workspace : nullptr, stream);
}

// FP8 K/V with 16-bit q on the FP8 tensor-core kernel: q quantized into the workspace, paged K/V
// gathered into rows there, then the kernel (V transposed first), all on stream.
cudaError_t RunFp8TensorCores(const AttentionArgs& args, const Plan& plan, void* workspace,
                              cudaStream_t stream) {
  if (workspace == nullptr || plan.fp8_kv_rows != Fp8KvRows(args) ||
      !CanImplementFp8TensorCores(args).ok()) {
    return cudaErrorInvalidValue;
  }
  DeviceInfo info;
  if (!GetDeviceInfo(&info)) return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(workspace);
  const Fp8TcWorkspace w = Fp8TcWorkspaceLayout(args);
  Fp8QuantizeParams qp;
  qp.src = args.q;
  qp.dst = reinterpret_cast<uint8_t*>(ws + w.q);
  qp.scales = reinterpret_cast<float*>(ws + w.q_scales);
  qp.amax_bits = reinterpret_cast<uint32_t*>(ws + w.amax);
  qp.cu_seqlens = args.cu_seqlens_q;
  qp.batch = args.batch;
  qp.rows = args.total_q;
  qp.heads = args.num_heads;
  qp.scale_heads = args.num_kv_heads;
  qp.head_dim = args.head_dim;
  qp.bf16 = args.dtype == DType::kBFloat16;
  cudaError_t err = LaunchFp8Quantize(qp, stream);
  if (err != cudaSuccess) return err;
  FlashParams p = MakeParams(args);
  p.q = qp.dst;
  p.q_descale = qp.scales;
  p.vt = ws + w.vt;
  if (IsPaged(args)) {
    auto* offsets = reinterpret_cast<int32_t*>(ws + w.offsets);
    err = LaunchSeqlensScan(args.paged.seqlens_k, args.batch, offsets, stream);
    if (err != cudaSuccess) return err;
    Fp8DequantParams g;
    g.row_offsets = offsets;
    g.page_indptr = args.paged.page_indptr;
    g.page_indices = args.paged.page_indices;
    g.page_size = args.paged.page_size;
    g.batch = args.batch;
    g.rows = plan.fp8_kv_rows;
    g.heads = args.num_kv_heads;
    g.head_dim = args.head_dim;
    for (int part = 0; part < 2; ++part) {
      g.src = static_cast<const uint8_t*>(part == 0 ? args.k : args.v);
      g.dst = ws + (part == 0 ? w.k : w.v);
      err = LaunchFp8Gather(g, stream);
      if (err != cudaSuccess) return err;
    }
    p.k = ws + w.k;
    p.v = ws + w.v;
    p.cu_seqlens_k = offsets;
    p.total_k = static_cast<int32_t>(plan.fp8_kv_rows);
    p.page_indptr = p.page_indices = p.seqlens_k = nullptr;
    p.page_size = 0;
    p.page_shift = -1;
  }
  const int rows = plan.fp8_tile_rows;
  return args.dtype == DType::kFloat16
             ? RunFp8AttentionTyped<__half>(p, args.head_dim, rows, info.sms, stream)
             : RunFp8AttentionTyped<__nv_bfloat16>(p, args.head_dim, rows, info.sms, stream);
}

}  // namespace

cudaError_t Run(const AttentionArgs& args, const Plan& plan, void* workspace, cudaStream_t stream) {
  if (!CanImplement(args).ok()) return cudaErrorInvalidValue;
  const bool paged = IsPaged(args);
  if (paged != plan.paged) return cudaErrorInvalidValue;
  if (plan.kernel == Plan::Kernel::kFp8TensorCores) {
    return IsFp8Kv(args) ? RunFp8TensorCores(args, plan, workspace, stream) : cudaErrorInvalidValue;
  }
  if (plan.fp8_dequant != (IsFp8Kv(args) && plan.kernel != Plan::Kernel::kDecode)) {
    return cudaErrorInvalidValue;  // a plan of other arguments
  }
  if (plan.fp8_dequant) return RunFp8Forward(args, plan, workspace, stream);
  if (Appends(args.paged) && plan.kernel != Plan::Kernel::kDecode) return cudaErrorInvalidValue;
  cudaError_t err;
  switch (plan.kernel) {
    case Plan::Kernel::kDecode: {
      if (plan.workspace_bytes > 0 && workspace == nullptr) return cudaErrorInvalidValue;
      const DecodeParams p = MakeDecodeParams(args, plan, workspace);
      if (IsFp8Kv(args)) {
        err = args.dtype == DType::kFloat16
                  ? RunDecodeFp8Typed<__half>(p, args.head_dim, paged, stream)
                  : RunDecodeFp8Typed<__nv_bfloat16>(p, args.head_dim, paged, stream);
      } else {
        err = args.dtype == DType::kFloat16 ? RunDecodeTyped<__half>(p, args.head_dim, paged, stream)
                                            : RunDecodeTyped<__nv_bfloat16>(p, args.head_dim, paged, stream);
      }
      break;
    }
    case Plan::Kernel::kGen2: {
      if (IsFp8Kv(args)) return cudaErrorInvalidValue;  // a plan of other arguments
      FlashParams p = MakeParams(args);
      // Without a workspace the kernel keeps its fixed tile order.
      if (plan.gen2_tile_counter && workspace != nullptr) {
        p.tile_counter = static_cast<unsigned int*>(workspace);
      }
      Sm90Launch L;
      L.narrow = plan.gen2_narrow;
      L.row_cut = plan.gen2_row_cut;
      L.hb_group = plan.gen2_l2_group_pairs;
      L.l2_phases = plan.gen2_l2_phases;
      L.dynamic = plan.gen2_tile_counter;
      L.tma_o = plan.gen2_tma_store_o;
      L.sms = plan.gen2_sms;
      err = args.dtype == DType::kFloat16 ? RunSm90Typed<__half>(p, L, paged, stream)
                                          : RunSm90Typed<__nv_bfloat16>(p, L, paged, stream);
      break;
    }
    default: {
      if (IsFp8Kv(args)) return cudaErrorInvalidValue;  // a plan of other arguments
      const FlashParams p = MakeParams(args);
      err = args.dtype == DType::kFloat16 ? RunTyped<__half>(p, paged, stream)
                                          : RunTyped<__nv_bfloat16>(p, paged, stream);
    }
  }
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

size_t WorkspaceBytes(const AttentionArgs& args) {
  Plan plan;
  return MakePlan(args, PlanOptions{}, &plan).ok() ? plan.workspace_bytes : 0;
}

bool UsesDecodeKernel(const AttentionArgs& args) { return args.max_seqlen_q <= kDecodeMaxSeqlenQ; }

cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream) {
  return Run(args, workspace, stream, FwdGeneration::kAuto);
}

cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream, FwdGeneration gen) {
  // FP8 K/V on a decode shape: a forced forward generation needs more workspace than the default
  // plan's (WorkspaceBytes), which is all this call can assume; MakePlan states what it needs.
  if (IsFp8Kv(args) && gen != FwdGeneration::kAuto && UsesDecodeKernel(args)) {
    return cudaErrorInvalidValue;
  }
  PlanOptions options;
  options.generation = gen;
  // The caller sized the workspace for the default plan (WorkspaceBytes): a forced generation 2
  // on a decode shape may have less than its tile counter.
  options.gen2_tile_counter =
      workspace != nullptr && (gen == FwdGeneration::kAuto || WorkspaceBytes(args) >= kFwdWorkspaceBytes);
  Plan plan;
  if (!MakePlan(args, options, &plan).ok()) return cudaErrorInvalidValue;
  return Run(args, plan, workspace, stream);
}

cudaError_t DequantizeFp8Q(const AttentionArgs& args, const void* q_codes, const float* q_scales,
                           void* q_out, cudaStream_t stream) {
  if (args.dtype != DType::kFloat16 && args.dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (args.num_kv_heads < 1 || args.num_heads % args.num_kv_heads != 0 || args.total_q < 0 ||
      args.cu_seqlens_q == nullptr) {
    return cudaErrorInvalidValue;
  }
  Fp8DequantParams d;
  d.src = static_cast<const uint8_t*>(q_codes);
  d.dst = q_out;
  d.scales = q_scales;
  d.row_offsets = args.cu_seqlens_q;
  d.batch = args.batch;
  d.rows = args.total_q;
  d.heads = args.num_heads;
  d.scale_heads = args.num_kv_heads;
  d.head_dim = args.head_dim;
  d.bf16 = args.dtype == DType::kBFloat16;
  return LaunchFp8Dequant(d, stream);
}

namespace {

// What the FP8 tensor-core kernel needs of args beyond CanImplement (FP8 K/V; the K/V rows it
// reads: total_k contiguous, or the bound Fp8KvRows when paged K/V are gathered first).
Status Fp8TensorCoreLimits(const AttentionArgs& args) {
  Status s = CanImplement(args);
  if (!s.ok()) return s;
  if (!IsFp8Kv(args)) {
    return {StatusCode::kUnimplemented, "CUDA FP8 attention kernel: k and v must be float8_e4m3"};
  }
  if (!Fp8ForwardHeadDimCompiled(args.head_dim)) {
    return {StatusCode::kUnimplemented, "CUDA FP8 attention kernel: head_dim " +
                                            std::to_string(args.head_dim) +
                                            " is not compiled in this build (128, 256 for sm_90a)"};
  }
  if (Fp8VtColumns(Fp8KvRows(args), args.batch) > INT32_MAX ||
      (int64_t(args.max_seqlen_q) + 127) / 128 * args.num_heads * args.batch > INT32_MAX) {
    return {StatusCode::kUnimplemented, "CUDA FP8 attention kernel: too many keys or query tiles"};
  }
  if (!Aligned16(args.q) || !Aligned16(args.k) || !Aligned16(args.v) ||
      (reinterpret_cast<uintptr_t>(args.o) & 3) != 0) {
    return {StatusCode::kUnimplemented,
            "CUDA FP8 attention kernel: q, k and v must be 16-byte aligned (TMA), o 4-byte"};
  }
  DeviceInfo info;
  if (!GetDeviceInfo(&info) || info.major != 9 || info.minor != 0) {
    return {StatusCode::kUnimplemented,
            "CUDA FP8 attention kernel: the device is not compute capability 9.0"};
  }
  return Status::Ok();
}

}  // namespace

Status CanImplementFp8Attention(const AttentionArgs& args) {
  if (IsPaged(args)) {
    return {StatusCode::kUnimplemented,
            "CUDA FP8 attention kernel: all-FP8 attention takes contiguous k and v"};
  }
  return Fp8TensorCoreLimits(args);
}

Status CanImplementFp8TensorCores(const AttentionArgs& args) {
  if (args.max_seqlen_q <= kDecodeMaxSeqlenQ) {
    return {StatusCode::kUnimplemented,
            "CUDA FP8 attention kernel: decode shapes run the FP8 decode kernel"};
  }
  return Fp8TensorCoreLimits(args);
}

size_t Fp8AttentionWorkspaceBytes(const AttentionArgs& args) {
  if (!CanImplementFp8Attention(args).ok()) return 0;
  return AlignTo256(size_t(Fp8VtBytes(args.total_k, args.batch, args.num_kv_heads, args.head_dim)));
}

cudaError_t RunFp8Attention(const AttentionArgs& args, const float* q_scales, void* workspace,
                            cudaStream_t stream) {
  if (!CanImplementFp8Attention(args).ok() || q_scales == nullptr || workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  DeviceInfo info;
  if (!GetDeviceInfo(&info)) return cudaErrorInvalidValue;
  FlashParams p = MakeParams(args);
  p.q_descale = q_scales;
  p.vt = workspace;
  const int rows = Fp8AttentionTileRows(args);
  return args.dtype == DType::kFloat16
             ? RunFp8AttentionTyped<__half>(p, args.head_dim, rows, info.sms, stream)
             : RunFp8AttentionTyped<__nv_bfloat16>(p, args.head_dim, rows, info.sms, stream);
}

int Fp8AttentionTileRows(const AttentionArgs& args) {
  DeviceInfo info;
  if (!GetDeviceInfo(&info)) return 0;
  return Fp8TileRows(args.head_dim, args.max_seqlen_q, args.num_heads, args.batch, info.sms);
}

Fp8SoftmaxRule Fp8TensorCoreSoftmaxRule(int head_dim, int tile_rows) {
  Fp8SoftmaxRule r;
  r.sums_rounded_p = Fp8SumsRoundedP(head_dim, tile_rows);
  r.lazy_rescale_eighths = Fp8RescaleSlack8(head_dim, tile_rows);
  return r;
}

const int* CompiledHeadDims(int* n) {
  if (n != nullptr) *n = kNumCompiledHeadDims;
  return kCompiledHeadDims;
}

}  // namespace attn::kernels::cuda
