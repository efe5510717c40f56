// The one runtime-to-template dispatch of the CUDA backend: AttentionArgs -> FlashParams ->
// RunFlashFwd<T, D> for the (dtype, head dim) pairs compiled into this build (ATTN_HDIM_<d>).
#include "attn/kernels/cuda_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "flash_params.h"

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

FlashParams MakeParams(const AttentionArgs& a) {
  FlashParams p;
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.o = a.o;
  p.lse = a.lse;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.cu_seqlens_k = a.cu_seqlens_k;
  p.batch = a.batch;
  p.total_q = a.total_q;
  p.total_k = a.total_k;
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
  return p;
}

template <typename T>
cudaError_t RunTyped(const FlashParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
#ifdef ATTN_HDIM_32
    case 32: return RunFlashFwd<T, 32>(p, stream);
#endif
#ifdef ATTN_HDIM_64
    case 64: return RunFlashFwd<T, 64>(p, stream);
#endif
#ifdef ATTN_HDIM_96
    case 96: return RunFlashFwd<T, 96>(p, stream);
#endif
#ifdef ATTN_HDIM_128
    case 128: return RunFlashFwd<T, 128>(p, stream);
#endif
#ifdef ATTN_HDIM_256
    case 256: return RunFlashFwd<T, 256>(p, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool Compiled() { return true; }

Status CanImplement(const AttentionArgs& args) {
  Status s = ValidateCommon(args);
  if (!s.ok()) return s;
  if (IsPaged(args)) return {StatusCode::kUnimplemented, "CUDA backend: paged K/V is not implemented"};
  if (args.dtype != DType::kFloat16 && args.dtype != DType::kBFloat16) {
    return {StatusCode::kUnimplemented,
            std::string("CUDA backend: dtype ") + DTypeName(args.dtype) + " is not supported (fp16, bf16 only)"};
  }
  if (!HeadDimCompiled(args.head_dim)) {
    return {StatusCode::kUnimplemented,
            "CUDA backend: head_dim " + std::to_string(args.head_dim) + " is not compiled into this build"};
  }
  if (args.batch > 65535 || args.num_heads > 65535) {
    return {StatusCode::kInvalidArgument, "CUDA backend: batch and num_heads must be <= 65535 (grid limit)"};
  }
  return Status::Ok();
}

size_t WorkspaceBytes(const AttentionArgs&) { return 0; }

cudaError_t Run(const AttentionArgs& args, void* /*workspace*/, cudaStream_t stream) {
  if (!CanImplement(args).ok()) return cudaErrorInvalidValue;
  const FlashParams p = MakeParams(args);
  cudaError_t err = args.dtype == DType::kFloat16 ? RunTyped<__half>(p, stream)
                                                  : RunTyped<__nv_bfloat16>(p, stream);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

const int* CompiledHeadDims(int* n) {
  if (n != nullptr) *n = kNumCompiledHeadDims;
  return kCompiledHeadDims;
}

}  // namespace attn::kernels::cuda
