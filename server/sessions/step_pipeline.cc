#include "sessions/step_pipeline.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace attn {
namespace {

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Whether the batch's steps are one call's (they hold the same message); a step that holds none
// is a call of its own.
bool FromOneCall(std::span<const std::unique_ptr<StepJob>> batch) {
  if (batch.size() <= 1) return true;
  const void* call = batch.front()->input_hold.get();
  return call != nullptr && std::all_of(batch.begin(), batch.end(), [call](const auto& job) {
           return job->input_hold.get() == call;
         });
}

StepLayout PlanLayout(const StepLaunch& l) {
  const BatchKey& key = l.key;
  const size_t elem = kernels::DTypeSize(key.wire_dtype);
  const size_t kv_elem = key.fp8_kv ? 1 : elem;  // FP8 codes (a session's), or 16 bits
  const size_t tokens = l.in_place ? 0 : size_t(l.total_q);
  const size_t q_bytes = tokens * key.num_heads * key.head_dim * elem;
  const size_t kv_bytes = tokens * key.num_kv_heads * key.head_dim * kv_elem;
  const size_t m = l.members.size();
  StepLayout s;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += AlignUp(bytes);
    return here;
  };
  s.q = take(q_bytes);
  s.k = take(kv_bytes);
  s.v = take(kv_bytes);
  s.tables = at;
  s.cu_q = take(sizeof(int32_t) * (m + 1));
  s.indptr = take(sizeof(int32_t) * (m + 1));
  s.indices = take(sizeof(int32_t) * std::max<int64_t>(l.page_entries, 1));
  s.seqlens = take(sizeof(int32_t) * m);
  s.copy_src = take(sizeof(int64_t) * l.copy_rows);
  s.copy_dst = take(sizeof(int64_t) * l.copy_rows);
  s.append = take(sizeof(int64_t) * l.total_q);
  const size_t scales = key.fp8_cache ? sizeof(float) * m * key.num_kv_heads : 0;
  s.k_scales = take(scales);
  s.v_scales = take(scales);
  s.saturations = take(key.fp8_cache ? sizeof(int64_t) : 0);
  s.in_bytes = at;
  s.o = 0;
  s.lse = AlignUp(q_bytes);
  if (l.staged_out) {
    s.out_bytes = s.lse + (l.any_lse ? sizeof(float) * key.num_heads * tokens : 0);
  }
  return s;
}

// One input tensor of a step into its place in the staging: from the received message's slices
// when it came inline, else from where it lies (a host region, or the request message).
void CopyIn(const WireBytes& wire, std::string_view bytes, char* dst) {
  if (wire.size > 0) {
    wire.CopyTo(dst);
  } else {
    std::memcpy(dst, bytes.data(), bytes.size());
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepPipeline>> StepPipeline::Create(const Options& options,
                                                                   StepDevice* device) {
  if (device == nullptr) return absl::InvalidArgumentError("the step device is null");
  if (device->Lanes() < 1) return absl::InvalidArgumentError("the step device has no lane");
  if (device->kv_region().num_pages < 1) {
    return absl::InvalidArgumentError("the step device has no KV region");
  }
  return std::unique_ptr<StepPipeline>(new StepPipeline(options, device));
}

StepPipeline::StepPipeline(const Options& options, StepDevice* device)
    : device_(device), options_(options) {
  completions_ = std::make_unique<CompletionPool>(std::max(options.completion_threads, 1));
  for (int lane = 0; lane < device->Lanes(); ++lane) {
    lanes_.emplace_back([this, lane] { LaneLoop(lane); });
  }
}

StepPipeline::~StepPipeline() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : lanes_) t.join();
  completions_.reset();  // runs what the lanes handed over
}

void StepPipeline::RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({JobsAs<StepJob>(std::move(batch)), std::move(on_finished)});
    queued_.store(queue_.size(), std::memory_order_relaxed);
  }
  cv_.notify_one();
}

void StepPipeline::LaneLoop(int lane) {
  for (;;) {
    Work work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      PollForWork(lock);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_relaxed);
    }
    RunOnLane(lane, std::move(work));
  }
}

void StepPipeline::PollForWork(std::unique_lock<std::mutex>& lock) {
  if (options_.idle_poll.count() <= 0 || !queue_.empty() || stop_) return;
  const bool alone = busy_lanes_.load(std::memory_order_relaxed) == 0;
  if (!options_.poll_when_busy && (!alone || idle_poller_.exchange(true))) return;
  lock.unlock();  // the queue's size is read without the lock: RunBatch is never held up
  const auto until = Clock::now() + options_.idle_poll;
  while (queued_.load(std::memory_order_relaxed) == 0 && Clock::now() < until) {
    std::this_thread::yield();
  }
  lock.lock();
  if (!options_.poll_when_busy) idle_poller_.store(false);
}

void StepPipeline::RunOnLane(int lane, Work work) {
  const size_t n = work.batch.size();
  BatchReport report;
  report.requests = static_cast<int32_t>(n);
  report.decode = work.batch.front()->key.decode;
  std::vector<absl::Status> status(n);
  busy_lanes_.fetch_add(1, std::memory_order_relaxed);
  if (absl::Status health = device_->Health(); !health.ok()) {
    std::fill(status.begin(), status.end(), health);
  } else {
    std::vector<size_t> members(n);
    std::iota(members.begin(), members.end(), size_t{0});
    RunLaunches(lane, work.batch, members, status, &report);
  }
  for (auto& job : work.batch) {
    job->batch_requests = static_cast<int32_t>(n);
    job->batch_tokens = report.tokens;
  }
  busy_lanes_.fetch_sub(1, std::memory_order_relaxed);
  const auto finish_start = Clock::now();
  Finish(std::move(work.batch), std::move(status));
  report.finish_seconds += Seconds(Clock::now() - finish_start);
  work.on_finished(report);
}

void StepPipeline::RunLaunches(int lane, std::span<std::unique_ptr<StepJob>> jobs,
                               std::span<size_t> members, std::span<absl::Status> status,
                               BatchReport* report) {
  // Plan, first part: each member's append, all or nothing for that member.
  const auto stage_start = Clock::now();
  std::vector<size_t> launched;
  std::vector<StepJob*> launched_jobs;
  for (size_t i : members) {
    StepJob& job = *jobs[i];
    auto append = job.session->BeginAppend(job.layer, job.total_q);
    if (!append.ok()) {
      status[i] = append.status();
      continue;
    }
    job.append = std::move(*append);
    launched.push_back(i);
    launched_jobs.push_back(&job);
  }
  if (launched.empty()) return;

  StepLaunch launch;
  launch.poll_wait =
      options_.poll_when_busy || busy_lanes_.load(std::memory_order_relaxed) <= 1;
  absl::Status st = PlanAndStage(lane, launched_jobs, &launch);
  const auto staged = Clock::now();
  const double stage_us = Micros(staged - stage_start);
  report->stage_seconds += stage_us * 1e-6;
  if (st.ok()) st = device_->Launch(lane, launch);
  const auto enqueued = Clock::now();
  report->enqueue_seconds += Seconds(enqueued - staged);
  if (absl::IsResourceExhausted(st) && launched.size() > 1) {
    // The device (or its staging) has no room for them together: give the pages back and run
    // the halves one after the other, so that only a step that does not fit by itself fails.
    for (StepJob* job : launched_jobs) {
      job->session->AbortAppend(std::move(*job->append));
      job->append.reset();
    }
    const std::span<size_t> all(launched);
    const size_t half = all.size() / 2;
    RunLaunches(lane, jobs, all.first(half), status, report);
    RunLaunches(lane, jobs, all.subspan(half), status, report);
    return;
  }
  StepLaunchTimes times;
  if (st.ok()) {
    absl::StatusOr<StepLaunchTimes> waited = device_->Wait(lane, launch);
    if (waited.ok()) {
      times = *waited;
    } else {
      st = waited.status();
    }
  }
  const auto device_done = Clock::now();
  report->wait_seconds += Seconds(device_done - enqueued);
  EndLaunch(launch, st);
  report->finish_seconds += Seconds(Clock::now() - device_done);
  if (!st.ok()) {
    for (size_t i : launched) status[i] = st;
    return;
  }
  report->compute_seconds += times.kernel_us * 1e-6;
  report->transfer_seconds += (times.in_us + times.out_us) * 1e-6;
  report->step_launches += 1;
  report->tokens += launch.total_q;
  const kernels::AttentionArgs args = launch.HostArgs();
  report->flops += kernels::AttentionFlops(args, args.cu_seqlens_q, nullptr);
  report->kv_bytes_read += launch.kv_bytes_read;
  report->kv_fp8_saturations += times.fp8_saturations;
  const double elem = kernels::DTypeSize(launch.key.wire_dtype);
  report->bytes += launch.kv_bytes_read +
                   2.0 * elem * launch.total_q * launch.key.num_heads * launch.key.head_dim;
  for (StepJob* job : launched_jobs) {
    job->transfer_us = times.in_us + times.out_us;
    job->compute_us = times.kernel_us;
    job->host_copy_us += stage_us;
  }
}

absl::Status StepPipeline::PlanAndStage(int lane, std::span<StepJob* const> members,
                                        StepLaunch* launch_ptr) {
  StepLaunch& l = *launch_ptr;
  const StepJob& first = *members.front();
  const SessionShape& shape = first.session->shape();
  const int64_t t = shape.page_tokens;
  l.key = first.key;
  l.members.assign(members.begin(), members.end());
  l.in_place = device_->RunsInPlace(members);
  l.row_bytes = shape.RowBytes();
  l.num_pages = static_cast<int32_t>(device_->kv_region().num_pages / shape.page_span);
  l.routes.reserve(members.size());
  for (const StepJob* job : members) {
    const PendingAppend& p = *job->append;
    const StepRoute route = device_->RouteOf(*job);
    l.routes.push_back(route);
    l.any_lse |= job->return_lse;
    l.staged_out |= !route.o || (job->return_lse && !route.lse);
    l.total_q += job->total_q;
    l.max_q = std::max(l.max_q, job->total_q);
    l.max_k = std::max(l.max_k, static_cast<int32_t>(p.tokens_after));
    l.page_entries += p.TablePages(shape.page_tokens);
    l.copy_rows += static_cast<int64_t>(p.copies.size());
    l.kv_bytes_read += 2.0 * static_cast<double>(p.tokens_after) * l.row_bytes;
  }
  l.layout = PlanLayout(l);
  const StepLayout& s = l.layout;
  ASSIGN_OR_RETURN(l.in, device_->InputStaging(lane, s.in_bytes));
  if (l.staged_out) {
    ASSIGN_OR_RETURN(l.out, device_->OutputStaging(s.out_bytes));
  }

  int32_t* cu_q = l.At<int32_t>(s.cu_q);
  int32_t* indptr = l.At<int32_t>(s.indptr);
  int32_t* indices = l.At<int32_t>(s.indices);
  int32_t* seqlens = l.At<int32_t>(s.seqlens);
  int64_t* copy_src = l.At<int64_t>(s.copy_src);
  int64_t* copy_dst = l.At<int64_t>(s.copy_dst);
  int64_t* append = l.At<int64_t>(s.append);
  cu_q[0] = indptr[0] = 0;
  indices[0] = 0;  // never read when every cache is empty, but set
  size_t q_at = s.q, k_at = s.k, v_at = s.v;
  for (size_t m = 0; m < members.size(); ++m) {
    const StepJob& job = *members[m];
    const PendingAppend& p = *job.append;
    int32_t* table = indices + indptr[m];
    job.session->WriteTableAfter(p, table);
    indptr[m + 1] = indptr[m] + static_cast<int32_t>(p.TablePages(shape.page_tokens));
    seqlens[m] = static_cast<int32_t>(p.tokens_after);
    cu_q[m + 1] = cu_q[m] + job.total_q;
    for (const RowCopy& c : p.copies) {
      *copy_src++ = c.src_row;
      *copy_dst++ = c.dst_row;
    }
    for (int64_t pos = p.tokens_before; pos < p.tokens_after; ++pos) {
      *append++ = int64_t{table[pos / t]} * t + pos % t;
    }
    if (l.key.fp8_cache) {
      const SessionShape& own = job.session->shape();
      const size_t heads = static_cast<size_t>(own.num_kv_heads);
      std::copy(own.k_scales.begin(), own.k_scales.end(), l.At<float>(s.k_scales) + m * heads);
      std::copy(own.v_scales.begin(), own.v_scales.end(), l.At<float>(s.v_scales) + m * heads);
    }
    if (l.in_place) continue;
    const StepRoute& r = l.routes[m];
    if (!r.q) CopyIn(job.wire.q, job.q_bytes, l.in + q_at);
    if (!r.k) CopyIn(job.wire.k, job.k_bytes, l.in + k_at);
    if (!r.v) CopyIn(job.wire.v, job.v_bytes, l.in + v_at);
    q_at += job.QBytes();
    k_at += job.KvBytes();
    v_at += job.KvBytes();
  }
  return absl::OkStatus();
}

void StepPipeline::EndLaunch(const StepLaunch& l, const absl::Status& st) {
  const int32_t* cu_q = l.cu_seqlens_q();
  for (size_t m = 0; m < l.members.size(); ++m) {
    StepJob& job = *l.members[m];
    PendingAppend p = std::move(*job.append);
    job.append.reset();
    if (!st.ok()) {
      job.session->AbortAppend(std::move(p));
      continue;
    }
    job.cached_tokens = p.tokens_after;
    job.session->CommitAppend(std::move(p));
    const StepRoute& r = l.routes[m];
    const size_t q0 = static_cast<size_t>(cu_q[m]);
    if (!r.o) {
      const size_t at = l.OAt(m);
      if (job.o_out != nullptr) {  // a host region the device does not write into directly
        std::memcpy(job.o_out, l.out.data + at, job.OBytes());
      } else {
        job.o = l.out.Part(at, job.OBytes());  // sent from the launch's output staging
      }
    }
    if (job.return_lse && !r.lse) {
      // A strided block of the launch's [num_heads, total_q].
      if (job.lse_out == nullptr) job.lse = OutputBytes::Allocate(job.LseBytes());
      float* dst = reinterpret_cast<float*>(job.lse_out != nullptr ? job.lse_out : job.lse.data);
      const float* all = reinterpret_cast<const float*>(l.out.data + l.layout.lse);
      for (int32_t h = 0; h < l.key.num_heads; ++h) {
        std::memcpy(dst + size_t(h) * job.total_q, all + size_t(h) * l.total_q + q0,
                    sizeof(float) * job.total_q);
      }
    }
  }
}

void StepPipeline::Finish(std::vector<std::unique_ptr<StepJob>> batch,
                          std::vector<absl::Status> status) {
  const size_t n = batch.size();
  // One call's steps (a lone Step, or a BatchStep's) are told on the lane, with no hop to another
  // thread: telling a step is cheap but for the last of its call, which answers it (encodes
  // and sends ~8 KiB and more, 15-40 us). Several calls' answers go out in parallel on the pool.
  const bool others_wait = queued_.load(std::memory_order_relaxed) > 0;
  if (!others_wait && FromOneCall(batch)) {
    for (size_t i = 0; i < n; ++i) {
      batch[i]->done(std::move(status[i]));
      batch[i].reset();
    }
    return;
  }
  // Several calls, or a batch waiting for this lane: the callers are told over the completion
  // pool, in parallel, while this lane takes its next launch. Each task owns its range of jobs;
  // a job is destroyed (its pending count released) right after its caller is told.
  struct Shared {
    std::vector<std::unique_ptr<StepJob>> batch;
    std::vector<absl::Status> status;
  };
  auto shared = std::make_shared<Shared>(Shared{std::move(batch), std::move(status)});
  const size_t tasks = std::min<size_t>(n, std::max(options_.completion_threads, 1));
  for (size_t t = 0; t < tasks; ++t) {
    const size_t begin = n * t / tasks, end = n * (t + 1) / tasks;
    completions_->Post([shared, begin, end] {
      for (size_t i = begin; i < end; ++i) {
        shared->batch[i]->done(std::move(shared->status[i]));
        shared->batch[i].reset();
      }
    });
  }
}

}  // namespace attn
