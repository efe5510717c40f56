#include "rpc/attend_validation.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_util.h"

namespace attn {
namespace {

absl::Status Invalid(const std::string& msg) { return absl::InvalidArgumentError(msg); }

std::string ShapeString(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

}  // namespace

absl::Status CheckTensor(const v1::Tensor& t, const char* name, const RequestLimits& limits) {
  return CheckTensor(t, name, limits, t.data().size());
}

absl::Status CheckTensor(const v1::Tensor& t, const char* name, const RequestLimits& limits,
                         uint64_t data_bytes) {
  if (t.dtype() != v1::DTYPE_FLOAT16 && t.dtype() != v1::DTYPE_BFLOAT16 &&
      t.dtype() != v1::DTYPE_FLOAT32 && t.dtype() != v1::DTYPE_FLOAT8_E4M3) {
    return Invalid(absl::StrCat(name, ".dtype must be DTYPE_FLOAT16, DTYPE_BFLOAT16, ",
                                "DTYPE_FLOAT32 or DTYPE_FLOAT8_E4M3, got ",
                                v1::DType_Name(t.dtype()).empty()
                                    ? std::to_string(t.dtype())
                                    : v1::DType_Name(t.dtype())));
  }
  if (t.shape_size() != 3) {
    return Invalid(absl::StrCat(name, ".shape must have 3 dimensions [tokens, heads, head_dim], ",
                                "got ", ShapeString(t)));
  }
  int64_t elements = 1;
  for (int i = 0; i < 3; ++i) {
    const int64_t n = t.shape(i);
    if (n <= 0) {
      return Invalid(absl::StrCat(name, ".shape[", i, "] must be > 0, got ", n, " (shape ",
                                  ShapeString(t), ")"));
    }
    if (n > limits.max_tensor_elements || elements > limits.max_tensor_elements / n) {
      return absl::ResourceExhaustedError(
          absl::StrCat(name, " has more than max_tensor_elements (", limits.max_tensor_elements,
                       ") elements: shape ", ShapeString(t),
                       "; the limit is attnd's --max_tensor_elements flag"));
    }
    elements *= n;
  }
  const int64_t want = elements * static_cast<int64_t>(kernels::DTypeSize(ToKernelDType(t.dtype())));
  if (t.has_region()) {
    if (t.dtype() == v1::DTYPE_FLOAT8_E4M3) {
      return Invalid(absl::StrCat(name, ".region cannot hold a DTYPE_FLOAT8_E4M3 tensor; send ",
                                  "FP8 tensors in ", name, ".data"));
    }
    // Its bytes are checked against the region where it is resolved (transport/tensor_source.h).
    if (data_bytes != 0) {
      return Invalid(absl::StrCat(name, ".data and ", name, ".region are both set; set one"));
    }
    return absl::OkStatus();
  }
  if (data_bytes != static_cast<uint64_t>(want)) {
    return Invalid(absl::StrCat(name, ".data has ", data_bytes, " bytes, but shape ",
                                ShapeString(t), " of ", v1::DType_Name(t.dtype()), " needs ",
                                want));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckCuSeqlens(const google::protobuf::RepeatedField<int32_t>& cu, const char* name,
                            int64_t total, std::vector<int32_t>* out, int32_t* max_len) {
  if (cu.size() < 2) {
    return Invalid(absl::StrCat(name, " must have at least 2 entries (0 and the total ", total,
                                "), got ", cu.size()));
  }
  if (cu[0] != 0) return Invalid(absl::StrCat(name, "[0] must be 0, got ", cu[0]));
  *max_len = 0;
  for (int i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return Invalid(absl::StrCat(name, " must not decrease, but ", name, "[", i, "] = ", cu[i],
                                  " < ", name, "[", i - 1, "] = ", cu[i - 1]));
    }
    *max_len = std::max(*max_len, cu[i] - cu[i - 1]);
  }
  if (cu[cu.size() - 1] != total) {
    return Invalid(absl::StrCat(name, " must end at the token count ", total, ", but its last ",
                                "entry is ", cu[cu.size() - 1]));
  }
  out->assign(cu.begin(), cu.end());
  return absl::OkStatus();
}

absl::Status CheckShapes(const v1::AttendRequest& r, const RequestLimits& limits,
                         const TensorDataSizes& sizes) {
  RETURN_IF_ERROR(CheckTensor(r.q(), "q", limits, sizes.q));
  RETURN_IF_ERROR(CheckTensor(r.k(), "k", limits, sizes.k));
  RETURN_IF_ERROR(CheckTensor(r.v(), "v", limits, sizes.v));
  const bool kv_fp8 = r.k().dtype() == v1::DTYPE_FLOAT8_E4M3;
  if (r.v().dtype() != r.k().dtype() ||
      (!kv_fp8 && r.k().dtype() != r.q().dtype()) ||
      (r.q().dtype() == v1::DTYPE_FLOAT8_E4M3 && !kv_fp8)) {
    return Invalid(absl::StrCat("k.dtype and v.dtype must equal q.dtype (",
                                v1::DType_Name(r.q().dtype()), "), or both be ",
                                "DTYPE_FLOAT8_E4M3; got ", v1::DType_Name(r.k().dtype()), " and ",
                                v1::DType_Name(r.v().dtype())));
  }
  for (int i = 0; i < 3; ++i) {
    if (r.v().shape(i) != r.k().shape(i)) {
      return Invalid(absl::StrCat("v.shape must equal k.shape ", ShapeString(r.k()), ", got ",
                                  ShapeString(r.v())));
    }
  }
  const int64_t d = r.q().shape(2);
  if (r.k().shape(2) != d) {
    return Invalid(absl::StrCat("k.shape[2] (head_dim) must equal q.shape[2] = ", d, ", got ",
                                r.k().shape(2)));
  }
  if (std::find(limits.head_dims.begin(), limits.head_dims.end(), d) == limits.head_dims.end()) {
    return Invalid(absl::StrCat("head_dim ", d, " (q.shape[2]) is not supported; supported: ",
                                absl::StrJoin(limits.head_dims, ", ")));
  }
  const int64_t hq = r.q().shape(1), hkv = r.k().shape(1);
  if (hq % hkv != 0) {
    return Invalid(absl::StrCat("num_heads (q.shape[1] = ", hq, ") must be a multiple of ",
                                "num_kv_heads (k.shape[1] = ", hkv, ")"));
  }
  constexpr int64_t kMaxTokens = int64_t{1} << 30;
  if (r.q().shape(0) > kMaxTokens || r.k().shape(0) > kMaxTokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat("at most ", kMaxTokens, " tokens per tensor (q.shape[0], k.shape[0])"));
  }
  return absl::OkStatus();
}

// One descale list of Fp8Attend: absent unless `fp8`, else 1 or batch * num_kv_heads entries,
// each finite and > 0; expanded into `out` as [batch, num_kv_heads].
absl::Status CheckDescales(const google::protobuf::RepeatedField<float>& list, const char* name,
                           const char* tensor, bool fp8, int32_t batch, int32_t num_kv_heads,
                           std::vector<float>* out) {
  if (!fp8) {
    if (!list.empty()) {
      return Invalid(absl::StrCat(name, " is set, but ", tensor, ".dtype is not ",
                                  "DTYPE_FLOAT8_E4M3; leave it empty"));
    }
    return absl::OkStatus();
  }
  const int64_t per_head = int64_t{batch} * num_kv_heads;
  if (list.empty()) {
    return Invalid(absl::StrCat(name, " is missing: ", tensor, " is DTYPE_FLOAT8_E4M3 and needs ",
                                "its float32 descales (1 per tensor, or batch * num_kv_heads = ",
                                per_head, ")"));
  }
  if (list.size() != 1 && list.size() != per_head) {
    return Invalid(absl::StrCat(name, " must have 1 entry (per tensor) or batch * num_kv_heads = ",
                                batch, " * ", num_kv_heads, " = ", per_head,
                                " entries ([batch, num_kv_heads]), got ", list.size()));
  }
  for (int i = 0; i < list.size(); ++i) {
    if (!std::isfinite(list[i]) || !(list[i] > 0.0f)) {
      return Invalid(absl::StrCat(name, "[", i, "] must be finite and > 0, got ", list[i]));
    }
  }
  out->resize(per_head);
  for (int64_t i = 0; i < per_head; ++i) (*out)[i] = list[list.size() == 1 ? 0 : int(i)];
  return absl::OkStatus();
}

// The FP8 part of an Attend request: features the backend has, descales, o's type.
absl::Status CheckFp8(const v1::AttendRequest& r, const RequestLimits& limits, AttendJob* job) {
  const bool q_fp8 = r.q().dtype() == v1::DTYPE_FLOAT8_E4M3;
  const bool kv_fp8 = r.k().dtype() == v1::DTYPE_FLOAT8_E4M3;
  if (!kv_fp8) {
    if (r.has_fp8()) {
      return Invalid("fp8 is set, but none of q, k and v is DTYPE_FLOAT8_E4M3; leave it unset");
    }
    return absl::OkStatus();
  }
  if (q_fp8 && !limits.fp8.attend_q) {
    return absl::FailedPreconditionError(
        "q.dtype DTYPE_FLOAT8_E4M3 (all-FP8 Attend) is not supported by this server's backend "
        "(GetServerInfo: fp8.attend_fp8_q); send q as float16 or bfloat16");
  }
  if (!limits.fp8.attend_kv) {
    return absl::FailedPreconditionError(
        "k.dtype DTYPE_FLOAT8_E4M3 (FP8 K/V Attend) is not supported by this server's backend "
        "(GetServerInfo: fp8.attend_fp8_kv)");
  }
  if (!r.has_fp8()) {
    return Invalid("fp8 is missing: k and v are DTYPE_FLOAT8_E4M3 and need fp8.k_descale and "
                   "fp8.v_descale");
  }
  const v1::Fp8Attend& f = r.fp8();
  const int32_t batch = static_cast<int32_t>(job->cu_seqlens_q.size()) - 1;
  const int32_t hkv = job->key.num_kv_heads;
  RETURN_IF_ERROR(CheckDescales(f.q_descale(), "fp8.q_descale", "q", q_fp8, batch, hkv,
                                &job->q_descales));
  RETURN_IF_ERROR(CheckDescales(f.k_descale(), "fp8.k_descale", "k", true, batch, hkv,
                                &job->k_descales));
  RETURN_IF_ERROR(CheckDescales(f.v_descale(), "fp8.v_descale", "v", true, batch, hkv,
                                &job->v_descales));
  if (q_fp8) {
    if (f.o_dtype() != v1::DTYPE_FLOAT16 && f.o_dtype() != v1::DTYPE_BFLOAT16) {
      return Invalid(absl::StrCat("fp8.o_dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16 when q is ",
                                  "DTYPE_FLOAT8_E4M3, got ", v1::DType_Name(f.o_dtype())));
    }
    // The backend computes with q's descale folded into k's; the product must stay a scale.
    for (size_t i = 0; i < job->k_descales.size(); ++i) {
      const float s = job->q_descales[i] * job->k_descales[i];
      if (!std::isfinite(s) || !(s > 0.0f)) {
        return Invalid(absl::StrCat("fp8.q_descale * fp8.k_descale must be a finite float32 > 0 ",
                                    "for every sequence and KV head, got ", s, " at [", i, "]"));
      }
    }
  } else if (f.o_dtype() != v1::DTYPE_UNSPECIFIED) {
    return Invalid(absl::StrCat("fp8.o_dtype must be unset unless q is DTYPE_FLOAT8_E4M3 (o has ",
                                "q's type ", v1::DType_Name(r.q().dtype()), ")"));
  }
  job->key.fp8_kv = true;
  job->key.fp8_q = q_fp8;
  if (q_fp8) job->key.wire_dtype = ToKernelDType(f.o_dtype());
  return absl::OkStatus();
}

}  // namespace

kernels::DType ToKernelDType(v1::DType t) {
  switch (t) {
    case v1::DTYPE_FLOAT16: return kernels::DType::kFloat16;
    case v1::DTYPE_FLOAT32: return kernels::DType::kFloat32;
    case v1::DTYPE_FLOAT8_E4M3: return kernels::DType::kFloat8E4M3;
    default: return kernels::DType::kBFloat16;
  }
}

v1::DType ToWireDType(kernels::DType t) {
  switch (t) {
    case kernels::DType::kFloat16: return v1::DTYPE_FLOAT16;
    case kernels::DType::kFloat32: return v1::DTYPE_FLOAT32;
    case kernels::DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case kernels::DType::kFloat8E4M3: return v1::DTYPE_FLOAT8_E4M3;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<std::unique_ptr<AttendJob>> ValidateAttendRequest(const v1::AttendRequest& r,
                                                                 const RequestLimits& limits) {
  ASSIGN_OR_RETURN(std::unique_ptr<AttendJob> job,
                   ValidateAttendRequest(r, limits, {r.q().data().size(), r.k().data().size(),
                                                     r.v().data().size()}));
  job->q_bytes = r.q().data();
  job->k_bytes = r.k().data();
  job->v_bytes = r.v().data();
  return job;
}

absl::StatusOr<std::unique_ptr<AttendJob>> ValidateAttendRequest(const v1::AttendRequest& r,
                                                                 const RequestLimits& limits,
                                                                 const TensorDataSizes& sizes) {
  if (!r.has_q() || !r.has_k() || !r.has_v()) {
    std::vector<std::string> missing;
    if (!r.has_q()) missing.push_back("q");
    if (!r.has_k()) missing.push_back("k");
    if (!r.has_v()) missing.push_back("v");
    const std::string names = missing.size() == 3 ? "q, k and v" : absl::StrJoin(missing, " and ");
    return Invalid(absl::StrCat(missing.size() == 1 ? "tensor " : "tensors ", names,
                                missing.size() == 1 ? " is" : " are",
                                " not set; q, k and v must all be set"));
  }
  RETURN_IF_ERROR(CheckShapes(r, limits, sizes));
  auto job = std::make_unique<AttendJob>();
  job->total_q = static_cast<int32_t>(r.q().shape(0));
  job->total_k = static_cast<int32_t>(r.k().shape(0));

  const bool has_q = r.cu_seqlens_q_size() > 0, has_k = r.cu_seqlens_k_size() > 0;
  if (has_q != has_k) {
    return Invalid("cu_seqlens_q and cu_seqlens_k must be given together (or both left empty)");
  }
  if (has_q) {
    if (r.cu_seqlens_q_size() != r.cu_seqlens_k_size()) {
      return Invalid(absl::StrCat("cu_seqlens_q and cu_seqlens_k must have the same number of ",
                                  "entries (batch + 1), got ", r.cu_seqlens_q_size(), " and ",
                                  r.cu_seqlens_k_size()));
    }
    RETURN_IF_ERROR(CheckCuSeqlens(r.cu_seqlens_q(), "cu_seqlens_q", job->total_q,
                                   &job->cu_seqlens_q, &job->max_seqlen_q));
    RETURN_IF_ERROR(CheckCuSeqlens(r.cu_seqlens_k(), "cu_seqlens_k", job->total_k,
                                   &job->cu_seqlens_k, &job->max_seqlen_k));
  } else {
    job->cu_seqlens_q = {0, job->total_q};
    job->cu_seqlens_k = {0, job->total_k};
    job->max_seqlen_q = job->total_q;
    job->max_seqlen_k = job->total_k;
  }

  RETURN_IF_ERROR(CheckScaleAndWindow(r));
  BatchKey& key = job->key;
  key.wire_dtype = ToKernelDType(r.q().dtype());
  key.num_heads = static_cast<int32_t>(r.q().shape(1));
  key.num_kv_heads = static_cast<int32_t>(r.k().shape(1));
  key.head_dim = static_cast<int32_t>(r.q().shape(2));
  key.causal = r.causal();
  RETURN_IF_ERROR(CheckFp8(r, limits, job.get()));
  SetScaleAndWindow(r, &key);
  job->return_lse = r.return_lse();
  // o is as large as q; lse adds 4 bytes per (head, query token). A request that fits can still
  // ask for an answer that would not: refuse it before any work rather than fail to send it.
  constexpr int64_t kResponseOverhead = 1024;  // shapes, timing, ids
  // Outputs written into regions (o_region, lse_region) take no room in the response.
  const int64_t o_bytes = int64_t{job->total_q} * key.num_heads * key.head_dim *
                          static_cast<int64_t>(kernels::DTypeSize(key.wire_dtype));
  const int64_t response_bytes =
      (r.has_o_region() ? 0 : o_bytes) +
      (job->return_lse && !r.has_lse_region() ? int64_t{4} * key.num_heads * job->total_q : 0) +
      kResponseOverhead;
  if (limits.max_response_bytes > 0 && response_bytes > limits.max_response_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response (o", job->return_lse ? " and lse" : "", ") would be about ",
        response_bytes, " bytes, over the ", limits.max_response_bytes,
        "-byte message limit (attnd's --max_message_bytes); send fewer query tokens",
        job->return_lse ? " or set return_lse false" : ""));
  }
  job->high_priority = r.priority() == v1::PRIORITY_HIGH;
  return job;
}

void PrepareAttendResponse(const AttendJob& job, const v1::AttendRequest& request,
                           v1::AttendResponse* response) {
  DescribeOutputs(job, request, response);
  response->set_request_id(request.request_id());
}

int64_t AttendJobBytes(const AttendJob& job, const v1::AttendRequest& request) {
  int64_t bytes = 0;
  for (const auto& [t, b] : {std::pair{&request.q(), job.q_bytes},
                             std::pair{&request.k(), job.k_bytes},
                             std::pair{&request.v(), job.v_bytes}}) {
    if (!t->has_region()) bytes += static_cast<int64_t>(b.size());
  }
  if (!request.has_o_region()) bytes += static_cast<int64_t>(job.OBytes());
  if (!request.has_lse_region()) bytes += static_cast<int64_t>(job.LseBytes());
  return bytes;
}

}  // namespace attn
