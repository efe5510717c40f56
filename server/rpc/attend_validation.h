// Validation and decoding of AttendRequest: every check happens here, before any work.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine/attend_job.h"
#include "attn/v1/attention.pb.h"

namespace attn {

struct RequestLimits {
  int64_t max_tensor_elements = int64_t{1} << 31;
  std::vector<int32_t> head_dims;  // supported by the backend
  // Largest response gRPC may send (--max_message_bytes); 0: no bound.
  int64_t max_response_bytes = 0;
  Fp8Features fp8;  // what the backend does with FP8 tensors
};

kernels::DType ToKernelDType(v1::DType t);
// Checks one rank-3 tensor `name`: a known dtype, sizes > 0, the element limit, byte length.
absl::Status CheckTensor(const v1::Tensor& t, const char* name, const RequestLimits& limits);
// The same for a tensor whose data (data_bytes long) is not in t itself (the wire path).
absl::Status CheckTensor(const v1::Tensor& t, const char* name, const RequestLimits& limits,
                         uint64_t data_bytes);
v1::DType ToWireDType(kernels::DType t);

// Checks request against the limits and fills a job (key, sequence lengths, flags, and q_bytes..
// pointing into request's data). INVALID_ARGUMENT or RESOURCE_EXHAUSTED name the bad field.
absl::StatusOr<std::unique_ptr<AttendJob>> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestLimits& limits);

// Sizes of q.data, k.data and v.data kept outside the request message (the wire path, where
// request holds every other field: rpc/attend_request_decoder.h).
struct TensorDataSizes {
  uint64_t q = 0, k = 0, v = 0;
};
// As above, with the data fields' sizes given; the job's q_bytes, k_bytes and v_bytes are left
// for Backend::StageWireInputs to point at the copied bytes.
absl::StatusOr<std::unique_ptr<AttendJob>> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestLimits& limits, const TensorDataSizes& sizes);

// softmax_scale finite and a window's bounds >= -1 (-1: unbounded), as Attend and Step both take
// them; INVALID_ARGUMENT names the field.
template <typename Request>
absl::Status CheckScaleAndWindow(const Request& r) {
  if (!std::isfinite(r.softmax_scale())) {
    return absl::InvalidArgumentError(absl::StrCat("softmax_scale must be finite, got ", r.softmax_scale()));
  }
  if (r.has_window() && (r.window().left() < -1 || r.window().right() < -1)) {
    return absl::InvalidArgumentError(absl::StrCat("window.left and window.right must be >= -1 (-1: unbounded), ",
                                                   "got ", r.window().left(), " and ", r.window().right()));
  }
  return absl::OkStatus();
}

// key's window (where the request sets one) and softmax scale (0: 1/sqrt(head_dim)), after
// CheckScaleAndWindow and with key->head_dim set.
template <typename Request>
void SetScaleAndWindow(const Request& r, BatchKey* key) {
  if (r.has_window()) {
    key->window_left = r.window().left();
    key->window_right = r.window().right();
  }
  kernels::AttentionArgs scale_args;
  scale_args.head_dim = key->head_dim;
  scale_args.softmax_scale = r.softmax_scale();
  key->softmax_scale = kernels::EffectiveSoftmaxScale(scale_args);
}

// The o (and lse) tensors of an Attend or step response without their data: q's dtype and shape,
// lse as [num_heads, total_q] float32, and the region slice of an output written into a region.
template <typename Request, typename Response>
void DescribeOutputs(const Job& job, const Request& request, Response* response) {
  const v1::Tensor& q = request.q();
  v1::Tensor* o = response->mutable_o();
  // The key's wire dtype, not q's: an all-FP8 Attend answers in the caller's o_dtype.
  o->set_dtype(ToWireDType(job.key.wire_dtype));
  o->mutable_shape()->Assign(q.shape().begin(), q.shape().end());
  // An output written into a region leaves the response with its dtype, shape and slice only.
  if (request.has_o_region()) *o->mutable_region() = request.o_region();
  if (job.return_lse) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::DTYPE_FLOAT32);
    lse->add_shape(job.key.num_heads);
    lse->add_shape(job.total_q);
    if (request.has_lse_region()) *lse->mutable_region() = request.lse_region();
  }
}

// DescribeOutputs, and the response's request_id.
void PrepareAttendResponse(const AttendJob& job, const v1::AttendRequest& request,
                           v1::AttendResponse* response);

// Tensor bytes the job holds in the server (for the batcher's in-flight bound): its inputs and
// outputs that are not in regions. Call once its tensors are resolved (and staged, on the wire
// path).
int64_t AttendJobBytes(const AttendJob& job, const v1::AttendRequest& request);

}  // namespace attn
