#include "backends/cuda_backend.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/kernels/cuda_attention.h"
#include "backends/cuda_util.h"
#include "common/status_util.h"

namespace attn {
namespace {

// An all-FP8 Attend of head dim d with more than 16 queries, for asking the kernels library
// whether its FP8 tensor-core kernel serves that head dim on this device (the CanImplement
// checks read no memory: the pointers only need their alignment).
kernels::AttentionArgs Fp8AttendShape(int d) {
  alignas(256) static const int32_t kAligned[64] = {};
  const void* p = kAligned;
  kernels::AttentionArgs a;
  a.dtype = kernels::DType::kBFloat16;
  a.kv_dtype = kernels::DType::kFloat8E4M3;
  a.q = a.k = a.v = p;
  a.o = const_cast<void*>(p);
  a.cu_seqlens_q = a.cu_seqlens_k = static_cast<const int32_t*>(p);
  a.kv_scales = {static_cast<const float*>(p), static_cast<const float*>(p)};
  a.batch = 1;
  a.total_q = a.total_k = a.max_seqlen_q = a.max_seqlen_k = 128;
  a.num_heads = a.num_kv_heads = 8;
  a.head_dim = d;
  return a;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Options& options) {
  if (!kernels::cuda::Compiled()) return absl::UnavailableError("no CUDA kernels compiled in");
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device: ", err != cudaSuccess ? cudaGetErrorString(err) : "none found"));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("no CUDA device ", options.device));
  }
  if (options.streams < 1 || options.streams > 64) {
    return absl::InvalidArgumentError("--streams must be in [1, 64]");
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(options));
  RETURN_IF_ERROR(b->Init());
  return b;
}

absl::Status CudaBackend::Init() {
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  cudaDeviceProp prop;
  RETURN_IF_CUDA_ERROR("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, options_.device));
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat(prop.name, " (sm_", prop.major, prop.minor,
                                               ") is older than sm_80, which the kernels need"));
  }
  info_.name = "cuda";
  info_.device_name = prop.name;
  info_.compute_units = prop.multiProcessorCount;
  info_.device_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info_.compute_capability = prop.major * 10 + prop.minor;
  int n = 0;
  const int* dims = kernels::cuda::CompiledHeadDims(&n);
  info_.head_dims.assign(dims, dims + n);
  // FP8-cache sessions: steps of at most 16 new tokens run the FP8 paged decode kernel (compiled
  // for sm_90a, at head dims 64, 128 and 256); longer ones (chunked prefill) convert the cache's
  // rows to 16 bits in the launch's workspace and run the 16-bit forward kernel, so a step has no
  // token limit of its own (session_max_step_tokens 0).
  info_.fp8.session_cache = prop.major == 9 && prop.minor == 0;
  info_.fp8.session_max_step_tokens = 0;
  for (int32_t d : info_.head_dims) {
    if (d == 64 || d == 128 || d == 256) info_.fp8.session_head_dims.push_back(d);
  }
  if (info_.fp8.session_head_dims.empty()) info_.fp8.session_cache = false;
  // FP8 Attend (k and v, and q too) runs on the same two paths: the FP8 decode kernel for at most
  // 16 queries per sequence, else the conversion and the 16-bit forward kernel (q's codes are
  // converted with their descales first).
  info_.fp8.attend_kv = info_.fp8.session_cache;
  info_.fp8.attend_q = info_.fp8.session_cache;
  if (options_.fp8_attend_tensor_cores) {
    for (int32_t d : info_.fp8.session_head_dims) {
      if (kernels::cuda::CanImplementFp8Attention(Fp8AttendShape(d)).ok()) {
        info_.fp8.attend_tensor_core_head_dims.push_back(d);
      }
    }
  }
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  info_.build_info = absl::StrCat("attn_kernels cuda (runtime ", runtime, ", driver ", driver,
                                  "), ", options_.streams, " streams, head dims ",
                                  absl::StrJoin(info_.head_dims, ","));
  ASSIGN_OR_RETURN(state_, CudaDeviceState::Create(options_.device, options_.device_pool_bytes,
                                                   options_.pinned_pool_bytes));
  completions_ = std::make_unique<CompletionPool>(options_.completion_threads);
  copy_pool_ = kernels::cpu::CpuThreadPool::Create(options_.copy_threads);
  copier_ = std::make_unique<HostCopier>(copy_pool_.get());
  return StartLanes();
}

CudaBackend::~CudaBackend() {
  StopLanes();
  // Completes what the lanes handed over; its jobs return their pinned buffers to the pool.
  completions_.reset();
}

absl::StatusOr<std::unique_ptr<CudaStepDevice>> CudaBackend::CreateStepDevice(
    const CudaStepDevice::Options& options) {
  CudaStepDevice::Options o = options;
  o.reserve_bytes = options_.device_pool_bytes;
  o.fp8_tensor_cores = options_.fp8_step_tensor_cores;
  return CudaStepDevice::Create(o, state_);
}

BackendMemory CudaBackend::Memory() const {
  BackendMemory m;
  m.device_pool = state_->device_pool().Bytes();
  m.pinned_pool = state_->pinned_pool().Bytes();
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
    m.gpu_free = static_cast<int64_t>(free);
    m.gpu_total = static_cast<int64_t>(total);
    m.gpu_used = static_cast<int64_t>(total - free);
  }
  return m;
}

}  // namespace attn
