#include "backends/cpu_step_device.h"

#include <sys/mman.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "attn/kernels/cpu_attention.h"
#include "common/status_util.h"
#include "engine/job.h"
#include "sessions/fp8_quantize.h"

namespace attn {

absl::StatusOr<std::unique_ptr<CpuStepDevice>> CpuStepDevice::Create(
    const Options& options, kernels::cpu::CpuThreadPool* pool) {
  if (pool == nullptr) return absl::InvalidArgumentError("the CPU thread pool is null");
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
  std::unique_ptr<CpuStepDevice> d(new CpuStepDevice(pool));
  d->kv_.k = static_cast<char*>(region);
  d->kv_.v = d->kv_.k + bytes / 2;
  d->kv_.num_pages = pages;
  d->kv_.page_bytes = options.kv_page_bytes;
  return d;
}

CpuStepDevice::~CpuStepDevice() {
  if (kv_.k) munmap(kv_.k, static_cast<size_t>(2 * kv_.num_pages * kv_.page_bytes));
}

absl::StatusOr<char*> CpuStepDevice::InputStaging(int /*lane*/, size_t bytes) {
  if (staging_.size() < bytes) staging_.resize(bytes);
  return staging_.data();
}

absl::StatusOr<OutputBytes> CpuStepDevice::OutputStaging(size_t bytes) {
  return OutputBytes::Allocate(bytes);
}

absl::Status CpuStepDevice::Launch(int /*lane*/, const StepLaunch& l) {
  const auto start = Clock::now();
  const StepLayout& s = l.layout;
  const size_t row = static_cast<size_t>(l.row_bytes);
  // Copy-on-write rows, then the new keys and values from the staging into their rows.
  const int64_t* src = l.At<int64_t>(s.copy_src);
  const int64_t* dst = l.At<int64_t>(s.copy_dst);
  for (int64_t i = 0; i < l.copy_rows; ++i) {
    std::memcpy(kv_.k + dst[i] * row, kv_.k + src[i] * row, row);
    std::memcpy(kv_.v + dst[i] * row, kv_.v + src[i] * row, row);
  }
  const int64_t* rows = l.At<int64_t>(s.append);
  const char* k = l.in + s.k;
  const char* v = l.in + s.v;
  last_.fp8_saturations = 0;
  if (l.Fp8Quantizes()) {
    last_.fp8_saturations = AppendQuantized(l, k, v);
  } else {
    for (int32_t t = 0; t < l.total_q; ++t) {
      std::memcpy(kv_.k + rows[t] * row, k + size_t(t) * row, row);
      std::memcpy(kv_.v + rows[t] * row, v + size_t(t) * row, row);
    }
  }
  const auto appended = Clock::now();
  kernels::AttentionArgs args = l.HostArgs();
  args.q = l.in + s.q;
  args.k = kv_.k;
  args.v = kv_.v;
  args.o = l.out.data + s.o;
  args.lse = l.any_lse ? reinterpret_cast<float*>(l.out.data + s.lse) : nullptr;
  const size_t need = kernels::cpu::WorkspaceBytes(args, pool_->NumWorkers()) + 64;
  if (workspace_.size() < need) workspace_.resize(need);
  void* workspace = reinterpret_cast<void*>(
      (reinterpret_cast<uintptr_t>(workspace_.data()) + 63) & ~uintptr_t{63});
  RETURN_IF_ERROR(FromKernelStatus(kernels::cpu::Run(args, workspace, pool_)));
  last_.in_us = Micros(appended - start);
  last_.kernel_us = Micros(Clock::now() - appended);
  last_.out_us = 0;
  return absl::OkStatus();
}

int64_t CpuStepDevice::AppendQuantized(const StepLaunch& l, const char* k, const char* v) {
  const StepLayout& s = l.layout;
  const int32_t heads = l.key.num_kv_heads, d = l.key.head_dim;
  const size_t src_row = size_t(heads) * d * kernels::DTypeSize(l.key.wire_dtype);
  const size_t row = static_cast<size_t>(l.row_bytes);
  const int64_t* rows = l.At<int64_t>(s.append);
  const int32_t* cu_q = l.cu_seqlens_q();
  int64_t saturated = 0;
  size_t m = 0;  // the member whose token t is
  for (int32_t t = 0; t < l.total_q; ++t) {
    while (t >= cu_q[m + 1]) ++m;
    const std::span<const float> ks(l.At<float>(s.k_scales) + m * heads, size_t(heads));
    const std::span<const float> vs(l.At<float>(s.v_scales) + m * heads, size_t(heads));
    auto* dk = reinterpret_cast<uint8_t*>(kv_.k + rows[t] * row);
    auto* dv = reinterpret_cast<uint8_t*>(kv_.v + rows[t] * row);
    saturated += QuantizeE4m3Rows(l.key.wire_dtype, k + t * src_row, 1, heads, d, ks, dk);
    saturated += QuantizeE4m3Rows(l.key.wire_dtype, v + t * src_row, 1, heads, d, vs, dv);
  }
  return saturated;
}

absl::StatusOr<StepLaunchTimes> CpuStepDevice::Wait(int /*lane*/, const StepLaunch& /*launch*/) {
  return last_;
}

}  // namespace attn
