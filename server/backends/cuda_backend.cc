#include "backends/cuda_backend.h"

#include <cuda.h>  // types of cuMemGetAddressRange only: it is looked up through the runtime

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/kernels/cuda_attention.h"
#include "backends/cuda_vmm_import.h"
#include "backends/kv_copy.h"
#include "common/status_util.h"
#include "sessions/step_launch.h"
#include "sessions/step_work.h"

namespace attn {
namespace {

absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

#define RETURN_IF_CUDA_ERROR(what, expr)                 \
  do {                                                   \
    if (cudaError_t _e = (expr); _e != cudaSuccess) return CudaError(what, _e); \
  } while (0)

// Errors after which every later call in the context fails: only a new process recovers.
bool IsStickyError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// One request on the CUDA backend: where the launch copies its q, k and v from and its o and lse
// (lse as [num_heads, total_q] fp32) to. Each is either in pinned staging (`in`, `out`, owned
// here and returned to the pool when the job lets go of its state), or, with no staging, in a
// host region registered with the device (AttendJob::host_registered) or a GPU region
// (device_tensors): the job's region_holds keep those mapped.
struct CudaJobState : BackendJobState {
  PinnedBuffer in;   // staged inputs, in the compute dtype, back to back (q, k, v)
  PinnedBuffer out;  // outputs that come back through staging (o, then lse)
  size_t q_bytes = 0, kv_bytes = 0, o_bytes = 0;  // in the compute dtype
  const char* q_src = nullptr;
  const char* k_src = nullptr;
  const char* v_src = nullptr;
  char* o_dst = nullptr;
  char* lse_dst = nullptr;  // when return_lse
  bool o_direct = false, lse_direct = false;  // o_dst / lse_dst are the job's region, not `out`
  bool inputs_staged = false;  // by StageWireInputs: Prepare leaves `in` as it is
};

CudaJobState& StateOf(const AttendJob& job) {
  return static_cast<CudaJobState&>(*job.backend_state);
}

// Where each part of a packed launch lives inside the device input and output buffers.
struct PackedLayout {
  int32_t total_q = 0, total_k = 0, num_seqs = 0, max_q = 0, max_k = 0;
  size_t q = 0, k = 0, v = 0, cu_q = 0, cu_k = 0, in_bytes = 0;  // offsets into the input
  size_t cu_region = 0;                                            // cu_q and cu_k, together
  size_t o = 0, lse = 0, out_bytes = 0;                            // offsets into the output
  bool any_lse = false;
};

PackedLayout PlanLayout(std::span<const std::unique_ptr<AttendJob>> jobs) {
  PackedLayout l;
  const BatchKey& key = jobs.front()->key;
  for (const auto& job : jobs) {
    l.total_q += job->total_q;
    l.total_k += job->total_k;
    l.num_seqs += static_cast<int32_t>(job->cu_seqlens_q.size()) - 1;
    l.max_q = std::max(l.max_q, job->max_seqlen_q);
    l.max_k = std::max(l.max_k, job->max_seqlen_k);
    l.any_lse |= job->return_lse;
  }
  const size_t q_bytes = size_t(l.total_q) * key.num_heads * key.head_dim * 2;
  const size_t kv_bytes = size_t(l.total_k) * key.num_kv_heads * key.head_dim * 2;
  const size_t cu_bytes = AlignUp(sizeof(int32_t) * (size_t(l.num_seqs) + 1));
  l.q = 0;
  l.k = AlignUp(q_bytes);
  l.v = l.k + AlignUp(kv_bytes);
  l.cu_q = l.v + AlignUp(kv_bytes);
  l.cu_k = l.cu_q + cu_bytes;
  l.cu_region = 2 * cu_bytes;
  l.in_bytes = l.cu_k + cu_bytes;
  l.o = 0;
  l.lse = AlignUp(q_bytes);
  l.out_bytes = l.lse + (l.any_lse ? sizeof(float) * key.num_heads * size_t(l.total_q) : 0);
  return l;
}

// fp32 requests run in fp16 when every value fits it, else in bf16.
kernels::DType ComputeDType(const AttendJob& job) {
  if (job.key.wire_dtype != kernels::DType::kFloat32) return job.key.wire_dtype;
  for (std::string_view t : {job.q_bytes, job.k_bytes, job.v_bytes}) {
    const size_t n = t.size() / 4;
    for (size_t i = 0; i < n; ++i) {
      float x;  // through memcpy: no alignment assumed of the request's bytes
      std::memcpy(&x, t.data() + 4 * i, 4);
      if (!(std::fabs(x) <= 60000.0f)) return kernels::DType::kBFloat16;
    }
  }
  return kernels::DType::kFloat16;
}

// The conversion from a request's wire dtype to the 16-bit type it is staged in, and back.
ElementCast StagingCast(kernels::DType wire, kernels::DType compute) {
  if (wire != kernels::DType::kFloat32) return ElementCast::kNone;
  return compute == kernels::DType::kFloat16 ? ElementCast::kFloatToHalf
                                              : ElementCast::kFloatToBf16;
}
ElementCast UnstagingCast(kernels::DType wire, kernels::DType compute) {
  if (wire != kernels::DType::kFloat32) return ElementCast::kNone;
  return compute == kernels::DType::kFloat16 ? ElementCast::kHalfToFloat
                                              : ElementCast::kBf16ToFloat;
}

// One tensor of the request into its 16-bit staging area.
HostCopy StagingCopy(std::string_view src, ElementCast cast, char* dst) {
  const size_t elements = cast == ElementCast::kNone ? src.size() : src.size() / 4;
  return {src.data(), dst, elements, cast};
}

// Copies a finished job's outputs that came back through staging into its response (or its
// output regions, when those are not registered with the device); outputs the launch wrote
// straight into a region need nothing more.
void UnstageOutputs(const AttendJob& job, const HostCopier& copier) {
  const CudaJobState& state = StateOf(job);
  const ElementCast cast = UnstagingCast(job.key.wire_dtype, *job.key.staged_dtype);
  HostCopy copies[2];
  size_t n = 0;
  if (!state.o_direct) {
    char* o = job.o_out != nullptr ? job.o_out : job.response->mutable_o()->mutable_data()->data();
    copies[n++] = {state.o_dst, o, cast == ElementCast::kNone ? state.o_bytes : state.o_bytes / 2,
                   cast};
  }
  if (job.return_lse && !state.lse_direct) {
    const size_t lse_bytes = sizeof(float) * size_t(job.key.num_heads) * job.total_q;
    char* lse = job.lse_out != nullptr ? job.lse_out
                                       : job.response->mutable_lse()->mutable_data()->data();
    copies[n++] = {state.lse_dst, lse, lse_bytes, ElementCast::kNone};
  }
  copier.Run({copies, n});
}

// q, k and v into pinned staging in the compute dtype, except those in a host region registered
// with the device that need no conversion: the launch copies those straight from the region.
absl::Status StageInputs(const AttendJob& job, kernels::DType compute, PinnedPool& pool,
                         const HostCopier& copier, CudaJobState& state) {
  const ElementCast cast = StagingCast(job.key.wire_dtype, compute);
  const bool as_is = cast == ElementCast::kNone;
  const AttendJob::HostRegistered& reg = job.host_registered;
  struct Part {
    std::string_view src;
    bool direct;
    size_t bytes;  // staged
    const char** to;
  };
  const Part parts[] = {{job.q_bytes, as_is && reg.q, state.q_bytes, &state.q_src},
                        {job.k_bytes, as_is && reg.k, state.kv_bytes, &state.k_src},
                        {job.v_bytes, as_is && reg.v, state.kv_bytes, &state.v_src}};
  size_t staged = 0;
  for (const Part& p : parts) staged += p.direct ? 0 : p.bytes;
  if (staged > 0) {
    ASSIGN_OR_RETURN(state.in, pool.Acquire(staged));
  }
  char* at = static_cast<char*>(state.in.data());
  HostCopy copies[3];
  size_t n = 0;
  for (const Part& p : parts) {
    if (p.direct) {
      *p.to = p.src.data();
      continue;
    }
    copies[n++] = StagingCopy(p.src, cast, at);
    *p.to = at;
    at += p.bytes;
  }
  copier.Run({copies, n});
  return absl::OkStatus();
}

// Where the launch puts o and lse: straight into the job's output regions where those are
// registered with the device and o needs no conversion, else into pinned staging.
absl::Status PlaceOutputs(const AttendJob& job, PinnedPool& pool, CudaJobState& state) {
  const size_t lse_bytes = job.return_lse ? sizeof(float) * job.key.num_heads * size_t(job.total_q)
                                          : 0;
  state.o_direct = job.host_registered.o && job.key.wire_dtype != kernels::DType::kFloat32;
  state.lse_direct = job.return_lse && job.host_registered.lse;
  const size_t staged = (state.o_direct ? 0 : state.o_bytes) + (state.lse_direct ? 0 : lse_bytes);
  if (staged > 0) {
    ASSIGN_OR_RETURN(state.out, pool.Acquire(staged));
  }
  char* at = static_cast<char*>(state.out.data());
  state.o_dst = state.o_direct ? job.o_out : at;
  if (!state.o_direct) at += state.o_bytes;
  state.lse_dst = state.lse_direct ? job.lse_out : at;
  return absl::OkStatus();
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

// Waits for the stream when it goes out of scope on an error path, so that no buffer is handed
// back (pinned staging to its pool, a job to its caller) while an enqueued copy may still use it.
class SyncStreamUnlessDone {
 public:
  explicit SyncStreamUnlessDone(cudaStream_t s) : s_(s) {}
  ~SyncStreamUnlessDone() {
    if (!done_) cudaStreamSynchronize(s_);
  }
  void Done() { done_ = true; }

 private:
  cudaStream_t s_;
  bool done_ = false;
};

// Gathers the jobs' inputs into the packed device layout (async, on s): from pinned staging or
// registered host regions (DMA either way), or from GPU regions on the device.
absl::Status CopyInputs(std::span<std::unique_ptr<AttendJob>> jobs,
                        const PackedLayout& layout, const PinnedBuffer& host_cu, char* dev_in,
                        cudaStream_t s) {
  size_t q_at = layout.q, k_at = layout.k, v_at = layout.v;
  for (const auto& job : jobs) {
    const CudaJobState& state = StateOf(*job);
    const bool device = job->device_tensors;
    const cudaMemcpyKind kind = device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
    const char* what = device ? "D2D copy" : "H2D copy";
    RETURN_IF_CUDA_ERROR(what, cudaMemcpyAsync(dev_in + q_at, state.q_src, state.q_bytes, kind, s));
    RETURN_IF_CUDA_ERROR(what,
                         cudaMemcpyAsync(dev_in + k_at, state.k_src, state.kv_bytes, kind, s));
    RETURN_IF_CUDA_ERROR(what,
                         cudaMemcpyAsync(dev_in + v_at, state.v_src, state.kv_bytes, kind, s));
    q_at += state.q_bytes;
    k_at += state.kv_bytes;
    v_at += state.kv_bytes;
  }
  RETURN_IF_CUDA_ERROR("H2D copy", cudaMemcpyAsync(dev_in + layout.cu_q, host_cu.data(),
                                                   layout.cu_region, cudaMemcpyHostToDevice, s));
  return absl::OkStatus();
}

// Scatters the packed outputs back into each job's pinned output buffer (async, on s). The lse
// of the launch is [num_heads, total_q]; a job's part is a strided block of it.
absl::Status CopyOutputs(std::span<std::unique_ptr<AttendJob>> jobs,
                         const PackedLayout& layout, const char* dev_out, cudaStream_t s) {
  const int32_t heads = jobs.front()->key.num_heads;
  size_t o_at = layout.o;
  int32_t q_offset = 0;
  for (const auto& job : jobs) {
    const CudaJobState& state = StateOf(*job);
    // Into pinned staging or registered host regions (D2H), or the client's GPU regions (D2D).
    const bool device = job->device_tensors;
    char* out = state.o_dst;
    char* lse_out = state.lse_dst;
    const cudaMemcpyKind kind = device ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost;
    RETURN_IF_CUDA_ERROR("D2H copy", cudaMemcpyAsync(out, dev_out + o_at, state.o_bytes, kind, s));
    if (job->return_lse && job->total_q > 0) {
      const size_t row = sizeof(float) * job->total_q;
      RETURN_IF_CUDA_ERROR(
          "D2H copy", cudaMemcpy2DAsync(lse_out, row,
                                        dev_out + layout.lse + sizeof(float) * q_offset,
                                        sizeof(float) * layout.total_q, row, heads, kind, s));
    }
    o_at += state.o_bytes;
    q_offset += job->total_q;
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// From this size of q on, a request whose tensors all lie in GPU regions is run by a launch of
// its own that reads and writes the regions in place. A smaller one is gathered into the packed
// launch: one launch for many small requests fills the device, where one launch each would not.
constexpr size_t kInPlaceAttendBytes = size_t{1} << 20;

// The kernels read q, k and v and write o and lse 16 bytes at a time.
bool AttendsInPlace(const AttendJob& job) {
  return job.device_tensors && !job.step && job.q_bytes.size() >= kInPlaceAttendBytes &&
         Aligned16(job.q_bytes.data()) && Aligned16(job.k_bytes.data()) &&
         Aligned16(job.v_bytes.data()) && Aligned16(job.o_out) &&
         (!job.return_lse || Aligned16(job.lse_out));
}

double TensorBytes(const BatchKey& key, double total_q, double total_k) {
  return 2.0 * key.head_dim * (2.0 * total_q * key.num_heads + 2.0 * total_k * key.num_kv_heads);
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
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  info_.build_info = absl::StrCat("attn_kernels cuda (runtime ", runtime, ", driver ", driver,
                                  "), ", options_.streams, " streams, head dims ",
                                  absl::StrJoin(info_.head_dims, ","));

  RETURN_IF_ERROR(AllocateKvRegion());
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
      // The lane waits on the last one: block in the driver instead of spinning on a busy host.
      const unsigned flags = &e == &lane->events[3] ? cudaEventBlockingSync : cudaEventDefault;
      RETURN_IF_CUDA_ERROR("cudaEventCreate", cudaEventCreateWithFlags(&e, flags));
    }
    lanes_.push_back(std::move(lane));
  }
  completions_ = std::make_unique<CompletionPool>(options_.completion_threads);
  copy_pool_ = kernels::cpu::CpuThreadPool::Create(options_.copy_threads);
  copier_ = std::make_unique<HostCopier>(copy_pool_.get());
  for (auto& lane : lanes_) lane->thread = std::thread([this, l = lane.get()] { LaneLoop(l); });
  return absl::OkStatus();
}

absl::Status CudaBackend::AllocateKvRegion() {
  int64_t bytes = options_.kv_cache_bytes;
  if (bytes == 0) {
    size_t free = 0, total = 0;
    RETURN_IF_CUDA_ERROR("cudaMemGetInfo", cudaMemGetInfo(&free, &total));
    const int64_t left = static_cast<int64_t>(free) - options_.device_pool_bytes - (int64_t{1} << 30);
    bytes = std::max<int64_t>(0, left / 5 * 4);
  }
  const int64_t page = options_.kv_page_bytes;
  if (page < 1) return absl::InvalidArgumentError("KV page bytes must be >= 1");
  const int64_t pages = std::min<int64_t>(bytes / (2 * page), INT32_MAX / 2);
  if (pages < 1) {
    std::fprintf(stderr, "attnd: no room for a KV cache (%lld bytes); sessions are off\n",
                 static_cast<long long>(bytes));
    return absl::OkStatus();
  }
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, static_cast<size_t>(2 * pages * page)); e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the KV cache region of ", 2 * pages * page,
        " bytes of device memory (--kv_cache_bytes): ", cudaGetErrorString(e)));
  }
  kv_.k = static_cast<char*>(p);
  kv_.v = kv_.k + pages * page;
  kv_.num_pages = pages;
  kv_.page_bytes = page;
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
  }
  // Completes what the lanes handed over; its jobs return their pinned buffers to the pool.
  completions_.reset();
  for (auto& lane : lanes_) {
    for (cudaEvent_t e : lane->events) {
      if (e) cudaEventDestroy(e);
    }
    if (lane->stream) cudaStreamDestroy(lane->stream);
  }
  if (kv_.k) cudaFree(kv_.k);
}

absl::Status CudaBackend::StageWireInputs(AttendJob& job, const WireTensors& in) {
  const bool all_inline = in.q.size > 0 && in.k.size > 0 && in.v.size > 0;
  if (job.key.wire_dtype == kernels::DType::kFloat32 || !all_inline) {
    return Backend::StageWireInputs(job, in);
  }
  RETURN_IF_ERROR(Health());
  const auto start = Clock::now();
  auto state = std::make_unique<CudaJobState>();
  ASSIGN_OR_RETURN(state->in, pinned_pool_->Acquire(in.q.size + in.k.size + in.v.size));
  char* at = static_cast<char*>(state->in.data());
  std::vector<HostCopy> copies;
  copies.reserve(in.q.pieces.size() + in.k.pieces.size() + in.v.pieces.size());
  for (auto [bytes, view] : {std::pair{&in.q, &job.q_bytes}, std::pair{&in.k, &job.k_bytes},
                             std::pair{&in.v, &job.v_bytes}}) {
    *view = std::string_view(at, bytes->size);
    for (std::string_view p : bytes->pieces) {
      copies.push_back({p.data(), at, p.size(), ElementCast::kNone});
      at += p.size();
    }
  }
  copier_->Run(copies);
  state->inputs_staged = true;
  job.backend_state = std::move(state);
  job.host_copy_us += Micros(Clock::now() - start);
  return absl::OkStatus();
}

absl::Status CudaBackend::Prepare(AttendJob& job) {
  RETURN_IF_ERROR(Health());
  const auto start = Clock::now();
  const BatchKey& key = job.key;
  if (job.device_tensors) {
    // GPU regions: the launch copies q, k and v from them on the device; nothing to stage.
    auto state = std::make_unique<CudaJobState>();
    state->q_bytes = job.q_bytes.size();
    state->kv_bytes = job.k_bytes.size();
    state->o_bytes = state->q_bytes;
    state->q_src = job.q_bytes.data();
    state->k_src = job.k_bytes.data();
    state->v_src = job.v_bytes.data();
    state->o_dst = job.o_out;
    state->lse_dst = job.lse_out;
    state->o_direct = state->lse_direct = true;
    job.key.staged_dtype = key.wire_dtype;
    job.runs_alone = AttendsInPlace(job);
    job.backend_state = std::move(state);
    return absl::OkStatus();
  }
  if (!job.backend_state) job.backend_state = std::make_unique<CudaJobState>();
  CudaJobState& state = StateOf(job);
  // Inputs staged from the wire are 16-bit already: computed as sent.
  const kernels::DType compute = state.inputs_staged ? key.wire_dtype : ComputeDType(job);
  state.q_bytes = size_t(job.total_q) * key.num_heads * key.head_dim * 2;
  state.kv_bytes = size_t(job.total_k) * key.num_kv_heads * key.head_dim * 2;
  state.o_bytes = state.q_bytes;
  if (state.inputs_staged) {
    const char* in = static_cast<const char*>(state.in.data());
    state.q_src = in;
    state.k_src = in + state.q_bytes;
    state.v_src = in + state.q_bytes + state.kv_bytes;
  } else {
    RETURN_IF_ERROR(StageInputs(job, compute, *pinned_pool_, *copier_, state));
  }
  RETURN_IF_ERROR(PlaceOutputs(job, *pinned_pool_, state));
  job.key.staged_dtype = compute;
  job.host_copy_us += Micros(Clock::now() - start);
  return absl::OkStatus();
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
    std::vector<absl::Status> status(work.batch.size());
    if (work.batch.front()->step) {
      std::shared_ptr<const StepResults> results = RunSteps(*lane, work.batch, status, &report);
      FinishSteps(std::move(work.batch), std::move(status), std::move(results));
      work.on_finished(report);
      continue;
    }
    // Large requests whose tensors all lie in GPU regions run in place, each its own launch;
    // the rest are packed into one.
    const auto packed_end = std::stable_partition(
        work.batch.begin(), work.batch.end(), [](const auto& job) { return !AttendsInPlace(*job); });
    const size_t packed = static_cast<size_t>(packed_end - work.batch.begin());
    const std::span<std::unique_ptr<AttendJob>> jobs(work.batch);
    const std::span<absl::Status> statuses(status);
    if (packed > 0) {
      RunSplittingOnExhaustion(*lane, jobs.first(packed), statuses.first(packed), &report);
    }
    if (packed < jobs.size()) {
      const absl::Status st = LaunchInPlace(*lane, jobs.subspan(packed), &report);
      if (!st.ok() && !absl::IsResourceExhausted(st)) NoteIfDeviceLost(*lane);
      std::fill(statuses.begin() + packed, statuses.end(), st);
    }
    // The results are in pinned memory now; copying them into the responses and finishing the
    // calls runs on the completion pool while this lane takes the next batch.
    for (size_t i = 0; i < work.batch.size(); ++i) {
      std::shared_ptr<AttendJob> job(std::move(work.batch[i]));
      completions_->Post([this, job, st = std::move(status[i])] {
        // Steps' outputs are in their responses already; GPU regions got theirs on the device.
        if (st.ok() && !job->step && !job->device_tensors) {
          const auto start = Clock::now();
          UnstageOutputs(*job, *copier_);
          job->host_copy_us += Micros(Clock::now() - start);
        }
        job->backend_state.reset();  // pinned buffers back to the pool before the caller hears
        job->done(st);
      });
    }
    work.on_finished(report);
  }
}

void CudaBackend::RunSplittingOnExhaustion(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                           std::span<absl::Status> status, BatchReport* report) {
  absl::Status st = Launch(lane, jobs, report);
  if (!st.ok() && !absl::IsResourceExhausted(st)) NoteIfDeviceLost(lane);
  if (absl::IsResourceExhausted(st) && jobs.size() > 1) {
    // Together they do not fit in the device pool: run the halves one after the other, so that
    // only a request that does not fit on its own fails.
    const size_t half = jobs.size() / 2;
    RunSplittingOnExhaustion(lane, jobs.first(half), status.first(half), report);
    RunSplittingOnExhaustion(lane, jobs.subspan(half), status.subspan(half), report);
    return;
  }
  std::fill(status.begin(), status.end(), st);
}

absl::Status CudaBackend::Launch(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                 BatchReport* report) {
  const BatchKey& key = jobs.front()->key;
  const PackedLayout layout = PlanLayout(jobs);

  // Sequence offsets of the packed launch, staged next to each other as on the device.
  ASSIGN_OR_RETURN(PinnedBuffer host_cu, pinned_pool_->Acquire(layout.cu_region));
  int32_t* cu_q = static_cast<int32_t*>(host_cu.data());
  int32_t* cu_k = reinterpret_cast<int32_t*>(static_cast<char*>(host_cu.data()) +
                                             (layout.cu_k - layout.cu_q));
  int32_t q_tokens = 0, k_tokens = 0, seq = 0;
  cu_q[0] = cu_k[0] = 0;
  for (const auto& job : jobs) {
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

  kernels::AttentionArgs args = LaunchShapeArgs(key, *key.staged_dtype, layout.num_seqs,
                                                layout.total_q, layout.total_k, layout.max_q,
                                                layout.max_k);
  args.q = dev_in.get() + layout.q;
  args.k = dev_in.get() + layout.k;
  args.v = dev_in.get() + layout.v;
  args.o = dev_out.get() + layout.o;
  args.lse = layout.any_lse ? reinterpret_cast<float*>(dev_out.get() + layout.lse) : nullptr;
  args.cu_seqlens_q = reinterpret_cast<const int32_t*>(dev_in.get() + layout.cu_q);
  args.cu_seqlens_k = reinterpret_cast<const int32_t*>(dev_in.get() + layout.cu_k);
  RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::CanImplement(args)));
  DeviceBuffer workspace(device_pool_.get(), lane.stream);
  RETURN_IF_ERROR(workspace.Allocate(kernels::cuda::WorkspaceBytes(args)));

  cudaStream_t s = lane.stream;
  SyncStreamUnlessDone sync_on_error(s);  // destroyed before the staging buffers go back
  cudaEvent_t* ev = lane.events;
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[0], s));
  RETURN_IF_ERROR(CopyInputs(jobs, layout, host_cu, dev_in.get(), s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[1], s));
  RETURN_IF_CUDA_ERROR("attention kernel", kernels::cuda::Run(args, workspace.get(), s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[2], s));
  RETURN_IF_ERROR(CopyOutputs(jobs, layout, dev_out.get(), s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[3], s));
  RETURN_IF_CUDA_ERROR("batch completion", cudaEventSynchronize(ev[3]));
  sync_on_error.Done();

  const double h2d_ms = ElapsedMs(ev[0], ev[1]), kernel_ms = ElapsedMs(ev[1], ev[2]);
  const double d2h_ms = ElapsedMs(ev[2], ev[3]);
  report->compute_seconds += kernel_ms * 1e-3;
  report->transfer_seconds += (h2d_ms + d2h_ms) * 1e-3;
  report->flops += kernels::AttentionFlops(args, cu_q, cu_k);
  report->bytes += TensorBytes(key, layout.total_q, layout.total_k);
  for (const auto& job : jobs) {
    job->transfer_us = (h2d_ms + d2h_ms) * 1e3;
    job->compute_us = kernel_ms * 1e3;
    job->batch_requests = static_cast<int32_t>(jobs.size());
    job->batch_tokens = layout.total_q;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchInPlace(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                        BatchReport* report) {
  // Each job's sequence offsets, cu_q then cu_k, staged back to back as they lie on the device.
  std::vector<size_t> cu_at(jobs.size());
  size_t cu_bytes = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    cu_at[i] = cu_bytes;
    cu_bytes += 2 * AlignUp(sizeof(int32_t) * jobs[i]->cu_seqlens_q.size());
  }
  ASSIGN_OR_RETURN(PinnedBuffer host_cu, pinned_pool_->Acquire(cu_bytes));
  DeviceBuffer dev_cu(device_pool_.get(), lane.stream), workspace(device_pool_.get(), lane.stream);
  RETURN_IF_ERROR(dev_cu.Allocate(cu_bytes));
  std::vector<kernels::AttentionArgs> args;
  args.reserve(jobs.size());
  size_t workspace_bytes = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const AttendJob& job = *jobs[i];
    const size_t n = job.cu_seqlens_q.size();
    char* host = static_cast<char*>(host_cu.data()) + cu_at[i];
    const size_t cu_k = AlignUp(sizeof(int32_t) * n);
    std::memcpy(host, job.cu_seqlens_q.data(), sizeof(int32_t) * n);
    std::memcpy(host + cu_k, job.cu_seqlens_k.data(), sizeof(int32_t) * n);
    kernels::AttentionArgs a = job.HostArgs();  // the regions' device addresses
    a.cu_seqlens_q = reinterpret_cast<const int32_t*>(dev_cu.get() + cu_at[i]);
    a.cu_seqlens_k = reinterpret_cast<const int32_t*>(dev_cu.get() + cu_at[i] + cu_k);
    RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::CanImplement(a)));
    workspace_bytes = std::max(workspace_bytes, kernels::cuda::WorkspaceBytes(a));
    args.push_back(a);
  }
  // The launches run one after the other on the lane's stream: they share the workspace.
  RETURN_IF_ERROR(workspace.Allocate(workspace_bytes));

  cudaStream_t s = lane.stream;
  SyncStreamUnlessDone sync_on_error(s);
  cudaEvent_t* ev = lane.events;
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[0], s));
  RETURN_IF_CUDA_ERROR("H2D copy", cudaMemcpyAsync(dev_cu.get(), host_cu.data(), cu_bytes,
                                                   cudaMemcpyHostToDevice, s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[1], s));
  for (const kernels::AttentionArgs& a : args) {
    RETURN_IF_CUDA_ERROR("attention kernel", kernels::cuda::Run(a, workspace.get(), s));
  }
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[2], s));
  RETURN_IF_CUDA_ERROR("batch completion", cudaEventSynchronize(ev[2]));
  sync_on_error.Done();

  const double h2d_ms = ElapsedMs(ev[0], ev[1]), kernel_ms = ElapsedMs(ev[1], ev[2]);
  report->compute_seconds += kernel_ms * 1e-3;
  report->transfer_seconds += h2d_ms * 1e-3;
  for (size_t i = 0; i < jobs.size(); ++i) {
    AttendJob& job = *jobs[i];
    report->flops += kernels::AttentionFlops(args[i], job.cu_seqlens_q.data(),
                                             job.cu_seqlens_k.data());
    report->bytes += TensorBytes(job.key, job.total_q, job.total_k);
    job.transfer_us = h2d_ms * 1e3;
    job.compute_us = kernel_ms * 1e3;
    job.batch_requests = static_cast<int32_t>(jobs.size());
    job.batch_tokens = job.total_q;
  }
  return absl::OkStatus();
}

namespace {

// A member's tensor in a registered host region goes straight between the region and the device
// from this size on; a smaller one is copied into the launch's staging, whose single H2D (and
// D2H) copy costs less than a copy call of its own.
constexpr size_t kDirectStepBytes = size_t{64} << 10;

// How one member of a step launch moves its tensors: straight between the device and where they
// lie (a GPU region, always; a host region registered with the device, when large), or through
// the launch's pinned staging (false).
struct StepRoute {
  bool q = false, k = false, v = false, o = false, lse = false;
  bool device = false;  // the direct ones are device addresses (GPU regions)
  bool AnyInput() const { return q || k || v; }
};

size_t StepLseBytes(const AttendJob& job) {
  return job.return_lse ? sizeof(float) * size_t(job.key.num_heads) * job.total_q : 0;
}

StepRoute RouteOf(const AttendJob& job) {
  if (job.device_tensors) return {true, true, true, true, job.return_lse, true};
  const AttendJob::HostRegistered& r = job.host_registered;
  auto large = [](size_t bytes) { return bytes >= kDirectStepBytes; };
  return {r.q && large(job.q_bytes.size()), r.k && large(job.k_bytes.size()),
          r.v && large(job.v_bytes.size()), r.o && large(job.q_bytes.size()),
          r.lse && large(StepLseBytes(job)), false};
}

// A launch of one step whose tensors all lie in GPU regions, 16-byte aligned (as the kernels and
// the row copies read and write them): the kernel reads q and writes o and lse in the regions,
// and the new keys and values are appended from there; nothing is copied for the tensors.
bool RunsInPlace(std::span<const std::unique_ptr<AttendJob>> jobs, const StepLaunch& l) {
  if (l.members.size() != 1) return false;
  const AttendJob& job = *jobs[l.members[0]];
  if (!job.device_tensors) return false;
  return Aligned16(job.q_bytes.data()) && Aligned16(job.k_bytes.data()) &&
         Aligned16(job.v_bytes.data()) && Aligned16(job.o_out) &&
         (!job.return_lse || Aligned16(job.lse_out));
}

// Where each part of a step launch lives in its staging buffer (pinned) and its device copy, and
// in the output buffer. A launch in place has no room for the tensors (sizes 0).
struct StepLayout {
  size_t q = 0, k = 0, v = 0;                           // packed q, k_new, v_new
  size_t cu_q = 0, indptr = 0, indices = 0, seqlens = 0;  // int32 arrays
  size_t copy_src = 0, copy_dst = 0, append = 0;          // int64 pool rows
  size_t in_bytes = 0;
  size_t o = 0, lse = 0, out_bytes = 0;
  bool any_lse = false;
};

}  // namespace

// A finished step launch's outputs in pinned memory until every member's are in its response;
// shared by the tasks that copy them, the last of which gives the buffer back to its pool.
struct StepResults {
  PinnedBuffer host_out;
  size_t o = 0, lse = 0;           // offsets of o and lse in host_out
  std::vector<int32_t> first_row;  // per job of the batch: its first row in the launch, or -1
  // Per job of the batch: whether its o, and its lse, come back through host_out (else the
  // launch wrote them straight into its output regions: nothing left to copy).
  std::vector<uint8_t> o_staged, lse_staged;
  int32_t total_q = 0, heads = 0;
};

namespace {

StepLayout PlanStepLayout(const BatchKey& key, const StepLaunch& l, bool any_lse, bool in_place) {
  StepLayout s;
  const size_t tokens = in_place ? 0 : size_t(l.total_q);
  const size_t q_bytes = tokens * key.num_heads * key.head_dim * 2;
  const size_t kv_bytes = tokens * key.num_kv_heads * key.head_dim * 2;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += AlignUp(bytes);
    return here;
  };
  s.q = take(q_bytes);
  s.k = take(kv_bytes);
  s.v = take(kv_bytes);
  s.cu_q = take(4 * l.cu_seqlens_q.size());
  s.indptr = take(4 * l.page_indptr.size());
  s.indices = take(4 * std::max<size_t>(l.page_indices.size(), 1));
  s.seqlens = take(4 * l.seqlens_k.size());
  s.copy_src = take(8 * l.copies.size());
  s.copy_dst = take(8 * l.copies.size());
  s.append = take(8 * l.append_rows.size());
  s.in_bytes = at;
  s.any_lse = any_lse;
  s.o = 0;
  s.lse = AlignUp(q_bytes);
  s.out_bytes = s.lse + (any_lse ? sizeof(float) * key.num_heads * tokens : 0);
  return s;
}

// The launch's staged inputs, gathered on the host into its pinned staging buffer: the tensors
// that do not go direct, and the page table and row lists.
void StageStepInputs(std::span<std::unique_ptr<AttendJob>> jobs, const StepLaunch& l,
                     std::span<const StepRoute> routes, const StepLayout& s, char* host) {
  size_t q_at = s.q, k_at = s.k, v_at = s.v;
  for (size_t m = 0; m < l.members.size(); ++m) {
    const AttendJob& job = *jobs[l.members[m]];
    if (!routes[m].q) std::memcpy(host + q_at, job.q_bytes.data(), job.q_bytes.size());
    if (!routes[m].k) std::memcpy(host + k_at, job.k_bytes.data(), job.k_bytes.size());
    if (!routes[m].v) std::memcpy(host + v_at, job.v_bytes.data(), job.v_bytes.size());
    q_at += job.q_bytes.size();
    k_at += job.k_bytes.size();
    v_at += job.v_bytes.size();
  }
  auto put = [host](size_t at, const auto& v) {
    std::memcpy(host + at, v.data(), v.size() * sizeof(v[0]));
  };
  put(s.cu_q, l.cu_seqlens_q);
  put(s.indptr, l.page_indptr);
  put(s.indices, l.page_indices);
  put(s.seqlens, l.seqlens_k);
  std::vector<int64_t> src(l.copies.size()), dst(l.copies.size());
  for (size_t i = 0; i < l.copies.size(); ++i) {
    src[i] = l.copies[i].src_row;
    dst[i] = l.copies[i].dst_row;
  }
  put(s.copy_src, src);
  put(s.copy_dst, dst);
  put(s.append, l.append_rows);
}

// The launch's inputs onto the device (async, on s): the staging buffer in one copy when no
// member goes direct; else its page table and row lists in one, and each tensor on its own, from
// staging or straight from its region (a GPU region's on the device).
absl::Status CopyStepInputs(std::span<std::unique_ptr<AttendJob>> jobs, const StepLaunch& l,
                            std::span<const StepRoute> routes, const StepLayout& s,
                            const char* host, char* dev, cudaStream_t stream) {
  const bool any_direct =
      std::any_of(routes.begin(), routes.end(), [](const StepRoute& r) { return r.AnyInput(); });
  if (!any_direct) {
    RETURN_IF_CUDA_ERROR("H2D copy",
                         cudaMemcpyAsync(dev, host, s.in_bytes, cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }
  RETURN_IF_CUDA_ERROR("H2D copy", cudaMemcpyAsync(dev + s.cu_q, host + s.cu_q,
                                                   s.in_bytes - s.cu_q, cudaMemcpyHostToDevice,
                                                   stream));
  size_t q_at = s.q, k_at = s.k, v_at = s.v;
  for (size_t m = 0; m < l.members.size(); ++m) {
    const AttendJob& job = *jobs[l.members[m]];
    const StepRoute& r = routes[m];
    const std::tuple<std::string_view, bool, size_t*> parts[] = {
        {job.q_bytes, r.q, &q_at}, {job.k_bytes, r.k, &k_at}, {job.v_bytes, r.v, &v_at}};
    for (const auto& [bytes, direct, at] : parts) {
      const char* src = direct ? bytes.data() : host + *at;
      const bool d2d = direct && r.device;
      RETURN_IF_CUDA_ERROR(d2d ? "D2D copy" : "H2D copy",
                           cudaMemcpyAsync(dev + *at, src, bytes.size(),
                                           d2d ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice,
                                           stream));
      *at += bytes.size();
    }
  }
  return absl::OkStatus();
}

// The launch's outputs off the device (async, on s): into staging in one copy when no member
// goes direct; else each member's o (and lse, a strided block of the launch's
// [num_heads, total_q]) into staging or straight into its region.
absl::Status CopyStepOutputs(std::span<std::unique_ptr<AttendJob>> jobs, const StepLaunch& l,
                             std::span<const StepRoute> routes, const StepLayout& s,
                             const char* dev, char* host, cudaStream_t stream) {
  const bool any_direct = std::any_of(routes.begin(), routes.end(),
                                      [](const StepRoute& r) { return r.o || r.lse; });
  if (!any_direct) {
    RETURN_IF_CUDA_ERROR("D2H copy",
                         cudaMemcpyAsync(host, dev, s.out_bytes, cudaMemcpyDeviceToHost, stream));
    return absl::OkStatus();
  }
  const int32_t heads = jobs.front()->key.num_heads;
  bool staged_lse = false;
  for (size_t m = 0; m < l.members.size(); ++m) {
    AttendJob& job = *jobs[l.members[m]];
    const StepRoute& r = routes[m];
    const size_t o_bytes = job.q_bytes.size();
    const size_t at = s.o + size_t(l.cu_seqlens_q[m]) * (o_bytes / size_t(job.total_q));
    const cudaMemcpyKind o_kind =
        r.o && r.device ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost;
    RETURN_IF_CUDA_ERROR("D2H copy", cudaMemcpyAsync(r.o ? job.o_out : host + at, dev + at,
                                                     o_bytes, o_kind, stream));
    if (!job.return_lse) continue;
    if (!r.lse) {
      staged_lse = true;
      continue;
    }
    const size_t row = sizeof(float) * job.total_q;
    RETURN_IF_CUDA_ERROR(
        "D2H copy",
        cudaMemcpy2DAsync(job.lse_out, row, dev + s.lse + sizeof(float) * l.cu_seqlens_q[m],
                          sizeof(float) * l.total_q, row, heads,
                          r.device ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost, stream));
  }
  if (staged_lse) {  // the whole lse of the launch: small next to o
    RETURN_IF_CUDA_ERROR("D2H copy", cudaMemcpyAsync(host + s.lse, dev + s.lse,
                                                     s.out_bytes - s.lse, cudaMemcpyDeviceToHost,
                                                     stream));
  }
  return absl::OkStatus();
}

// Job i's o (and lse, a strided block of the launch's [num_heads, total_q]), where they came back
// through staging, from the pinned output buffer into its response (or output regions).
void UnstageStepOutput(AttendJob& job, const StepResults& r, size_t i) {
  const char* out = static_cast<const char*>(r.host_out.data());
  const int32_t q0 = r.first_row[i];
  const size_t o_bytes = job.q_bytes.size();
  const size_t row = o_bytes / size_t(job.total_q);
  if (r.o_staged[i]) std::memcpy(StepOutput(job), out + r.o + size_t(q0) * row, o_bytes);
  if (!job.return_lse || !r.lse_staged[i]) return;
  float* lse = StepLse(job);
  const float* all = reinterpret_cast<const float*>(out + r.lse);
  for (int32_t h = 0; h < r.heads; ++h) {
    std::memcpy(lse + size_t(h) * job.total_q, all + size_t(h) * r.total_q + q0,
                sizeof(float) * job.total_q);
  }
}

// Copies job i's outputs (when its step succeeded) and tells its caller.
void FinishStep(AttendJob& job, size_t i, absl::Status st, const StepResults* results) {
  if (st.ok() && results != nullptr && results->first_row[i] >= 0) {
    const auto start = Clock::now();
    UnstageStepOutput(job, *results, i);
    job.host_copy_us = Micros(Clock::now() - start);
  }
  job.done(std::move(st));
}

// Launches of at most this many steps are latency-bound: polled from the start.
constexpr size_t kPolledLaunchSteps = 4;

// Waits for event without a blocking wait, whose interrupt-driven wake-up costs tens of
// microseconds: sleeps through sleep_us (most of a large launch's expected time, leaving the core
// to the transport), then polls, yielding the core, for up to poll_for; then blocks.
cudaError_t PollEvent(cudaEvent_t event, double sleep_us, std::chrono::microseconds poll_for) {
  if (sleep_us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(sleep_us)));
  }
  const auto until = Clock::now() + poll_for;
  cudaError_t e;
  while ((e = cudaEventQuery(event)) == cudaErrorNotReady && Clock::now() < until) {
    std::this_thread::yield();
  }
  return e == cudaErrorNotReady ? cudaEventSynchronize(event) : e;
}

// A small launch (a decode launch is done well within 300 us) is polled at once; a large one
// sleeps through 70% of its expected time first when that is worth a sleep.
cudaError_t WaitForLaunch(cudaEvent_t event, size_t steps, double expected_us) {
  using std::chrono::microseconds;
  if (steps <= kPolledLaunchSteps) return PollEvent(event, 0, microseconds(300));
  return PollEvent(event, expected_us > 50 ? 0.7 * expected_us : 0, microseconds(2000));
}

}  // namespace

std::shared_ptr<const StepResults> CudaBackend::RunSteps(
    Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs, std::span<absl::Status> status,
    BatchReport* report) {
  if (absl::Status health = Health(); !health.ok()) {
    std::fill(status.begin(), status.end(), health);
    return nullptr;
  }
  const StepLaunch l = BeginStepLaunch(jobs, status);
  report->decode = jobs.front()->key.decode;
  absl::Status st;
  std::shared_ptr<StepResults> results;
  if (!l.members.empty()) {
    st = LaunchSteps(lane, jobs, l, report, &results);
    if (!st.ok() && !absl::IsResourceExhausted(st)) NoteIfDeviceLost(lane);
  }
  EndStepLaunch(jobs, l, status, st);
  for (auto& job : jobs) {
    job->batch_requests = static_cast<int32_t>(jobs.size());
    job->batch_tokens = l.total_q;
  }
  return st.ok() ? results : nullptr;
}

void CudaBackend::FinishSteps(Batch batch, std::vector<absl::Status> status,
                              std::shared_ptr<const StepResults> results) {
  const size_t n = batch.size();
  if (n <= kPolledLaunchSteps) {  // latency-bound: no hop to another thread
    for (size_t i = 0; i < n; ++i) FinishStep(*batch[i], i, std::move(status[i]), results.get());
    return;
  }
  // Many steps: copied into their responses and finished over the completion pool, in parallel,
  // while this lane takes its next launch. Each task owns its range of jobs; a job is destroyed
  // (its pending count released) right after its caller is told.
  struct Shared {
    Batch batch;
    std::vector<absl::Status> status;
  };
  auto shared = std::make_shared<Shared>(Shared{std::move(batch), std::move(status)});
  const size_t tasks = std::min<size_t>(n, std::max(options_.completion_threads, 1));
  for (size_t t = 0; t < tasks; ++t) {
    const size_t begin = n * t / tasks, end = n * (t + 1) / tasks;
    completions_->Post([shared, results, begin, end] {
      for (size_t i = begin; i < end; ++i) {
        FinishStep(*shared->batch[i], i, std::move(shared->status[i]), results.get());
        shared->batch[i].reset();
      }
    });
  }
}

// Stages the launch, appends into the KV region, runs the paged kernel and brings the outputs
// back, into pinned staging (*results, for FinishStep to copy into the responses) or straight
// into output regions; waits for the stream. Tensors in GPU regions never touch the host; those
// of a launch in place are not copied at all (RunsInPlace).
absl::Status CudaBackend::LaunchSteps(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                      const StepLaunch& l, BatchReport* report,
                                      std::shared_ptr<StepResults>* results) {
  const BatchKey& key = jobs.front()->key;
  bool any_lse = false;
  std::vector<StepRoute> routes;
  routes.reserve(l.members.size());
  for (size_t i : l.members) {
    any_lse |= jobs[i]->return_lse;
    routes.push_back(RouteOf(*jobs[i]));
  }
  const bool in_place = RunsInPlace(jobs, l);
  const AttendJob& first = *jobs[l.members.front()];
  const StepLayout layout = PlanStepLayout(key, l, any_lse, in_place);
  bool staged_out = false;  // some output comes back through staging
  for (size_t m = 0; m < l.members.size(); ++m) {
    staged_out |= !routes[m].o || (jobs[l.members[m]]->return_lse && !routes[m].lse);
  }
  ASSIGN_OR_RETURN(PinnedBuffer host_in, pinned_pool_->Acquire(layout.in_bytes));
  PinnedBuffer host_out;
  if (staged_out) {
    ASSIGN_OR_RETURN(host_out, pinned_pool_->Acquire(layout.out_bytes));
  }
  char* host = static_cast<char*>(host_in.data());
  StageStepInputs(jobs, l, routes, layout, host);
  DeviceBuffer dev_in(device_pool_.get(), lane.stream), dev_out(device_pool_.get(), lane.stream);
  RETURN_IF_ERROR(dev_in.Allocate(layout.in_bytes));
  RETURN_IF_ERROR(dev_out.Allocate(in_place ? 0 : layout.out_bytes));
  char* in = dev_in.get();

  kernels::AttentionArgs args = StepLaunchArgs(key, l, static_cast<int32_t>(kv_.num_pages));
  args.q = in_place ? first.q_bytes.data() : in + layout.q;
  args.k = kv_.k;
  args.v = kv_.v;
  args.o = in_place ? first.o_out : dev_out.get() + layout.o;
  float* dev_lse = reinterpret_cast<float*>(dev_out.get() + layout.lse);
  args.lse = !any_lse ? nullptr : in_place ? reinterpret_cast<float*>(first.lse_out) : dev_lse;
  args.cu_seqlens_q = reinterpret_cast<const int32_t*>(in + layout.cu_q);
  args.paged.page_indptr = reinterpret_cast<const int32_t*>(in + layout.indptr);
  args.paged.page_indices = reinterpret_cast<const int32_t*>(in + layout.indices);
  args.paged.seqlens_k = reinterpret_cast<const int32_t*>(in + layout.seqlens);
  RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::CanImplement(args)));
  DeviceBuffer workspace(device_pool_.get(), lane.stream);
  RETURN_IF_ERROR(workspace.Allocate(kernels::cuda::WorkspaceBytes(args)));
  const char* new_k = in_place ? first.k_bytes.data() : in + layout.k;
  const char* new_v = in_place ? first.v_bytes.data() : in + layout.v;

  const int64_t row = int64_t{key.num_kv_heads} * key.head_dim * 2;
  cudaStream_t s = lane.stream;
  SyncStreamUnlessDone sync_on_error(s);  // before pages or staging go back on an error
  cudaEvent_t* ev = lane.events;
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[0], s));
  if (in_place) {  // the page table and row lists only
    RETURN_IF_CUDA_ERROR("H2D copy", cudaMemcpyAsync(in, host, layout.in_bytes,
                                                     cudaMemcpyHostToDevice, s));
  } else {
    RETURN_IF_ERROR(CopyStepInputs(jobs, l, routes, layout, host, in, s));
  }
  // Copy-on-write first (rows of shared pages into the step's copies), then the new rows.
  RETURN_IF_CUDA_ERROR("KV copy-on-write",
                       LaunchKvCopyRows(kv_.k, kv_.v,
                                        reinterpret_cast<const int64_t*>(in + layout.copy_src),
                                        kv_.k, kv_.v,
                                        reinterpret_cast<const int64_t*>(in + layout.copy_dst),
                                        static_cast<int64_t>(l.copies.size()), row, s));
  RETURN_IF_CUDA_ERROR("KV append",
                       LaunchKvCopyRows(new_k, new_v, nullptr, kv_.k, kv_.v,
                                        reinterpret_cast<const int64_t*>(in + layout.append),
                                        l.total_q, row, s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[1], s));
  RETURN_IF_CUDA_ERROR("attention kernel", kernels::cuda::Run(args, workspace.get(), s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[2], s));
  if (!in_place) {
    RETURN_IF_ERROR(CopyStepOutputs(jobs, l, routes, layout, dev_out.get(),
                                    static_cast<char*>(host_out.data()), s));
  }
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[3], s));
  // A small launch (a lone step, latency-bound) is polled; a large one (many sessions at once)
  // sleeps through most of its expected time first, leaving the core to the transport.
  const double bytes = l.kv_bytes_read + double(layout.in_bytes + layout.out_bytes);
  RETURN_IF_CUDA_ERROR("batch completion", WaitForLaunch(ev[3], l.members.size(),
                                                         lane.device_us_per_byte * bytes));
  sync_on_error.Done();

  const double in_ms = ElapsedMs(ev[0], ev[1]), kernel_ms = ElapsedMs(ev[1], ev[2]);
  const double out_ms = ElapsedMs(ev[2], ev[3]);
  const double device_us = (in_ms + kernel_ms + out_ms) * 1e3;
  if (l.members.size() > kPolledLaunchSteps) {
    // The fastest rate seen lately: a launch that runs faster than it (a decode after prefills,
    // which are compute-bound) would otherwise be slept through.
    const double rate = device_us / bytes;
    lane.device_us_per_byte =
        lane.device_us_per_byte == 0 ? rate : std::min(rate, 1.02 * lane.device_us_per_byte);
  }
  report->compute_seconds += kernel_ms * 1e-3;
  report->transfer_seconds += (in_ms + out_ms) * 1e-3;
  report->step_launches += 1;
  report->tokens = l.total_q;
  // FLOPs from the host copy of the page table (args' arrays are device pointers).
  const kernels::AttentionArgs host_args =
      StepLaunchArgs(key, l, static_cast<int32_t>(kv_.num_pages));
  report->flops += kernels::AttentionFlops(host_args, l.cu_seqlens_q.data(), nullptr);
  report->kv_bytes_read += l.kv_bytes_read;
  report->bytes += l.kv_bytes_read + 2.0 * 2.0 * l.total_q * key.num_heads * key.head_dim;
  for (size_t i : l.members) {
    jobs[i]->transfer_us = (in_ms + out_ms) * 1e3;
    jobs[i]->compute_us = kernel_ms * 1e3;
  }
  auto r = std::make_shared<StepResults>();
  r->host_out = std::move(host_out);
  r->o = layout.o;
  r->lse = layout.lse;
  r->total_q = l.total_q;
  r->heads = key.num_heads;
  r->first_row.assign(jobs.size(), -1);
  r->o_staged.assign(jobs.size(), 0);
  r->lse_staged.assign(jobs.size(), 0);
  for (size_t m = 0; m < l.members.size(); ++m) {
    const size_t i = l.members[m];
    r->first_row[i] = l.cu_seqlens_q[m];
    r->o_staged[i] = !routes[m].o;
    r->lse_staged[i] = jobs[i]->return_lse && !routes[m].lse;
  }
  *results = std::move(r);
  return absl::OkStatus();
}

void CudaBackend::NoteIfDeviceLost(Lane& lane) {
  const cudaError_t e = cudaStreamQuery(lane.stream);
  if (!IsStickyError(e)) return;
  int expected = cudaSuccess;
  if (sticky_error_.compare_exchange_strong(expected, e)) {
    std::fprintf(stderr, "attnd: the GPU context is unusable after %s: %s; restart attnd\n",
                 cudaGetErrorName(e), cudaGetErrorString(e));
  }
}

absl::Status CudaBackend::Health() const {
  const auto e = static_cast<cudaError_t>(sticky_error_.load());
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "the GPU context of this attnd is unusable after ", cudaGetErrorName(e), " (",
      cudaGetErrorString(e), "); retry on another replica, this one must be restarted"));
}

absl::StatusOr<GpuImport> CudaBackend::ImportIpcMemory(const std::string& handle,
                                                       int32_t device_id, uint64_t bytes) {
  if (device_id != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat("device_id ", device_id, " is not attnd's GPU (",
                                                   options_.device, ")"));
  }
  RETURN_IF_ERROR(Health());
  cudaIpcMemHandle_t h;
  static_assert(sizeof(h) == 64);
  std::memcpy(&h, handle.data(), sizeof(h));
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  void* ptr = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc_handle could not be opened (", cudaGetErrorString(e),
        "): it must come from cudaIpcGetMemHandle in another process on this host, of memory "
        "still allocated"));
  }
  // The allocation's extent, from the driver (through the runtime, so that attnd does not link
  // libcuda): bytes must lie inside it, else a kernel could read past it.
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  size_t extent = 0;
  CUdeviceptr base = 0;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess ||
      reinterpret_cast<GetRange>(fn)(&base, &extent, reinterpret_cast<CUdeviceptr>(ptr)) !=
          CUDA_SUCCESS) {
    cudaIpcCloseMemHandle(ptr);
    return absl::InternalError("cannot find the extent of the imported GPU memory");
  }
  const uint64_t usable = extent - (reinterpret_cast<CUdeviceptr>(ptr) - base);
  if (bytes > usable) {
    cudaIpcCloseMemHandle(ptr);
    return absl::InvalidArgumentError(absl::StrCat("bytes ", bytes, " exceeds the ", usable,
                                                   " bytes of the shared GPU allocation"));
  }
  GpuImport out;
  out.data = static_cast<char*>(ptr);
  out.bytes = bytes;
  out.release = [ptr, device = options_.device] {
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(ptr);
  };
  return out;
}

absl::StatusOr<GpuImport> CudaBackend::ImportVmmMemory(int fd, int32_t device_id,
                                                       uint64_t bytes) {
  if (device_id != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat("device_id ", device_id, " is not attnd's GPU (",
                                                   options_.device, ")"));
  }
  RETURN_IF_ERROR(Health());
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  return ImportVmmAllocation(fd, options_.device, bytes);
}

absl::StatusOr<std::function<void()>> CudaBackend::RegisterHostMemory(char* data,
                                                                      uint64_t bytes) {
  RETURN_IF_ERROR(Health());
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  if (cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterPortable); e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::ResourceExhaustedError(absl::StrCat(
        "cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  return std::function<void()>([data, device = options_.device] {
    cudaSetDevice(device);
    cudaHostUnregister(data);
  });
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
