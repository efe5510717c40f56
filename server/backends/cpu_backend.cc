#include "backends/cpu_backend.h"

#include <sys/mman.h>

#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "attn/kernels/cpu_attention.h"
#include "common/status_util.h"
#include "sessions/step_launch.h"
#include "sessions/step_work.h"

namespace attn {
namespace {

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "cpu";
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const Options& options) {
  if (options.threads < 0) return absl::InvalidArgumentError("threads must be >= 0");
  auto pool = kernels::cpu::CpuThreadPool::Create(options.threads);
  BackendInfo info;
  info.name = "cpu";
  info.device_name = CpuModelName();
  info.compute_units = pool->NumWorkers();
  info.head_dims = options.head_dims;
  info.build_info = absl::StrCat("attn_kernels cpu, ", pool->NumWorkers(), " threads");
  if (options.kv_page_bytes < 1) return absl::InvalidArgumentError("KV page bytes must be >= 1");
  const int64_t pages = options.kv_cache_bytes / (2 * options.kv_page_bytes);
  if (pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_bytes ", options.kv_cache_bytes, " holds no page of keys and values (",
        2 * options.kv_page_bytes, " bytes)"));
  }
  // Anonymous memory: only the pages sessions write to become resident.
  const size_t bytes = static_cast<size_t>(2 * pages * options.kv_page_bytes);
  void* region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map the KV cache region of ", bytes, " bytes (--kv_cache_bytes)"));
  }
  std::unique_ptr<CpuBackend> b(new CpuBackend(std::move(info), std::move(pool)));
  b->kv_.k = static_cast<char*>(region);
  b->kv_.v = b->kv_.k + bytes / 2;
  b->kv_.num_pages = pages;
  b->kv_.page_bytes = options.kv_page_bytes;
  return b;
}

CpuBackend::CpuBackend(BackendInfo info, std::unique_ptr<kernels::cpu::CpuThreadPool> pool)
    : info_(std::move(info)), pool_(std::move(pool)) {
  worker_ = std::thread([this] { WorkerLoop(); });
}

CpuBackend::~CpuBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  if (kv_.k) munmap(kv_.k, static_cast<size_t>(2 * kv_.num_pages * kv_.page_bytes));
}

void CpuBackend::RunBatch(Batch batch, std::function<void(const BatchReport&)> on_finished) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(batch), std::move(on_finished));
  }
  cv_.notify_one();
}

void CpuBackend::WorkerLoop() {
  for (;;) {
    std::pair<Batch, std::function<void(const BatchReport&)>> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    Compute(work.first, work.second);
  }
}

void* CpuBackend::Workspace(const kernels::AttentionArgs& args) {
  const size_t need = kernels::cpu::WorkspaceBytes(args, pool_->NumWorkers()) + 64;
  if (workspace_.size() < need) workspace_.resize(need);
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace_.data()) + 63) &
                                 ~uintptr_t{63});
}

absl::Status CpuBackend::RunJob(AttendJob& job) {
  const kernels::AttentionArgs args = job.HostArgs();
  return FromKernelStatus(kernels::cpu::Run(args, Workspace(args), pool_.get()));
}

namespace {

// Copy-on-write rows, then each member's new keys and values into their pool rows.
void WriteStepRows(const Batch& batch, const StepLaunch& l, const KvRegion& kv, size_t row) {
  for (const RowCopy& c : l.copies) {
    std::memcpy(kv.k + c.dst_row * row, kv.k + c.src_row * row, row);
    std::memcpy(kv.v + c.dst_row * row, kv.v + c.src_row * row, row);
  }
  size_t t = 0;
  for (size_t i : l.members) {
    const AttendJob& job = *batch[i];
    const char* k = job.k_bytes.data();
    const char* v = job.v_bytes.data();
    for (int64_t j = 0; j < job.step->new_tokens; ++j, ++t) {
      std::memcpy(kv.k + l.append_rows[t] * row, k + j * row, row);
      std::memcpy(kv.v + l.append_rows[t] * row, v + j * row, row);
    }
  }
}

}  // namespace

void CpuBackend::ComputeSteps(Batch& batch,
                              const std::function<void(const BatchReport&)>& on_finished) {
  const BatchKey& key = batch.front()->key;
  std::vector<absl::Status> status(batch.size());
  const StepLaunch l = BeginStepLaunch(batch, status);
  BatchReport report;
  report.requests = static_cast<int32_t>(batch.size());
  report.decode = key.decode;
  absl::Status launch_status;
  const size_t q_row = size_t(key.num_heads) * key.head_dim * kernels::DTypeSize(key.wire_dtype);
  const auto start = Clock::now();
  if (!l.members.empty()) {
    const size_t kv_row = size_t(key.num_kv_heads) * key.head_dim * kernels::DTypeSize(key.wire_dtype);
    WriteStepRows(batch, l, kv_, kv_row);
    step_q_.resize(l.total_q * q_row);
    step_o_.resize(l.total_q * q_row);
    bool any_lse = false;
    for (size_t m = 0; m < l.members.size(); ++m) {
      const AttendJob& job = *batch[l.members[m]];
      std::memcpy(step_q_.data() + size_t(l.cu_seqlens_q[m]) * q_row, job.q_bytes.data(),
                  job.q_bytes.size());
      any_lse |= job.return_lse;
    }
    step_lse_.resize(any_lse ? size_t(key.num_heads) * l.total_q : 0);
    kernels::AttentionArgs args = StepLaunchArgs(key, l, static_cast<int32_t>(kv_.num_pages));
    args.q = step_q_.data();
    args.k = kv_.k;
    args.v = kv_.v;
    args.o = step_o_.data();
    args.lse = any_lse ? step_lse_.data() : nullptr;
    launch_status = FromKernelStatus(kernels::cpu::Run(args, Workspace(args), pool_.get()));
    report.step_launches = 1;
    report.tokens = l.total_q;
    if (launch_status.ok()) {
      report.flops = kernels::AttentionFlops(args, args.cu_seqlens_q, nullptr);
      report.kv_bytes_read = l.kv_bytes_read;
      report.bytes = l.kv_bytes_read + 2.0 * l.total_q * q_row;
    }
  }
  const auto elapsed = Clock::now() - start;
  report.compute_seconds = std::chrono::duration<double>(elapsed).count();
  EndStepLaunch(batch, l, status, launch_status);
  for (size_t m = 0; m < l.members.size(); ++m) {
    const size_t i = l.members[m];
    if (!status[i].ok()) continue;
    AttendJob& job = *batch[i];
    const int32_t q0 = l.cu_seqlens_q[m];
    std::memcpy(StepOutput(job), step_o_.data() + q0 * q_row, size_t(job.total_q) * q_row);
    if (job.return_lse) {
      float* lse = StepLse(job);
      for (int32_t h = 0; h < key.num_heads; ++h) {
        std::memcpy(lse + size_t(h) * job.total_q, step_lse_.data() + size_t(h) * l.total_q + q0,
                    sizeof(float) * job.total_q);
      }
    }
  }
  for (auto& job : batch) {
    job->compute_us = Micros(elapsed);
    job->batch_requests = report.requests;
    job->batch_tokens = l.total_q;
  }
  for (size_t i = 0; i < batch.size(); ++i) batch[i]->done(status[i]);
  on_finished(report);
}

void CpuBackend::Compute(Batch& batch, const std::function<void(const BatchReport&)>& on_finished) {
  if (batch.front()->step) {
    ComputeSteps(batch, on_finished);
    return;
  }
  BatchReport report;
  report.requests = static_cast<int32_t>(batch.size());
  for (auto& job : batch) report.tokens += job->Tokens();
  for (auto& job : batch) {
    const auto start = Clock::now();
    absl::Status st = RunJob(*job);
    const auto elapsed = Clock::now() - start;
    job->compute_us = Micros(elapsed);
    job->batch_requests = report.requests;
    job->batch_tokens = report.tokens;
    if (st.ok()) {
      const kernels::AttentionArgs args = job->HostArgs();
      report.flops += kernels::AttentionFlops(args, args.cu_seqlens_q, args.cu_seqlens_k);
      const double elem = kernels::DTypeSize(args.dtype);
      report.bytes += elem * args.head_dim *
                      (2.0 * args.total_q * args.num_heads + 2.0 * args.total_k * args.num_kv_heads);
    }
    report.compute_seconds += std::chrono::duration<double>(elapsed).count();
    job->done(st);
  }
  on_finished(report);
}

}  // namespace attn
