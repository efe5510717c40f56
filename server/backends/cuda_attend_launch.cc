// The Attend part of the CUDA backend: staging of each request into pinned memory (on its
// caller's thread), the packed launch of a batch and the launches in place over GPU regions, and
// the outputs' way back (sent from the pinned staging they were copied into).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include "attn/kernels/cuda_attention.h"
#include "backends/cuda_backend.h"
#include "backends/cuda_util.h"
#include "common/status_util.h"

namespace attn {
namespace {

// One request on the CUDA backend: where the launch copies its q, k and v from and its o and lse
// (lse as [num_heads, total_q] fp32) to. Each is either in pinned staging (`in`, `out`, owned
// here and returned to the pool when the job lets go of its state), or, with no staging, in a
// host region registered with the device (Job::host_registered) or a GPU region
// (device_tensors): the job's region_holds keep those mapped.
struct CudaJobState : BackendJobState {
  PinnedBuffer in;   // staged inputs, in the compute dtype (FP8: codes), back to back (q, k, v)
  PinnedBuffer out;  // outputs that come back through staging (o, then lse)
  size_t q_bytes = 0, kv_bytes = 0, o_bytes = 0;  // in the compute dtype (FP8: codes)
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

// Bytes of one element of q and of k/v as staged: FP8 codes stay one byte, the rest is 16-bit.
size_t QElementBytes(const BatchKey& key) { return key.fp8_q ? 1 : 2; }
size_t KvElementBytes(const BatchKey& key) { return key.fp8_kv ? 1 : 2; }

// Where each part of a packed launch lives inside the device input and output buffers. The
// sequence offsets and FP8 descales ([num_seqs, num_kv_heads] float32 each) are staged on the host
// as they lie on the device (from cu_q on), copied in one piece.
struct PackedLayout {
  int32_t total_q = 0, total_k = 0, num_seqs = 0, max_q = 0, max_k = 0;
  size_t q = 0, k = 0, v = 0, cu_q = 0, cu_k = 0, in_bytes = 0;  // offsets into the input
  size_t k_scales = 0, v_scales = 0, q_scales = 0;  // FP8 descales (fp8_kv; q's: fp8_q)
  size_t q_wide = 0;  // fp8_q: q converted to o's 16-bit type
  size_t cu_region = 0;  // cu_q, cu_k and the descales, together
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
  const size_t o_bytes = size_t(l.total_q) * key.num_heads * key.head_dim * 2;
  const size_t q_bytes = size_t(l.total_q) * key.num_heads * key.head_dim * QElementBytes(key);
  const size_t kv_bytes =
      size_t(l.total_k) * key.num_kv_heads * key.head_dim * KvElementBytes(key);
  const size_t cu_bytes = AlignUp(sizeof(int32_t) * (size_t(l.num_seqs) + 1));
  const size_t scale_bytes =
      key.fp8_kv ? AlignUp(sizeof(float) * size_t(l.num_seqs) * key.num_kv_heads) : 0;
  l.q = 0;
  l.k = AlignUp(q_bytes);
  l.v = l.k + AlignUp(kv_bytes);
  l.cu_q = l.v + AlignUp(kv_bytes);
  l.cu_k = l.cu_q + cu_bytes;
  l.k_scales = l.cu_k + cu_bytes;
  l.v_scales = l.k_scales + scale_bytes;
  l.q_scales = l.v_scales + scale_bytes;
  const size_t staged_end = l.q_scales + (key.fp8_q ? scale_bytes : 0);
  l.cu_region = staged_end - l.cu_q;
  l.q_wide = staged_end;
  l.in_bytes = l.q_wide + (key.fp8_q ? AlignUp(o_bytes) : 0);
  l.o = 0;
  l.lse = AlignUp(o_bytes);
  l.out_bytes = l.lse + (l.any_lse ? sizeof(float) * key.num_heads * size_t(l.total_q) : 0);
  return l;
}

// fp32 requests run in fp16 when every value fits it, else in bf16.
kernels::DType ComputeDType(const AttendJob& job) {
  if (job.key.wire_dtype != kernels::DType::kFloat32) return job.key.wire_dtype;
  // FP8 k and v are codes, computed on in q's 16-bit type: only q decides.
  const size_t tensors = job.key.fp8_kv ? 1 : 3;
  const std::string_view all[] = {job.q_bytes, job.k_bytes, job.v_bytes};
  for (std::string_view t : std::span(all, tensors)) {
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

// q, k and v into pinned staging in the compute dtype, except those in a host region registered
// with the device that need no conversion: the launch copies those straight from the region.
absl::Status StageInputs(const AttendJob& job, kernels::DType compute, PinnedPool& pool,
                         const HostCopier& copier, CudaJobState& state) {
  // FP8 codes are staged as they came; the rest in the compute dtype.
  const ElementCast cast = StagingCast(job.key.wire_dtype, compute);
  const ElementCast q_cast = job.key.fp8_q ? ElementCast::kNone : cast;
  const ElementCast kv_cast = job.key.fp8_kv ? ElementCast::kNone : cast;
  const Job::HostRegistered& reg = job.host_registered;
  struct Part {
    std::string_view src;
    ElementCast cast;
    bool direct;
    size_t bytes;  // staged
    const char** to;
  };
  const bool q_as_is = q_cast == ElementCast::kNone, kv_as_is = kv_cast == ElementCast::kNone;
  const Part parts[] = {{job.q_bytes, q_cast, q_as_is && reg.q, state.q_bytes, &state.q_src},
                        {job.k_bytes, kv_cast, kv_as_is && reg.k, state.kv_bytes, &state.k_src},
                        {job.v_bytes, kv_cast, kv_as_is && reg.v, state.kv_bytes, &state.v_src}};
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
    copies[n++] = StagingCopy(p.src, p.cast, at);
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

double TensorBytes(const BatchKey& key, double total_q, double total_k) {
  return 2.0 * key.head_dim * (2.0 * total_q * key.num_heads + 2.0 * total_k * key.num_kv_heads);
}

// From this size of q on, a request whose tensors all lie in GPU regions is run by a launch of
// its own that reads and writes the regions in place. A smaller one is gathered into the packed
// launch: one launch for many small requests fills the device, where one launch each would not.
constexpr size_t kInPlaceAttendBytes = size_t{1} << 20;

}  // namespace

bool CudaBackend::AttendsInPlace(const AttendJob& job) {
  // The kernels read q, k and v and write o and lse 16 bytes at a time. FP8 inputs go through the
  // packed launch, which stages their descales on the device.
  return job.device_tensors && !job.key.fp8_kv && job.q_bytes.size() >= kInPlaceAttendBytes &&
         Aligned16(job.q_bytes.data()) && Aligned16(job.k_bytes.data()) &&
         Aligned16(job.v_bytes.data()) && Aligned16(job.o_out) &&
         (!job.return_lse || Aligned16(job.lse_out));
}

void CudaBackend::UnstageOutputs(AttendJob& job) const {
  CudaJobState& state = StateOf(job);
  const ElementCast cast = UnstagingCast(job.key.wire_dtype, *job.key.staged_dtype);
  const size_t lse_bytes = job.LseBytes();
  // What came back in 16 bits for a 16-bit request is sent from the pinned staging as it is.
  const bool o_as_is = !state.o_direct && job.o_out == nullptr && cast == ElementCast::kNone;
  const bool lse_as_is = job.return_lse && !state.lse_direct && job.lse_out == nullptr;
  if (o_as_is || lse_as_is) {
    const char* base = static_cast<const char*>(state.out.data());
    const OutputBytes out = state_->AsOutput(std::move(state.out));
    if (o_as_is) job.o = out.Part(state.o_dst - base, state.o_bytes);
    if (lse_as_is) job.lse = out.Part(state.lse_dst - base, lse_bytes);
  }
  HostCopy copies[2];
  size_t n = 0;
  if (!state.o_direct && !o_as_is) {
    // Into an output region the device does not write directly, or converted back to float32.
    if (job.o_out == nullptr) {
      job.o = OutputBytes::Allocate(job.OBytes());
      job.o_out = job.o.data;
    }
    copies[n++] = {state.o_dst, job.o_out,
                   cast == ElementCast::kNone ? state.o_bytes : state.o_bytes / 2, cast};
  }
  if (job.return_lse && !state.lse_direct && !lse_as_is) {
    copies[n++] = {state.lse_dst, job.lse_out, lse_bytes, ElementCast::kNone};
  }
  copier_->Run({copies, n});
}

absl::Status CudaBackend::StageWireInputs(AttendJob& job, const WireTensors& in) {
  const bool all_inline = in.q.size > 0 && in.k.size > 0 && in.v.size > 0;
  if (job.key.wire_dtype == kernels::DType::kFloat32 || !all_inline) {
    return Backend::StageWireInputs(job, in);
  }
  RETURN_IF_ERROR(Health());
  const auto start = Clock::now();
  auto state = std::make_unique<CudaJobState>();
  ASSIGN_OR_RETURN(state->in,
                   state_->pinned_pool().Acquire(in.q.size + in.k.size + in.v.size));
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
  state.q_bytes = size_t(job.total_q) * key.num_heads * key.head_dim * QElementBytes(key);
  state.kv_bytes = size_t(job.total_k) * key.num_kv_heads * key.head_dim * KvElementBytes(key);
  state.o_bytes = size_t(job.total_q) * key.num_heads * key.head_dim * 2;
  if (state.inputs_staged) {
    const char* in = static_cast<const char*>(state.in.data());
    state.q_src = in;
    state.k_src = in + state.q_bytes;
    state.v_src = in + state.q_bytes + state.kv_bytes;
  } else {
    RETURN_IF_ERROR(StageInputs(job, compute, state_->pinned_pool(), *copier_, state));
  }
  RETURN_IF_ERROR(PlaceOutputs(job, state_->pinned_pool(), state));
  job.key.staged_dtype = compute;
  job.host_copy_us += Micros(Clock::now() - start);
  return absl::OkStatus();
}

void CudaBackend::RunSplittingOnExhaustion(Lane& lane, std::span<std::unique_ptr<AttendJob>> jobs,
                                           std::span<absl::Status> status, BatchReport* report) {
  absl::Status st = Launch(lane, jobs, report);
  if (!st.ok() && !absl::IsResourceExhausted(st)) state_->NoteIfDeviceLost(lane.stream);
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
  ASSIGN_OR_RETURN(PinnedBuffer host_cu, state_->pinned_pool().Acquire(layout.cu_region));
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
  if (key.fp8_kv) {  // the descales, [num_seqs, num_kv_heads] each, behind the offsets
    char* staged = static_cast<char*>(host_cu.data());
    auto* k_scales = reinterpret_cast<float*>(staged + (layout.k_scales - layout.cu_q));
    auto* v_scales = reinterpret_cast<float*>(staged + (layout.v_scales - layout.cu_q));
    auto* q_scales = reinterpret_cast<float*>(staged + (layout.q_scales - layout.cu_q));
    size_t at = 0;
    for (const auto& job : jobs) {
      std::copy(job->k_descales.begin(), job->k_descales.end(), k_scales + at);
      std::copy(job->v_descales.begin(), job->v_descales.end(), v_scales + at);
      if (key.fp8_q) std::copy(job->q_descales.begin(), job->q_descales.end(), q_scales + at);
      at += job->k_descales.size();
    }
  }

  DevicePool* pool = &state_->device_pool();
  DeviceBuffer dev_in(pool, lane.stream), dev_out(pool, lane.stream);
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
  if (key.fp8_kv) {
    args.kv_dtype = kernels::DType::kFloat8E4M3;
    args.kv_scales = {reinterpret_cast<const float*>(dev_in.get() + layout.k_scales),
                      reinterpret_cast<const float*>(dev_in.get() + layout.v_scales)};
  }
  // All-FP8: the FP8 tensor-core kernel on the codes where it is chosen and serves the launch;
  // else q's codes are converted (with their descales) into o's type before the 16-bit kernel.
  const void* q_codes = args.q;
  // (Decode shapes keep the FP8 decode kernel: bound by the bytes of K/V, not by the products.)
  const bool fp8_tensor_cores = key.fp8_q && options_.fp8_attend_tensor_cores &&
                                !kernels::cuda::UsesDecodeKernel(args) &&
                                kernels::cuda::CanImplementFp8Attention(args).ok();
  if (key.fp8_q && !fp8_tensor_cores) args.q = dev_in.get() + layout.q_wide;
  RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::CanImplement(args)));
  DeviceBuffer workspace(pool, lane.stream);
  RETURN_IF_ERROR(workspace.Allocate(fp8_tensor_cores
                                         ? kernels::cuda::Fp8AttentionWorkspaceBytes(args)
                                         : kernels::cuda::WorkspaceBytes(args)));
  const auto* q_descales = reinterpret_cast<const float*>(dev_in.get() + layout.q_scales);

  cudaStream_t s = lane.stream;
  SyncStreamUnlessDone sync_on_error(s);  // destroyed before the staging buffers go back
  cudaEvent_t* ev = lane.events;
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[0], s));
  RETURN_IF_ERROR(CopyInputs(jobs, layout, host_cu, dev_in.get(), s));
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[1], s));
  if (fp8_tensor_cores) {
    RETURN_IF_CUDA_ERROR("FP8 attention kernel",
                         kernels::cuda::RunFp8Attention(args, q_descales, workspace.get(), s));
  } else {
    if (key.fp8_q) {
      RETURN_IF_CUDA_ERROR("FP8 q conversion",
                           kernels::cuda::DequantizeFp8Q(args, q_codes, q_descales,
                                                         const_cast<void*>(args.q), s));
    }
    RETURN_IF_CUDA_ERROR("attention kernel", kernels::cuda::Run(args, workspace.get(), s));
  }
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
  ASSIGN_OR_RETURN(PinnedBuffer host_cu, state_->pinned_pool().Acquire(cu_bytes));
  DevicePool* pool = &state_->device_pool();
  DeviceBuffer dev_cu(pool, lane.stream), workspace(pool, lane.stream);
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

}  // namespace attn
