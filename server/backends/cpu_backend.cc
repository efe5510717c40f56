#include "backends/cpu_backend.h"

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/dtype_convert.h"
#include "common/status_util.h"

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
  info.fp8.attend_kv = true;
  info.fp8.attend_q = true;
  info.fp8.session_cache = true;
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(info), std::move(pool)));
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
}

void CpuBackend::RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(JobsAs<AttendJob>(std::move(batch)), std::move(on_finished));
  }
  cv_.notify_one();
}

void CpuBackend::WorkerLoop() {
  for (;;) {
    std::pair<AttendBatch, std::function<void(const BatchReport&)>> work;
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
  kernels::AttentionArgs args = job.HostArgs();
  if (!job.key.fp8_q) return FromKernelStatus(kernels::cpu::Run(args, Workspace(args), pool_.get()));
  // All-FP8: q's codes widen exactly to o's 16-bit type, and q's descale (per sequence and KV
  // head, as k's) moves into k's: (sq * q) . (sk * k) = q . (sq * sk * k).
  const size_t q_elems = size_t(job.total_q) * job.key.num_heads * job.key.head_dim;
  std::vector<uint16_t> q_wide(q_elems);
  std::vector<float> row(job.key.head_dim);
  for (size_t at = 0; at < q_elems; at += job.key.head_dim) {
    kernels::cpu::LoadRow(kernels::DType::kFloat8E4M3, job.q_bytes.data(), int64_t(at),
                          job.key.head_dim, row.data(), 1.0f);
    kernels::cpu::StoreRow(args.dtype, row.data(), job.key.head_dim, q_wide.data(), int64_t(at));
  }
  std::vector<float> k_descales(job.k_descales.size());
  for (size_t i = 0; i < k_descales.size(); ++i) {
    k_descales[i] = job.q_descales[i] * job.k_descales[i];
  }
  args.q = q_wide.data();
  args.kv_scales.k = k_descales.data();
  return FromKernelStatus(kernels::cpu::Run(args, Workspace(args), pool_.get()));
}

void CpuBackend::Compute(AttendBatch& batch,
                         const std::function<void(const BatchReport&)>& on_finished) {
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
    job.reset();
  }
  on_finished(report);
}

}  // namespace attn
