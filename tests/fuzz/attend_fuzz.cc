#include "attend_fuzz.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/attend_validation.h"
#include "attn/kernels/cpu_attention.h"
#include "attn/kernels/dtype_convert.h"
#include "attn/v1/attention.pb.h"

namespace attn::fuzz {
namespace {

// Head dims the fuzzed "backend" claims: the server's defaults plus small ones, so that short
// inputs reach the kernel too (the CPU kernel runs any head dim up to 512).
const std::vector<int32_t>& HeadDims() {
  static const std::vector<int32_t> dims = {1, 2, 3, 4, 8, 16, 32, 64, 96, 128, 256};
  return dims;
}

float ElementAt(const std::string& bytes, v1::DType dtype, size_t i) {
  if (dtype == v1::DTYPE_FLOAT32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == v1::DTYPE_FLOAT16 ? kernels::cpu::HalfBitsToFloat(h) : kernels::cpu::Bf16BitsToFloat(h);
}

// Largest |x| of a tensor, or +inf when it holds a NaN or an infinity.
double MaxAbs(const v1::Tensor& t) {
  const size_t n = t.data().size() / (t.dtype() == v1::DTYPE_FLOAT32 ? 4 : 2);
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = ElementAt(t.data(), t.dtype(), i);
    if (!std::isfinite(x)) return INFINITY;
    m = std::max(m, double(std::fabs(x)));
  }
  return m;
}

}  // namespace

Outcome RunAttendInput(const uint8_t* data, size_t size) {
  Outcome out;
  v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return out;
  out.parsed = true;
  RequestLimits limits;
  limits.max_tensor_elements = kMaxTensorElements;
  limits.head_dims = HeadDims();
  auto job_or = ValidateAttendRequest(request, limits);
  if (!job_or.ok()) {
    if (job_or.status().message().empty()) out.violation = "validation error without a message";
    return out;
  }
  AttendJob& job = **job_or;
  if (job.total_q > kMaxTokens || job.total_k > kMaxTokens) return out;
  out.valid = true;

  v1::AttendResponse response;
  job.response = &response;
  PrepareAttendResponse(job, &response);
  const kernels::AttentionArgs args = job.HostArgs();
  if (kernels::Status st = kernels::ValidateCommon(args); !st.ok()) {
    out.violation = absl::StrCat("validated request fails kernels::ValidateCommon: ", st.message());
    return out;
  }
  if (kernels::Status st = kernels::cpu::CanImplement(args); !st.ok()) {
    out.violation = absl::StrCat("validated request fails cpu::CanImplement: ", st.message());
    return out;
  }
  std::vector<char> workspace(kernels::cpu::WorkspaceBytes(args, 1) + 64);
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data()) + 63) &
                                     ~uintptr_t{63});
  if (kernels::Status st = kernels::cpu::Run(args, ws, nullptr); !st.ok()) {
    out.violation = absl::StrCat("cpu::Run failed on a validated request: ", st.message());
    return out;
  }
  out.computed = true;

  // Output shape and size are what the contract says.
  const v1::Tensor& o = response.o();
  if (o.dtype() != request.q().dtype() || o.data().size() != request.q().data().size()) {
    out.violation = "o has the wrong dtype or size";
    return out;
  }
  // Finite inputs whose scores cannot overflow give a finite output, and |o| <= max |v| (o is a
  // convex combination of rows of v); rows of sequences with no keys are exactly 0.
  const double mq = MaxAbs(request.q()), mk = MaxAbs(request.k()), mv = MaxAbs(request.v());
  const double bound_scores = mq * mk * job.key.head_dim * std::fabs(job.key.softmax_scale);
  const bool tame = std::isfinite(mq) && std::isfinite(mk) && std::isfinite(mv) &&
                    bound_scores < 1e30;
  const int64_t row = int64_t{job.key.num_heads} * job.key.head_dim;
  std::vector<bool> keyless_row(job.total_q, false);
  for (size_t b = 0; b + 1 < job.cu_seqlens_q.size(); ++b) {
    if (job.cu_seqlens_k[b + 1] == job.cu_seqlens_k[b]) {
      for (int32_t i = job.cu_seqlens_q[b]; i < job.cu_seqlens_q[b + 1]; ++i) keyless_row[i] = true;
    }
  }
  for (int64_t i = 0; i < int64_t{job.total_q} * row; ++i) {
    const float x = ElementAt(o.data(), o.dtype(), size_t(i));
    if (keyless_row[i / row] && x != 0.0f) {
      out.violation = absl::StrCat("o[", i, "] = ", x, " in a row whose sequence has no keys");
      return out;
    }
    if (!tame) continue;
    if (!std::isfinite(x)) {
      out.violation = absl::StrCat("o[", i, "] = ", x, " is not finite for finite inputs");
      return out;
    }
    // Rounding to the output dtype and fp32 accumulation may overshoot max |v| by a hair.
    if (std::fabs(x) > mv * 1.01 + 1e-6) {
      out.violation = absl::StrCat("|o[", i, "]| = ", std::fabs(x), " > max |v| = ", mv);
      return out;
    }
  }
  if (job.return_lse && tame) {
    const v1::Tensor& lse = response.lse();
    for (size_t i = 0; i < lse.data().size() / 4; ++i) {
      float x;
      std::memcpy(&x, lse.data().data() + 4 * i, 4);
      if (std::isnan(x) || x == INFINITY) {
        out.violation = absl::StrCat("lse[", i, "] = ", x, " for finite inputs");
        return out;
      }
    }
  }
  return out;
}

}  // namespace attn::fuzz
