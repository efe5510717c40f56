#include "cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/kernels/cuda_attention.h"
#include "attn/kernels/dtype_convert.h"
#include "status_util.h"

namespace attn {
namespace {

absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

#define RETURN_IF_CUDA_ERROR(what, expr)                 \
  do {                                                   \
    if (cudaError_t _e = (expr); _e != cudaSuccess) return CudaError(what, _e); \
  } while (0)

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where each part of a packed batch lives inside the input and output buffers.
struct PackedLayout {
  int32_t total_q = 0, total_k = 0, num_seqs = 0, max_q = 0, max_k = 0;
  size_t q = 0, k = 0, v = 0, cu_q = 0, cu_k = 0, in_bytes = 0;  // offsets into the input
  size_t o = 0, lse = 0, out_bytes = 0;                           // offsets into the output
  bool any_lse = false;
};

PackedLayout PlanLayout(const Batch& batch) {
  PackedLayout l;
  const BatchKey& key = batch.front()->key;
  for (const auto& job : batch) {
    l.total_q += job->total_q;
    l.total_k += job->total_k;
    l.num_seqs += static_cast<int32_t>(job->cu_seqlens_q.size()) - 1;
    l.max_q = std::max(l.max_q, job->max_seqlen_q);
    l.max_k = std::max(l.max_k, job->max_seqlen_k);
    l.any_lse |= job->return_lse;
  }
  const size_t q_bytes = size_t(l.total_q) * key.num_heads * key.head_dim * 2;
  const size_t kv_bytes = size_t(l.total_k) * key.num_kv_heads * key.head_dim * 2;
  const size_t cu_bytes = sizeof(int32_t) * (size_t(l.num_seqs) + 1);
  l.q = 0;
  l.k = AlignUp(q_bytes);
  l.v = l.k + AlignUp(kv_bytes);
  l.cu_q = l.v + AlignUp(kv_bytes);
  l.cu_k = l.cu_q + AlignUp(cu_bytes);
  l.in_bytes = l.cu_k + AlignUp(cu_bytes);
  l.o = 0;
  l.lse = AlignUp(q_bytes);
  l.out_bytes = l.lse + (l.any_lse ? sizeof(float) * key.num_heads * size_t(l.total_q) : 0);
  return l;
}

// fp32 requests run in fp16 when every value fits it, else in bf16.
kernels::DType ComputeDType(const Batch& batch) {
  const kernels::DType wire = batch.front()->key.wire_dtype;
  if (wire != kernels::DType::kFloat32) return wire;
  for (const auto& job : batch) {
    for (const v1::Tensor* t : {&job->request->q(), &job->request->k(), &job->request->v()}) {
      const float* p = reinterpret_cast<const float*>(t->data().data());
      const size_t n = t->data().size() / 4;
      for (size_t i = 0; i < n; ++i) {
        if (!(std::fabs(p[i]) <= 60000.0f)) return kernels::DType::kBFloat16;
      }
    }
  }
  return kernels::DType::kFloat16;
}

// Copies (or converts from fp32) a request tensor into the 16-bit staging area.
void StageTensor(const std::string& src, kernels::DType wire, kernels::DType compute, char* dst) {
  if (wire != kernels::DType::kFloat32) {
    std::memcpy(dst, src.data(), src.size());
    return;
  }
  const float* in = reinterpret_cast<const float*>(src.data());
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  const size_t n = src.size() / 4;
  if (compute == kernels::DType::kFloat16) {
    for (size_t i = 0; i < n; ++i) out[i] = kernels::cpu::FloatToHalfBits(in[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = kernels::cpu::FloatToBf16Bits(in[i]);
  }
}

// The inverse of StageTensor for the output.
void UnstageTensor(const char* src, size_t elements, kernels::DType wire, kernels::DType compute,
                   std::string* dst) {
  if (wire != kernels::DType::kFloat32) {
    std::memcpy(dst->data(), src, elements * 2);
    return;
  }
  const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
  float* out = reinterpret_cast<float*>(dst->data());
  for (size_t i = 0; i < elements; ++i) {
    out[i] = compute == kernels::DType::kFloat16 ? kernels::cpu::HalfBitsToFloat(in[i])
                                                 : kernels::cpu::Bf16BitsToFloat(in[i]);
  }
}

float ElapsedMs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms;
}

// Device memory of one batch, returned to the pool (stream-ordered) when it goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer(DevicePool* pool, cudaStream_t stream) : pool_(pool), stream_(stream) {}
  ~DeviceBuffer() { pool_->Free(ptr_, bytes_, stream_); }
  absl::Status Allocate(size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    auto p = pool_->Allocate(bytes, stream_);
    if (!p.ok()) return p.status();
    ptr_ = static_cast<char*>(*p);
    bytes_ = bytes;
    return absl::OkStatus();
  }
  char* get() const { return ptr_; }

 private:
  DevicePool* pool_;
  cudaStream_t stream_;
  char* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Waits for the stream when it goes out of scope, so that pinned staging buffers are not handed
// back to the pool while a copy that failed to complete its batch may still read or write them.
class StreamSyncOnExit {
 public:
  explicit StreamSyncOnExit(cudaStream_t s) : s_(s) {}
  ~StreamSyncOnExit() { cudaStreamSynchronize(s_); }

 private:
  cudaStream_t s_;
};

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
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  info_.build_info = absl::StrCat("attn_kernels cuda (runtime ", runtime, ", driver ", driver,
                                  "), ", options_.streams, " streams, head dims ",
                                  absl::StrJoin(info_.head_dims, ","));

  auto device_pool = DevicePool::Create(options_.device, options_.device_pool_bytes);
  if (!device_pool.ok()) return device_pool.status();
  device_pool_ = std::move(*device_pool);
  PinnedPool::Allocator host_alloc{
      [](size_t bytes) -> void* {
        void* p = nullptr;
        return cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess ? p : nullptr;
      },
      [](void* p) { cudaFreeHost(p); }};
  auto pinned_pool = PinnedPool::Create(options_.pinned_pool_bytes, host_alloc);
  if (!pinned_pool.ok()) return pinned_pool.status();
  pinned_pool_ = std::move(*pinned_pool);

  for (int i = 0; i < options_.streams; ++i) {
    auto lane = std::make_unique<Lane>();
    RETURN_IF_CUDA_ERROR("cudaStreamCreate",
                         cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking));
    for (cudaEvent_t& e : lane->events) {
      RETURN_IF_CUDA_ERROR("cudaEventCreate", cudaEventCreate(&e));
    }
    lanes_.push_back(std::move(lane));
  }
  for (auto& lane : lanes_) lane->thread = std::thread([this, l = lane.get()] { LaneLoop(l); });
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
    for (cudaEvent_t e : lane->events) {
      if (e) cudaEventDestroy(e);
    }
    if (lane->stream) cudaStreamDestroy(lane->stream);
  }
}

void CudaBackend::RunBatch(Batch batch, std::function<void(const BatchReport&)> on_finished) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({std::move(batch), std::move(on_finished)});
  }
  cv_.notify_one();
}

void CudaBackend::LaneLoop(Lane* lane) {
  cudaSetDevice(options_.device);
  for (;;) {
    Work work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    BatchReport report;
    report.requests = static_cast<int32_t>(work.batch.size());
    for (const auto& job : work.batch) report.tokens += job->Tokens();
    const absl::Status st = Process(*lane, work.batch, &report);
    for (auto& job : work.batch) {
      job->batch_requests = report.requests;
      job->batch_tokens = report.tokens;
      job->done(st);
    }
    work.on_finished(report);
  }
}

absl::Status CudaBackend::Process(Lane& lane, Batch& batch, BatchReport* report) {
  const BatchKey& key = batch.front()->key;
  const PackedLayout layout = PlanLayout(batch);
  const kernels::DType compute = ComputeDType(batch);

  ASSIGN_OR_RETURN(PinnedBuffer host_in, pinned_pool_->Acquire(layout.in_bytes));
  ASSIGN_OR_RETURN(PinnedBuffer host_out, pinned_pool_->Acquire(layout.out_bytes));
  char* in = static_cast<char*>(host_in.data());
  int32_t* cu_q = reinterpret_cast<int32_t*>(in + layout.cu_q);
  int32_t* cu_k = reinterpret_cast<int32_t*>(in + layout.cu_k);
  const size_t q_row = size_t(key.num_heads) * key.head_dim * 2;
  const size_t kv_row = size_t(key.num_kv_heads) * key.head_dim * 2;
  int32_t q_tokens = 0, k_tokens = 0, seq = 0;
  cu_q[0] = cu_k[0] = 0;
  for (const auto& job : batch) {
    const v1::AttendRequest& r = *job->request;
    StageTensor(r.q().data(), key.wire_dtype, compute, in + layout.q + q_tokens * q_row);
    StageTensor(r.k().data(), key.wire_dtype, compute, in + layout.k + k_tokens * kv_row);
    StageTensor(r.v().data(), key.wire_dtype, compute, in + layout.v + k_tokens * kv_row);
    for (size_t i = 1; i < job->cu_seqlens_q.size(); ++i) {
      ++seq;
      cu_q[seq] = q_tokens + job->cu_seqlens_q[i];
      cu_k[seq] = k_tokens + job->cu_seqlens_k[i];
    }
    q_tokens += job->total_q;
    k_tokens += job->total_k;
  }

  DeviceBuffer dev_in(device_pool_.get(), lane.stream), dev_out(device_pool_.get(), lane.stream);
  RETURN_IF_ERROR(dev_in.Allocate(layout.in_bytes));
  RETURN_IF_ERROR(dev_out.Allocate(layout.out_bytes));

  kernels::AttentionArgs args;
  args.dtype = compute;
  args.q = dev_in.get() + layout.q;
  args.k = dev_in.get() + layout.k;
  args.v = dev_in.get() + layout.v;
  args.o = dev_out.get() + layout.o;
  args.lse = layout.any_lse ? reinterpret_cast<float*>(dev_out.get() + layout.lse) : nullptr;
  args.cu_seqlens_q = reinterpret_cast<const int32_t*>(dev_in.get() + layout.cu_q);
  args.cu_seqlens_k = reinterpret_cast<const int32_t*>(dev_in.get() + layout.cu_k);
  args.batch = layout.num_seqs;
  args.total_q = layout.total_q;
  args.total_k = layout.total_k;
  args.max_seqlen_q = std::max(layout.max_q, 1);
  args.max_seqlen_k = std::max(layout.max_k, 1);
  args.num_heads = key.num_heads;
  args.num_kv_heads = key.num_kv_heads;
  args.head_dim = key.head_dim;
  args.softmax_scale = key.softmax_scale;
  args.causal = key.causal;
  args.window_left = key.window_left;
  args.window_right = key.window_right;
  RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::CanImplement(args)));
  DeviceBuffer workspace(device_pool_.get(), lane.stream);
  RETURN_IF_ERROR(workspace.Allocate(kernels::cuda::WorkspaceBytes(args)));

  cudaStream_t s = lane.stream;
  const StreamSyncOnExit sync_on_exit(s);  // destroyed before the pinned buffers
  cudaEvent_t* ev = lane.events;
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[0], s));
  RETURN_IF_CUDA_ERROR("H2D copy", cudaMemcpyAsync(dev_in.get(), in, layout.in_bytes,
                                                   cudaMemcpyHostToDevice, s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[1], s));
  RETURN_IF_CUDA_ERROR("attention kernel", kernels::cuda::Run(args, workspace.get(), s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[2], s));
  RETURN_IF_CUDA_ERROR("D2H copy", cudaMemcpyAsync(host_out.data(), dev_out.get(),
                                                   layout.out_bytes, cudaMemcpyDeviceToHost, s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[3], s));
  RETURN_IF_CUDA_ERROR("batch completion", cudaEventSynchronize(ev[3]));

  const double h2d_ms = ElapsedMs(ev[0], ev[1]), kernel_ms = ElapsedMs(ev[1], ev[2]);
  const double d2h_ms = ElapsedMs(ev[2], ev[3]);
  report->compute_seconds = kernel_ms * 1e-3;
  report->transfer_seconds = (h2d_ms + d2h_ms) * 1e-3;
  report->flops = kernels::AttentionFlops(args, cu_q, cu_k);
  report->bytes = 2.0 * key.head_dim *
                  (2.0 * layout.total_q * key.num_heads + 2.0 * layout.total_k * key.num_kv_heads);

  const char* out = static_cast<const char*>(host_out.data());
  const float* lse = reinterpret_cast<const float*>(out + layout.lse);
  int32_t q_offset = 0;
  for (const auto& job : batch) {
    const size_t elements = size_t(job->total_q) * key.num_heads * key.head_dim;
    UnstageTensor(out + layout.o + q_offset * q_row, elements, key.wire_dtype, compute,
                  job->response->mutable_o()->mutable_data());
    if (job->return_lse) {
      float* dst = reinterpret_cast<float*>(job->response->mutable_lse()->mutable_data()->data());
      for (int h = 0; h < key.num_heads; ++h) {
        std::memcpy(dst + size_t(h) * job->total_q, lse + size_t(h) * layout.total_q + q_offset,
                    sizeof(float) * job->total_q);
      }
    }
    job->transfer_us = (h2d_ms + d2h_ms) * 1e3;
    job->compute_us = kernel_ms * 1e3;
    q_offset += job->total_q;
  }
  return absl::OkStatus();
}

BackendMemory CudaBackend::Memory() const {
  BackendMemory m;
  m.device_pool = device_pool_->Bytes();
  m.pinned_pool = pinned_pool_->Bytes();
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
    m.gpu_free = static_cast<int64_t>(free);
    m.gpu_total = static_cast<int64_t>(total);
    m.gpu_used = static_cast<int64_t>(total - free);
  }
  return m;
}

}  // namespace attn
