#include "backends/cuda_step_device.h"

#include <algorithm>
#include <cstdio>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/kernels/cuda_attention.h"
#include "backends/kv_copy.h"
#include "backends/segment_copy.h"
#include "common/status_util.h"

namespace attn {
namespace {

// A member's tensor in a registered host region goes straight between the region and the device
// from this size on; a smaller one is copied into the launch's staging, whose single H2D (and
// D2H) copy costs less than a copy call of its own.
constexpr size_t kDirectStepBytes = size_t{64} << 10;

// The decode kernel writes a launch's outputs straight into the pinned output staging up to
// this size: a copy call and its place in the launch's chain cost more than the kernel's stores
// over the bus. Beyond it (a BatchStep of 64 steps: 512 KiB of o) the stores slow the kernel by
// about what the copy would take (H100: +58 us of kernel, -53 us of copy), so the copy stays.
constexpr size_t kHostOutputBytes = size_t{64} << 10;

// Launches of at most this many steps are latency-bound: polled from the start.
constexpr size_t kPolledLaunchSteps = 4;

// A small launch (a decode launch is done well within 300 us) is polled at once where the
// pipeline lets it poll (no other lane at work), else waited for asleep in the driver (the event
// blocks): several lanes' polls would take cores the transport needs. A large one sleeps through
// 70% of its expected time first when that is worth a sleep, and is polled for the rest.
cudaError_t WaitForLaunch(cudaEvent_t event, size_t steps, double expected_us, bool poll) {
  using std::chrono::microseconds;
  if (steps <= kPolledLaunchSteps) {
    return poll ? PollEvent(event, 0, microseconds(300)) : cudaEventSynchronize(event);
  }
  return PollEvent(event, expected_us > 50 ? 0.7 * expected_us : 0, microseconds(2000));
}

// Byte ranges of a staging buffer to copy, merged where they touch or lie close: the parts of a
// launch that go through staging, whose holes are the direct members' parts.
class StagedRanges {
 public:
  void Add(size_t begin, size_t bytes) {
    if (bytes > 0) ranges_.push_back({begin, begin + bytes});
  }
  // One copy per merged range from src to dst (same offsets).
  absl::Status Copy(char* dst, const char* src, cudaMemcpyKind kind, cudaStream_t stream) {
    std::sort(ranges_.begin(), ranges_.end());
    size_t merged = 0;
    for (const auto& range : ranges_) {
      if (merged > 0 && range.first <= ranges_[merged - 1].second + kMergeGap) {
        ranges_[merged - 1].second = std::max(ranges_[merged - 1].second, range.second);
      } else {
        ranges_[merged++] = range;
      }
    }
    ranges_.resize(merged);
    for (const auto& [begin, end] : ranges_) {
      RETURN_IF_CUDA_ERROR(kind == cudaMemcpyHostToDevice ? "H2D copy" : "D2H copy",
                           cudaMemcpyAsync(dst + begin, src + begin, end - begin, kind, stream));
    }
    return absl::OkStatus();
  }

 private:
  // A gap this small costs less copied along than a copy call of its own.
  static constexpr size_t kMergeGap = size_t{4} << 10;
  std::vector<std::pair<size_t, size_t>> ranges_;
};

// The parts of a launch's input tensors, in staging order, for each member: q, k_new, v_new.
struct InputPart {
  const char* where;  // where the tensor lies (its region or the request)
  size_t bytes;
  bool direct;
};

template <typename Fn>
void ForEachInput(const StepLaunch& l, Fn&& fn) {
  const StepLayout& s = l.layout;
  size_t q_at = s.q, k_at = s.k, v_at = s.v;
  for (size_t m = 0; m < l.members.size(); ++m) {
    const StepJob& job = *l.members[m];
    const StepRoute& r = l.routes[m];
    fn(r, InputPart{job.q_bytes.data(), job.QBytes(), r.q}, q_at);
    fn(r, InputPart{job.k_bytes.data(), job.KvBytes(), r.k}, k_at);
    fn(r, InputPart{job.v_bytes.data(), job.KvBytes(), r.v}, v_at);
    q_at += job.QBytes();
    k_at += job.KvBytes();
    v_at += job.KvBytes();
  }
}

// Whether every output of the launch comes back through its output staging (no region takes
// one straight from the device).
bool AllOutputsStaged(const StepLaunch& l) {
  if (l.in_place || !l.staged_out) return false;
  for (size_t m = 0; m < l.members.size(); ++m) {
    const StepRoute& r = l.routes[m];
    if (r.o || (l.members[m]->return_lse && r.lse)) return false;
  }
  return true;
}

}  // namespace

// Segments of the launch's tensors in GPU regions: inputs gathered into the device's copy of the
// staging (first), outputs scattered from the device's output (after).
int32_t CudaStepDevice::CountSegments(const StepLaunch& l) {
  int32_t n = 0;
  for (size_t m = 0; m < l.members.size(); ++m) {
    const StepRoute& r = l.routes[m];
    if (!r.device) continue;
    n += int32_t{r.q} + int32_t{r.k} + int32_t{r.v} + int32_t{r.o} +
         int32_t{r.lse && l.members[m]->return_lse};
  }
  return n;
}

int32_t CudaStepDevice::FillSegments(const StepLaunch& l, char* dev_in, char* dev_out,
                                     CopySegment* table) {
  int32_t n = 0;
  ForEachInput(l, [&](const StepRoute& r, const InputPart& p, size_t at) {
    if (p.direct && r.device) {
      table[n++] = CopySegment{p.where, dev_in + at, static_cast<int64_t>(p.bytes), 0, 0, 1};
    }
  });
  const int32_t inputs = n;
  const int32_t* cu_q = l.cu_seqlens_q();
  for (size_t m = 0; m < l.members.size(); ++m) {
    const StepJob& job = *l.members[m];
    const StepRoute& r = l.routes[m];
    if (!r.device) continue;
    if (r.o) {
      table[n++] = CopySegment{dev_out + l.OAt(m), job.o_out, static_cast<int64_t>(job.OBytes()),
                               0, 0, 1};
    }
    if (r.lse && job.return_lse) {  // a strided block of the launch's [num_heads, total_q]
      const int64_t row = int64_t{sizeof(float)} * job.total_q;
      table[n++] = CopySegment{dev_out + l.layout.lse + sizeof(float) * cu_q[m], job.lse_out, row,
                               int64_t{sizeof(float)} * l.total_q, row, l.key.num_heads};
    }
  }
  return inputs;
}

// The launch's inputs onto the device (async, on stream): the staged parts and the tables in as
// few copies as they allow; a registered host region's tensor straight from it; the tensors in
// GPU regions gathered by one kernel over the segment table (already on the device).
absl::Status CudaStepDevice::CopyInputs(const StepLaunch& l, char* dev,
                                        const CopySegment* segments, int32_t n,
                                        cudaStream_t stream) {
  const StepLayout& s = l.layout;
  StagedRanges staged;
  ForEachInput(l, [&](const StepRoute&, const InputPart& p, size_t at) {
    if (!p.direct) staged.Add(at, p.bytes);
  });
  staged.Add(s.tables, s.in_bytes - s.tables);
  RETURN_IF_ERROR(staged.Copy(dev, l.in, cudaMemcpyHostToDevice, stream));
  absl::Status st;
  ForEachInput(l, [&](const StepRoute& r, const InputPart& p, size_t at) {
    if (!st.ok() || !p.direct || r.device) return;
    if (cudaError_t e = cudaMemcpyAsync(dev + at, p.where, p.bytes, cudaMemcpyHostToDevice, stream);
        e != cudaSuccess) {
      st = CudaError("H2D copy", e);
    }
  });
  RETURN_IF_ERROR(st);
  RETURN_IF_CUDA_ERROR("segment copies", LaunchSegmentCopies(segments, n, stream));
  return absl::OkStatus();
}

// The launch's outputs off the device (async, on stream): the staged ones into the output
// staging in as few copies as they allow; a registered host region's straight into it; those of
// GPU regions scattered by one kernel over the segment table.
absl::Status CudaStepDevice::CopyOutputs(const StepLaunch& l, const char* dev,
                                         const CopySegment* segments, int32_t n,
                                         cudaStream_t stream) {
  const StepLayout& s = l.layout;
  const int32_t* cu_q = l.cu_seqlens_q();
  StagedRanges staged;
  bool staged_lse = false;
  for (size_t m = 0; m < l.members.size(); ++m) {
    const StepJob& job = *l.members[m];
    const StepRoute& r = l.routes[m];
    const size_t o_bytes = job.OBytes();
    const size_t at = l.OAt(m);
    if (!r.o) {
      staged.Add(at, o_bytes);
    } else if (!r.device) {
      RETURN_IF_CUDA_ERROR("D2H copy", cudaMemcpyAsync(job.o_out, dev + at, o_bytes,
                                                       cudaMemcpyDeviceToHost, stream));
    }
    if (!job.return_lse) continue;
    if (!r.lse) {
      staged_lse = true;
    } else if (!r.device) {
      const size_t row = sizeof(float) * job.total_q;
      RETURN_IF_CUDA_ERROR("D2H copy",
                           cudaMemcpy2DAsync(job.lse_out, row, dev + s.lse + sizeof(float) * cu_q[m],
                                             sizeof(float) * l.total_q, row, l.key.num_heads,
                                             cudaMemcpyDeviceToHost, stream));
    }
  }
  if (staged_lse) staged.Add(s.lse, s.out_bytes - s.lse);  // the whole lse: small next to o
  if (l.staged_out) RETURN_IF_ERROR(staged.Copy(l.out.data, dev, cudaMemcpyDeviceToHost, stream));
  RETURN_IF_CUDA_ERROR("segment copies", LaunchSegmentCopies(segments, n, stream));
  return absl::OkStatus();
}

absl::StatusOr<char*> CudaStepDevice::LaneMemory::Get(DevicePool* pool, cudaStream_t stream,
                                                      size_t bytes) {
  if (bytes == 0) return nullptr;
  // Kept while it fits and is not four times (and a MiB) larger than needed: a lane that ran a
  // long prefill does not hold its memory through the decode steps after it.
  if (buffer_ && capacity_ >= bytes && capacity_ <= 4 * bytes + (size_t{1} << 20)) {
    return buffer_->get();
  }
  Release();  // back to the pool (stream-ordered) before the new one is taken
  auto buffer = std::make_unique<DeviceBuffer>(pool, stream);
  RETURN_IF_ERROR(buffer->Allocate(bytes));
  buffer_ = std::move(buffer);
  capacity_ = bytes;
  return buffer_->get();
}

absl::Status CudaStepDevice::LaneMemory::PrepareForLaunch(size_t counter_bytes,
                                                          cudaStream_t stream) {
  if (counter_bytes > zero_prefix_) {
    RETURN_IF_CUDA_ERROR("workspace counters",
                         cudaMemsetAsync(buffer_->get(), 0, counter_bytes, stream));
  }
  zero_prefix_ = counter_bytes;  // the launch may write anywhere past them
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaStepDevice>> CudaStepDevice::Create(
    const Options& options, std::shared_ptr<CudaDeviceState> state) {
  if (options.lanes < 1 || options.lanes > 64) {
    return absl::InvalidArgumentError("the step device's lanes must be in [1, 64]");
  }
  std::unique_ptr<CudaStepDevice> d(new CudaStepDevice(std::move(state)));
  RETURN_IF_ERROR(d->Init(options));
  return d;
}

absl::Status CudaStepDevice::Init(const Options& options) {
  plan_options_.fp8_tensor_cores = options.fp8_tensor_cores;
  plan_options_.decode_fused_combine = options.fused_combine;
  append_in_kernel_ = options.append_in_kernel;
  output_to_host_ = options.output_to_host;
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(state_->device()));
  RETURN_IF_ERROR(AllocateKvRegion(options));
  for (int i = 0; i < options.lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    const absl::Status created = CreateLaneStream(&lane->stream, lane->events);
    lanes_.push_back(std::move(lane));  // the destructor destroys what was created
    RETURN_IF_ERROR(created);
  }
  return absl::OkStatus();
}

absl::Status CudaStepDevice::AllocateKvRegion(const Options& options) {
  int64_t bytes = options.kv_cache_bytes;
  if (bytes == 0) {
    size_t free = 0, total = 0;
    RETURN_IF_CUDA_ERROR("cudaMemGetInfo", cudaMemGetInfo(&free, &total));
    const int64_t left =
        static_cast<int64_t>(free) - options.reserve_bytes - (int64_t{1} << 30);
    bytes = std::max<int64_t>(0, left / 5 * 4);
  }
  const int64_t page = options.kv_page_bytes;
  if (page < 1) return absl::InvalidArgumentError("KV page bytes must be >= 1");
  const int64_t pages = std::min<int64_t>(bytes / (2 * page), INT32_MAX / 2);
  if (pages < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("no room for a KV cache (", bytes, " bytes)"));
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

CudaStepDevice::~CudaStepDevice() {
  cudaSetDevice(state_->device());
  for (auto& lane : lanes_) {
    if (lane->stream) cudaStreamSynchronize(lane->stream);
    lane->in.Release();
    lane->out.Release();
    lane->workspace.Release();
    DestroyLaneStream(lane->stream, lane->events);
  }
  if (kv_.k) cudaFree(kv_.k);
}

StepRoute CudaStepDevice::RouteOf(const StepJob& job) const {
  if (job.device_tensors) return {true, true, true, true, job.return_lse, true};
  const Job::HostRegistered& r = job.host_registered;
  auto large = [](size_t bytes) { return bytes >= kDirectStepBytes; };
  return {r.q && large(job.q_bytes.size()), r.k && large(job.k_bytes.size()),
          r.v && large(job.v_bytes.size()), r.o && large(job.OBytes()),
          r.lse && large(job.LseBytes()), false};
}

bool CudaStepDevice::RunsInPlace(std::span<StepJob* const> members) const {
  if (members.size() != 1) return false;
  const StepJob& job = *members.front();
  if (!job.device_tensors || job.key.fp8_cache) return false;
  return Aligned16(job.q_bytes.data()) && Aligned16(job.k_bytes.data()) &&
         Aligned16(job.v_bytes.data()) && Aligned16(job.o_out) &&
         (!job.return_lse || Aligned16(job.lse_out));
}

absl::StatusOr<char*> CudaStepDevice::InputStaging(int lane_index, size_t bytes) {
  Lane& lane = *lanes_[lane_index];
  if (lane.staging.capacity() < bytes) {
    lane.staging = PinnedBuffer();  // back to the pool first: it may be reused for the larger
    ASSIGN_OR_RETURN(lane.staging, state_->pinned_pool().Acquire(bytes));
  }
  return static_cast<char*>(lane.staging.data());
}

absl::StatusOr<OutputBytes> CudaStepDevice::OutputStaging(size_t bytes) {
  return state_->AcquireOutput(bytes);
}

absl::Status CudaStepDevice::Launch(int lane_index, const StepLaunch& l) {
  Lane& lane = *lanes_[lane_index];
  absl::Status st = Enqueue(lane, l);
  if (st.ok()) {
    // Stream-ordered: the memory goes back to the pool once this launch's work is done.
    lane.KeepWithin(state_->device_pool().limit() / (2 * lanes_.size()));
  }
  if (!st.ok()) {
    // Whatever the lane kept goes back too: smaller launches retried after an exhaustion get
    // the whole pool.
    lane.in.Release();
    lane.out.Release();
    lane.workspace.Release();
    if (!absl::IsResourceExhausted(st)) state_->NoteIfDeviceLost(lane.stream);
  }
  return st;
}

absl::Status CudaStepDevice::PlanLaunch(const kernels::AttentionArgs& args, Lane& lane,
                                        kernels::cuda::Plan* plan, char** workspace) {
  DevicePool* pool = &state_->device_pool();
  RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::MakePlan(args, plan_options_, plan)));
  absl::StatusOr<char*> got = lane.workspace.Get(pool, lane.stream, plan->workspace_bytes);
  if (!got.ok() && absl::IsResourceExhausted(got.status()) &&
      plan->kernel == kernels::cuda::Plan::Kernel::kDecode && plan->decode_splits > 1) {
    kernels::cuda::PlanOptions unsplit = plan_options_;
    unsplit.decode_splits = 1;
    RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::MakePlan(args, unsplit, plan)));
    got = lane.workspace.Get(pool, lane.stream, plan->workspace_bytes);
  }
  if (!got.ok()) return got.status();
  *workspace = *got;
  if (*workspace == nullptr) return absl::OkStatus();
  return lane.workspace.PrepareForLaunch(plan->decode_counter_bytes, lane.stream);
}

absl::Status CudaStepDevice::Enqueue(Lane& lane, const StepLaunch& l) {
  const StepLayout& s = l.layout;
  const BatchKey& key = l.key;
  cudaStream_t stream = lane.stream;
  DevicePool* pool = &state_->device_pool();
  kernels::AttentionArgs args = l.HostArgs();
  // The decode kernel writes o and lse straight into the pinned output staging (mapped into the
  // device's address space), which saves the copy back and its place in the launch's chain.
  const bool host_out = output_to_host_ && s.out_bytes <= kHostOutputBytes && AllOutputsStaged(l) &&
                        kernels::cuda::UsesDecodeKernel(args);
  // The device's output otherwise: o and lse of the whole launch (a launch in place writes its
  // member's regions instead).
  const size_t tokens = l.in_place ? 0 : size_t(l.total_q);
  const size_t dev_out_bytes = l.in_place || host_out
                                   ? 0
                                   : s.lse + (l.any_lse ? sizeof(float) * key.num_heads * tokens : 0);
  // The segment table of the tensors in GPU regions rides behind the staging's device copy.
  const int32_t segments = l.in_place ? 0 : CountSegments(l);
  const size_t table_at = (s.in_bytes + 15) / 16 * 16;
  const size_t table_bytes = sizeof(CopySegment) * size_t(segments);
  ASSIGN_OR_RETURN(char* in, lane.in.Get(pool, stream, table_at + table_bytes));
  ASSIGN_OR_RETURN(char* dev_out, lane.out.Get(pool, stream, dev_out_bytes));
  if (lane.segments.capacity() < table_bytes) {
    lane.segments = PinnedBuffer();
    ASSIGN_OR_RETURN(lane.segments, state_->pinned_pool().Acquire(table_bytes));
  }
  auto* host_table = static_cast<CopySegment*>(lane.segments.data());
  auto* dev_table = reinterpret_cast<CopySegment*>(in + table_at);
  const int32_t input_segments = segments > 0 ? FillSegments(l, in, dev_out, host_table) : 0;
  const StepJob& first = *l.members.front();

  args.q = l.in_place ? first.q_bytes.data() : in + s.q;
  args.k = kv_.k;
  args.v = kv_.v;
  char* out_base = host_out ? l.out.data : dev_out;
  args.o = l.in_place ? first.o_out : out_base + s.o;
  float* dev_lse = l.in_place ? nullptr : reinterpret_cast<float*>(out_base + s.lse);
  args.lse = !l.any_lse ? nullptr : l.in_place ? reinterpret_cast<float*>(first.lse_out) : dev_lse;
  args.cu_seqlens_q = reinterpret_cast<const int32_t*>(in + s.cu_q);
  args.paged.page_indptr = reinterpret_cast<const int32_t*>(in + s.indptr);
  args.paged.page_indices = reinterpret_cast<const int32_t*>(in + s.indices);
  args.paged.seqlens_k = reinterpret_cast<const int32_t*>(in + s.seqlens);
  if (key.fp8_cache) {  // the scales' device copy ([members, num_kv_heads], in the tables)
    args.kv_scales.k = reinterpret_cast<const float*>(in + s.k_scales);
    args.kv_scales.v = reinterpret_cast<const float*>(in + s.v_scales);
  }
  RETURN_IF_ERROR(FromKernelStatus(kernels::cuda::CanImplement(args)));
  kernels::cuda::Plan plan;
  char* workspace = nullptr;
  RETURN_IF_ERROR(PlanLaunch(args, lane, &plan, &workspace));
  if (host_out && plan.kernel != kernels::cuda::Plan::Kernel::kDecode) {
    return absl::InternalError("a decode-shaped step launch was planned off the decode kernel");
  }
  const char* new_k = l.in_place ? first.k_bytes.data() : in + s.k;
  const char* new_v = l.in_place ? first.v_bytes.data() : in + s.v;

  SyncStreamUnlessDone sync_on_error(stream);  // before pages or staging go back on an error
  cudaEvent_t* ev = lane.events;
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[0], stream));
  if (l.in_place) {  // the page table and row lists only
    RETURN_IF_CUDA_ERROR("H2D copy",
                         cudaMemcpyAsync(in + s.tables, l.in + s.tables, s.in_bytes - s.tables,
                                         cudaMemcpyHostToDevice, stream));
  } else {
    if (segments > 0) {
      RETURN_IF_CUDA_ERROR("H2D copy", cudaMemcpyAsync(dev_table, host_table, table_bytes,
                                                       cudaMemcpyHostToDevice, stream));
    }
    RETURN_IF_ERROR(CopyInputs(l, in, dev_table, input_segments, stream));
  }
  // Copy-on-write first (rows of shared pages into the step's copies), then the new rows.
  RETURN_IF_CUDA_ERROR(
      "KV copy-on-write",
      LaunchKvCopyRows(kv_.k, kv_.v, reinterpret_cast<const int64_t*>(in + s.copy_src), kv_.k,
                       kv_.v, reinterpret_cast<const int64_t*>(in + s.copy_dst), l.copy_rows,
                       l.row_bytes, stream));
  const auto* append = reinterpret_cast<const int64_t*>(in + s.append);
  auto* saturated = reinterpret_cast<unsigned long long*>(in + s.saturations);
  if (l.Fp8Quantizes()) {  // 16-bit new rows quantized into the FP8 cache as they are written
    RETURN_IF_CUDA_ERROR("cudaMemsetAsync", cudaMemsetAsync(saturated, 0, sizeof(int64_t), stream));
    RETURN_IF_CUDA_ERROR(
        "KV append (FP8)",
        LaunchKvQuantizeRows(key.wire_dtype == kernels::DType::kBFloat16, new_k, new_v,
                             args.cu_seqlens_q, args.batch, args.kv_scales.k, args.kv_scales.v,
                             kv_.k, kv_.v, append, l.total_q, key.num_kv_heads, key.head_dim,
                             saturated, stream));
  } else if (append_in_kernel_ && !key.fp8_cache &&
             plan.kernel == kernels::cuda::Plan::Kernel::kDecode) {
    // The decode kernel reads the new rows where they lie and writes them into their pages.
    args.paged.append_k = new_k;
    args.paged.append_v = new_v;
  } else {
    RETURN_IF_CUDA_ERROR("KV append", LaunchKvCopyRows(new_k, new_v, nullptr, kv_.k, kv_.v, append,
                                                       l.total_q, l.row_bytes, stream));
  }
  // Nothing follows the kernel when it writes the outputs where they go (in place, or straight
  // to the host): the end event then times it together with the inputs' copy before it, and
  // neither ev[1] nor ev[2] is recorded (each record is host time and a link of the device's
  // chain on a lone step's path).
  lane.copies_out = !l.in_place && !host_out;
  if (lane.copies_out) {
    RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[1], stream));
  }
  RETURN_IF_CUDA_ERROR("attention kernel",
                       kernels::cuda::Run(args, plan, workspace, stream));
  if (lane.copies_out) {
    RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[2], stream));
    RETURN_IF_ERROR(CopyOutputs(l, dev_out, dev_table + input_segments, segments - input_segments,
                                stream));
  }
  if (l.Fp8Quantizes()) {  // the count back into the staging's slot, for Wait
    RETURN_IF_CUDA_ERROR("D2H copy", cudaMemcpyAsync(l.in + s.saturations, saturated,
                                                     sizeof(int64_t), cudaMemcpyDeviceToHost,
                                                     stream));
  }
  RETURN_IF_CUDA_ERROR("cudaEventRecord", cudaEventRecord(ev[3], stream));
  sync_on_error.Done();
  lane.expected_bytes = l.kv_bytes_read + double(s.in_bytes + dev_out_bytes);
  return absl::OkStatus();
}

absl::StatusOr<StepLaunchTimes> CudaStepDevice::Wait(int lane_index, const StepLaunch& l) {
  Lane& lane = *lanes_[lane_index];
  cudaEvent_t* ev = lane.events;
  const cudaError_t e = WaitForLaunch(ev[3], l.members.size(),
                                      lane.device_us_per_byte * lane.expected_bytes, l.poll_wait);
  if (e != cudaSuccess) {
    state_->NoteIfDeviceLost(lane.stream);
    return CudaError("step launch", e);
  }
  StepLaunchTimes t;
  if (lane.copies_out) {
    t.in_us = ElapsedMs(ev[0], ev[1]) * 1e3;
    t.kernel_us = ElapsedMs(ev[1], ev[2]) * 1e3;
    t.out_us = ElapsedMs(ev[2], ev[3]) * 1e3;
  } else {
    // The inputs' copy and an FP8 launch's count of saturations included.
    t.kernel_us = ElapsedMs(ev[0], ev[3]) * 1e3;
  }
  if (l.Fp8Quantizes()) t.fp8_saturations = *l.At<int64_t>(l.layout.saturations);
  if (l.members.size() > kPolledLaunchSteps && lane.expected_bytes > 0) {
    // The fastest rate seen lately: a launch that runs faster than it (a decode after prefills,
    // which are compute-bound) would otherwise be slept through.
    const double rate = (t.in_us + t.kernel_us + t.out_us) / lane.expected_bytes;
    lane.device_us_per_byte =
        lane.device_us_per_byte == 0 ? rate : std::min(rate, 1.02 * lane.device_us_per_byte);
  }
  return t;
}

absl::Status CudaStepDevice::ReadKv(char* host, const char* kv, size_t bytes) const {
  RETURN_IF_ERROR(state_->Health());
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(state_->device()));
  RETURN_IF_CUDA_ERROR("cudaMemcpy (KV page to host)",
                       cudaMemcpy(host, kv, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status CudaStepDevice::WriteKv(char* kv, const char* host, size_t bytes) const {
  RETURN_IF_ERROR(state_->Health());
  RETURN_IF_CUDA_ERROR("cudaSetDevice", cudaSetDevice(state_->device()));
  RETURN_IF_CUDA_ERROR("cudaMemcpy (KV page to the device)",
                       cudaMemcpy(kv, host, bytes, cudaMemcpyHostToDevice));
  // From pageable memory the copy may return before its DMA has landed: wait for the stream it
  // ran on, so that a step launched next reads the page.
  RETURN_IF_CUDA_ERROR("cudaStreamSynchronize", cudaStreamSynchronize(0));
  return absl::OkStatus();
}

}  // namespace attn
