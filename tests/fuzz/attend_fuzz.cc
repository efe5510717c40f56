#include "attend_fuzz.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/message_differencer.h>

#include "fuzz_env.h"
#include "rpc/attend_request_decoder.h"
#include "rpc/attend_validation.h"
#include "transport/tensor_source.h"
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

float ElementAt(std::string_view bytes, v1::DType dtype, size_t i) {
  if (dtype == v1::DTYPE_FLOAT32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == v1::DTYPE_FLOAT16 ? kernels::cpu::HalfBitsToFloat(h) : kernels::cpu::Bf16BitsToFloat(h);
}

// Largest |x| of a tensor's bytes, or +inf when it holds a NaN or an infinity.
double MaxAbs(std::string_view bytes, v1::DType dtype) {
  const size_t n = bytes.size() / (dtype == v1::DTYPE_FLOAT32 ? 4 : 2);
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = ElementAt(bytes, dtype, i);
    if (!std::isfinite(x)) return INFINITY;
    m = std::max(m, double(std::fabs(x)));
  }
  return m;
}

// The wire path's reader on the same bytes, cut into pieces where the input says (after each
// byte whose low 3 bits are 0b101, and at 1/3 and 2/3 of it): it must refuse only with
// INVALID_ARGUMENT, accept whatever protobuf accepts with the same message (tensor data as pieces
// of the input), and validate that message as the protobuf path does. "" when all holds.
std::string CheckWireReader(const uint8_t* data, size_t size, const RequestLimits& limits) {
  const std::vector<std::string_view> pieces = PiecesOf(data, size);
  DecodedAttendRequest decoded;
  const absl::Status st = DecodeAttendRequest(pieces, &decoded);
  v1::AttendRequest expected;
  const bool protobuf_ok = expected.ParseFromArray(data, static_cast<int>(size));
  if (!st.ok()) {
    if (st.code() != absl::StatusCode::kInvalidArgument ||
        st.message().find("AttendRequest is malformed: ") == std::string_view::npos) {
      return absl::StrCat("wire reader refused with an unexpected status: ", st.ToString());
    }
    return protobuf_ok ? absl::StrCat("wire reader refused what protobuf parses: ", st.ToString())
                       : "";
  }
  if (!protobuf_ok) return "";  // the reader accepts a little more (tags over 5 bytes)
  v1::AttendRequest got = decoded.header;
  const std::pair<const WireBytes*, v1::Tensor*> tensors[] = {{&decoded.data.q, got.mutable_q()},
                                                              {&decoded.data.k, got.mutable_k()},
                                                              {&decoded.data.v, got.mutable_v()}};
  for (auto [wire, t] : tensors) {
    std::string joined;
    for (std::string_view p : wire->pieces) joined.append(p);
    if (joined.size() != wire->size) return "wire reader: pieces do not add up to the data size";
    if (!joined.empty()) t->set_data(joined);
  }
  if (!decoded.header.has_q()) got.clear_q();
  if (!decoded.header.has_k()) got.clear_k();
  if (!decoded.header.has_v()) got.clear_v();
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  google::protobuf::util::MessageDifferencer differ;
  differ.set_field_comparator(&comparator);
  if (!differ.Compare(expected, got)) return "wire reader's message differs from protobuf's";
  const auto by_proto = ValidateAttendRequest(expected, limits);
  const auto by_wire = ValidateAttendRequest(
      decoded.header, limits, {decoded.data.q.size, decoded.data.k.size, decoded.data.v.size});
  if (by_proto.status() != by_wire.status()) {
    return absl::StrCat("validation differs: protobuf path ", by_proto.status().ToString(),
                        ", wire path ", by_wire.status().ToString());
  }
  return "";
}

}  // namespace

Outcome RunAttendInput(const uint8_t* data, size_t size) {
  Outcome out;
  RequestLimits limits;
  limits.max_tensor_elements = kMaxTensorElements;
  limits.head_dims = HeadDims();
  out.violation = CheckWireReader(data, size, limits);
  if (!out.violation.empty()) return out;
  v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return out;
  out.parsed = true;
  auto job_or = ValidateAttendRequest(request, limits);
  if (!job_or.ok()) {
    if (job_or.status().message().empty()) out.violation = "validation error without a message";
    return out;
  }
  AttendJob& job = **job_or;
  if (job.total_q > kMaxTokens || job.total_k > kMaxTokens) return out;
  // Region fields: the same resolution attnd runs, against the regions of identity "fuzz",
  // refilled with a fixed finite pattern so that a run never depends on the ones before it.
  FuzzRegions& regions = FuzzRegions::Get();
  if (request.q().has_region() || request.k().has_region() || request.v().has_region() ||
      request.has_o_region() || request.has_lse_region()) {
    regions.Fill(0);
  }
  if (absl::Status st = ResolveAttendTensors(request, FuzzRegions::kOwner, &regions.registry(),
                                             &job);
      !st.ok()) {
    if (st.message().empty()) out.violation = "region error without a message";
    return out;
  }
  out.violation = regions.CheckResolved(job);
  if (!out.violation.empty()) return out;
  out.valid = true;
  if (job.device_tensors) {  // a device backend's request: nothing here may read it
    out.on_gpu = true;
    return out;
  }

  v1::AttendResponse response;
  out.violation = ComputeAttendOnCpu(job, request, &response);
  if (!out.violation.empty()) return out;
  out.computed = true;

  // Output shape and size are what the contract says; o is in the response or in its region.
  const v1::Tensor& o = response.o();
  const v1::DType dtype = request.q().dtype();
  const std::string_view o_bytes =
      job.o_out != nullptr ? std::string_view(job.o_out, job.q_bytes.size()) : o.data();
  if (o.dtype() != dtype || o_bytes.size() != job.q_bytes.size() ||
      (job.o_out != nullptr) != o.has_region()) {
    out.violation = "o has the wrong dtype or size, or its region is not reported";
    return out;
  }
  // Finite inputs whose scores cannot overflow give a finite output, and |o| <= max |v| (o is a
  // convex combination of rows of v); rows of sequences with no keys are exactly 0.
  const double mq = MaxAbs(job.q_bytes, dtype), mk = MaxAbs(job.k_bytes, dtype),
               mv = MaxAbs(job.v_bytes, dtype);
  const double bound_scores = mq * mk * job.key.head_dim * std::fabs(job.key.softmax_scale);
  // Every backend accumulates o's rows in float32 with weights exp(s - running max) <= 1 and
  // divides by their sum at the end, so a row's accumulator reaches (its keys) * max |v| before
  // that division: beyond float32's range o overflows although its exact value is finite.
  int32_t max_keys = 0;
  for (size_t b = 0; b + 1 < job.cu_seqlens_k.size(); ++b) {
    max_keys = std::max(max_keys, job.cu_seqlens_k[b + 1] - job.cu_seqlens_k[b]);
  }
  const bool tame = std::isfinite(mq) && std::isfinite(mk) && std::isfinite(mv) &&
                    bound_scores < 1e30 &&
                    mv * max_keys < 0.5 * double(std::numeric_limits<float>::max());
  const int64_t row = int64_t{job.key.num_heads} * job.key.head_dim;
  std::vector<bool> keyless_row(job.total_q, false);
  for (size_t b = 0; b + 1 < job.cu_seqlens_q.size(); ++b) {
    if (job.cu_seqlens_k[b + 1] == job.cu_seqlens_k[b]) {
      for (int32_t i = job.cu_seqlens_q[b]; i < job.cu_seqlens_q[b + 1]; ++i) keyless_row[i] = true;
    }
  }
  for (int64_t i = 0; i < int64_t{job.total_q} * row; ++i) {
    const float x = ElementAt(o_bytes, dtype, size_t(i));
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
    const std::string_view lse =
        job.lse_out != nullptr
            ? std::string_view(job.lse_out, 4 * size_t(job.total_q) * job.key.num_heads)
            : std::string_view(response.lse().data());
    for (size_t i = 0; i < lse.size() / 4; ++i) {
      float x;
      std::memcpy(&x, lse.data() + 4 * i, 4);
      if (std::isnan(x) || x == INFINITY) {
        out.violation = absl::StrCat("lse[", i, "] = ", x, " for finite inputs");
        return out;
      }
    }
  }
  return out;
}

}  // namespace attn::fuzz
