#include "rpc/step_validation.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_util.h"
#include "transport/tensor_source.h"

namespace attn {
namespace {

absl::Status Invalid(const std::string& msg) { return absl::InvalidArgumentError(msg); }

std::string Shape(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

std::string DTypeName(v1::DType t) {
  const std::string& name = v1::DType_Name(t);
  return name.empty() ? std::to_string(t) : name;
}

absl::Status CheckPresent(const v1::StepRequest& r) {
  std::vector<std::string> missing;
  if (!r.has_q()) missing.push_back("q");
  if (!r.has_k_new()) missing.push_back("k_new");
  if (!r.has_v_new()) missing.push_back("v_new");
  if (missing.empty()) return absl::OkStatus();
  return Invalid(absl::StrCat(missing.size() == 1 ? "tensor " : "tensors ",
                              absl::StrJoin(missing, " and "),
                              missing.size() == 1 ? " is" : " are",
                              " not set; q, k_new and v_new must all be set"));
}

// The sizes of q.data, k_new.data and v_new.data, wherever they are.
TensorDataSizes DataSizes(const v1::StepRequest& r, const WireTensors* wire) {
  if (wire != nullptr) return {wire->q.size, wire->k.size, wire->v.size};
  return {r.q().data().size(), r.k_new().data().size(), r.v_new().data().size()};
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// FP8 k_new/v_new (sessions with an FP8 cache): both or neither, in data, with scales equal to
// the session's; 16-bit ones without scales.
absl::Status CheckFp8NewKv(const v1::StepRequest& r, const SessionShape& shape) {
  const bool k8 = r.k_new().dtype() == v1::DTYPE_FLOAT8_E4M3;
  const bool v8 = r.v_new().dtype() == v1::DTYPE_FLOAT8_E4M3;
  if (k8 != v8) {
    return Invalid(absl::StrCat("k_new.dtype and v_new.dtype must both be DTYPE_FLOAT8_E4M3 or ",
                                "neither, got ", DTypeName(r.k_new().dtype()), " and ",
                                DTypeName(r.v_new().dtype())));
  }
  if (!k8) {
    for (const auto& [n, name] : {std::pair{r.k_new_scales_size(), "k_new_scales"},
                                  std::pair{r.v_new_scales_size(), "v_new_scales"}}) {
      if (n > 0) {
        return Invalid(absl::StrCat(name, " is only for FP8 k_new/v_new (DTYPE_FLOAT8_E4M3); ",
                                    "k_new is ", DTypeName(r.k_new().dtype())));
      }
    }
    return absl::OkStatus();
  }
  if (r.k_new().has_region() || r.v_new().has_region()) {
    return Invalid(absl::StrCat(r.k_new().has_region() ? "k_new" : "v_new",
                                ".region: FP8 k_new/v_new travel in data, not in regions"));
  }
  for (const auto& [got, want, name] :
       {std::tuple{&r.k_new_scales(), &shape.k_scales, "k_new_scales"},
        std::tuple{&r.v_new_scales(), &shape.v_scales, "v_new_scales"}}) {
    if (got->size() != static_cast<int>(want->size())) {
      return Invalid(absl::StrCat(name, " must have num_kv_heads (", want->size(),
                                  ") entries for FP8 k_new/v_new, got ", got->size()));
    }
    for (size_t i = 0; i < want->size(); ++i) {
      if (!SameBits((*got)[static_cast<int>(i)], (*want)[i])) {
        return Invalid(absl::StrCat(
            name, "[", i, "] is ", (*got)[static_cast<int>(i)], " but the session's scale is ",
            (*want)[i], "; FP8 k_new/v_new must be quantized with the session's scales (or sent "
            "in 16 bits, which the server quantizes)"));
      }
    }
  }
  return absl::OkStatus();
}

// Tensors against each other and against the session's shape and dtype.
absl::Status CheckStepShapes(const v1::StepRequest& r, const Session& s,
                             const RequestLimits& limits, const TensorDataSizes& data) {
  RETURN_IF_ERROR(CheckPresent(r));
  RETURN_IF_ERROR(CheckTensor(r.q(), "q", limits, data.q));
  RETURN_IF_ERROR(CheckTensor(r.k_new(), "k_new", limits, data.k));
  RETURN_IF_ERROR(CheckTensor(r.v_new(), "v_new", limits, data.v));
  const SessionShape& shape = s.shape();
  const v1::DType want = ToWireDType(shape.dtype);
  const bool fp8_cache = shape.Fp8Cache();
  for (const auto& [t, name] : {std::pair{&r.q(), "q"}, {&r.k_new(), "k_new"}, {&r.v_new(), "v_new"}}) {
    const bool fp8_ok = fp8_cache && t != &r.q() && t->dtype() == v1::DTYPE_FLOAT8_E4M3;
    if (t->dtype() != want && !fp8_ok) {
      return Invalid(absl::StrCat(
          name, ".dtype must be the session's dtype ", DTypeName(want),
          fp8_cache && t != &r.q() ? " or DTYPE_FLOAT8_E4M3 (the session's FP8 cache)" : "",
          ", got ", DTypeName(t->dtype())));
    }
  }
  RETURN_IF_ERROR(CheckFp8NewKv(r, shape));
  for (int i = 0; i < 3; ++i) {
    if (r.v_new().shape(i) != r.k_new().shape(i)) {
      return Invalid(absl::StrCat("v_new.shape must equal k_new.shape ", Shape(r.k_new()),
                                  ", got ", Shape(r.v_new())));
    }
  }
  if (r.k_new().shape(0) != r.q().shape(0)) {
    return Invalid(absl::StrCat("k_new.shape[0] (new tokens) must equal q.shape[0] = ",
                                r.q().shape(0), ", got ", r.k_new().shape(0)));
  }
  if (r.k_new().shape(1) != shape.num_kv_heads) {
    return Invalid(absl::StrCat("k_new.shape[1] (num_kv_heads) must be the session's ",
                                shape.num_kv_heads, ", got ", r.k_new().shape(1)));
  }
  for (const auto& [t, name] : {std::pair{&r.q(), "q"}, {&r.k_new(), "k_new"}}) {
    if (t->shape(2) != shape.head_dim) {
      return Invalid(absl::StrCat(name, ".shape[2] (head_dim) must be the session's ",
                                  shape.head_dim, ", got ", t->shape(2)));
    }
  }
  if (r.q().shape(1) % shape.num_kv_heads != 0) {
    return Invalid(absl::StrCat("q.shape[1] (num_heads = ", r.q().shape(1), ") must be a ",
                                "multiple of the session's num_kv_heads (", shape.num_kv_heads,
                                ")"));
  }
  if (r.q().shape(0) > shape.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "q.shape[0] (", r.q().shape(0), " new tokens) is more than the session's limit of ",
        shape.max_tokens, " tokens per layer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SessionCacheParams(const v1::CreateSessionRequest& r, const Fp8Features& fp8,
                                SessionManager::CreateParams* p) {
  const v1::DType cache = r.cache_dtype();
  const bool fp8_cache = cache == v1::DTYPE_FLOAT8_E4M3;
  if (cache != v1::DTYPE_UNSPECIFIED && cache != r.dtype() && !fp8_cache) {
    return Invalid(absl::StrCat("cache_dtype must be unset, the session's dtype or ",
                                "DTYPE_FLOAT8_E4M3, got ", DTypeName(cache)));
  }
  if (!fp8_cache) {
    for (const auto& [n, name] : {std::pair{r.k_scales_size(), "k_scales"},
                                  std::pair{r.v_scales_size(), "v_scales"}}) {
      if (n > 0) {
        return Invalid(absl::StrCat(name, " is only for an FP8 cache (cache_dtype ",
                                    "DTYPE_FLOAT8_E4M3)"));
      }
    }
    return absl::OkStatus();
  }
  if (!fp8.session_cache) {
    return absl::FailedPreconditionError(
        "cache_dtype DTYPE_FLOAT8_E4M3: this attnd's backend has no FP8 session caches "
        "(GetServerInfo fp8.session_fp8_cache is false)");
  }
  const auto& dims = fp8.session_head_dims;
  if (!dims.empty() && std::find(dims.begin(), dims.end(), r.head_dim()) == dims.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cache_dtype DTYPE_FLOAT8_E4M3 with head_dim ", r.head_dim(), ": this backend's FP8 "
        "kernel takes head_dim ", absl::StrJoin(dims, ", ")));
  }
  for (const auto& [scales, name] : {std::pair{&r.k_scales(), "k_scales"},
                                     std::pair{&r.v_scales(), "v_scales"}}) {
    if (scales->empty()) {
      return Invalid(absl::StrCat(name, " is required for an FP8 cache (one float32 scale per ",
                                  "KV head)"));
    }
  }
  p->cache_dtype = kernels::DType::kFloat8E4M3;
  p->k_scales.assign(r.k_scales().begin(), r.k_scales().end());
  p->v_scales.assign(r.v_scales().begin(), r.v_scales().end());
  return absl::OkStatus();
}

absl::StatusOr<kernels::DType> SessionDType(v1::DType dtype) {
  if (dtype == v1::DTYPE_FLOAT16) return kernels::DType::kFloat16;
  if (dtype == v1::DTYPE_BFLOAT16) return kernels::DType::kBFloat16;
  return Invalid(absl::StrCat("dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16 (the cache's ",
                              "element type), got ", DTypeName(dtype)));
}

absl::StatusOr<std::unique_ptr<StepJob>> ValidateStepRequest(const v1::StepRequest& r,
                                                             std::shared_ptr<Session> session,
                                                             const RequestLimits& limits,
                                                             const StepRegions& regions,
                                                             WireTensors* wire) {
  const SessionShape& shape = session->shape();
  if (r.layer() < 0 || r.layer() >= shape.num_layers) {
    return Invalid(absl::StrCat("layer ", r.layer(), " is out of range: session ", session->id(),
                                " has ", shape.num_layers, " layers (0 <= layer < ",
                                shape.num_layers, ")"));
  }
  const TensorDataSizes data = DataSizes(r, wire);
  RETURN_IF_ERROR(CheckStepShapes(r, *session, limits, data));
  RETURN_IF_ERROR(CheckScaleAndWindow(r));
  auto job = std::make_unique<StepJob>();
  job->total_q = static_cast<int32_t>(r.q().shape(0));
  job->return_lse = r.return_lse();
  BatchKey& key = job->key;
  key.wire_dtype = shape.dtype;
  key.num_heads = static_cast<int32_t>(r.q().shape(1));
  key.num_kv_heads = shape.num_kv_heads;
  key.head_dim = shape.head_dim;
  key.causal = true;
  SetScaleAndWindow(r, &key);
  key.page_tokens = shape.page_tokens;
  key.decode = job->total_q == 1;
  key.fp8_cache = shape.Fp8Cache();
  key.fp8_kv = r.k_new().dtype() == v1::DTYPE_FLOAT8_E4M3;
  if (key.fp8_cache && limits.fp8.session_max_step_tokens > 0 &&
      job->total_q > limits.fp8.session_max_step_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "q.shape[0] (", job->total_q, " new tokens) is more than this backend's FP8 kernel takes "
        "in one step of an FP8-cache session (", limits.fp8.session_max_step_tokens,
        "); send the chunk in steps of at most that many tokens"));
  }
  const bool any_region = r.q().has_region() || r.k_new().has_region() ||
                          r.v_new().has_region() || r.has_o_region() || r.has_lse_region();
  if (any_region) {
    RETURN_IF_ERROR(ResolveStepTensors(r, regions.owner, regions.registry, regions.gpu_regions,
                                       job.get()));
    if (key.fp8_cache && job->device_tensors) {
      return absl::FailedPreconditionError(
          "k_new/v_new in GPU regions: steps of a session with an FP8 cache take their tensors "
          "in data or host regions");
    }
  } else {
    // Every tensor in the message (its data fields, or the received slices): nothing to resolve.
    job->q_bytes = r.q().data();
    job->k_bytes = r.k_new().data();
    job->v_bytes = r.v_new().data();
  }
  // Outputs written into regions take no room in the response.
  const int64_t o_bytes = static_cast<int64_t>(job->OBytes());
  const int64_t lse_bytes = static_cast<int64_t>(job->LseBytes());
  const int64_t o_message = job->o_out != nullptr ? 0 : o_bytes;
  const int64_t lse_message = job->lse_out != nullptr ? 0 : lse_bytes;
  constexpr int64_t kResponseOverhead = 1024;
  const int64_t response_bytes = o_message + lse_message + kResponseOverhead;
  if (limits.max_response_bytes > 0 && response_bytes > limits.max_response_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response (o", job->return_lse ? " and lse" : "", ") would be about ",
        response_bytes, " bytes, over the ", limits.max_response_bytes,
        "-byte message limit (attnd's --max_message_bytes); send fewer new tokens per step"));
  }
  // Bytes held in the server: the message's tensors and the outputs that come back in it.
  job->bytes = static_cast<int64_t>(data.q + data.k + data.v) + o_message + lse_message;
  // Tensors that came inline on the wire path are read from the received message's pieces when
  // the launch is staged (the one copy of them); ResolveStepTensors pointed them at the empty
  // data fields.
  if (wire != nullptr) job->wire = std::move(*wire);
  job->session = std::move(session);
  job->layer = r.layer();
  return job;
}

void PrepareStepResponse(const StepJob& job, const v1::StepRequest& request,
                         v1::StepResponse* response) {
  DescribeOutputs(job, request, response);
}

}  // namespace attn
