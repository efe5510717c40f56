// Validation and decoding of AttendRequest: every check happens here, before any work.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attend_job.h"
#include "attn/v1/attention.pb.h"

namespace attn {

struct RequestLimits {
  int64_t max_tensor_elements = int64_t{1} << 31;
  std::vector<int32_t> head_dims;  // supported by the backend
  // Largest response gRPC may send (--max_message_bytes); 0: no bound.
  int64_t max_response_bytes = 0;
};

kernels::DType ToKernelDType(v1::DType t);
// Checks one rank-3 tensor `name`: a known dtype, sizes > 0, the element limit, byte length.
absl::Status CheckTensor(const v1::Tensor& t, const char* name, const RequestLimits& limits);
v1::DType ToWireDType(kernels::DType t);

// Checks request against the limits and fills a job (key, sequence lengths, flags). The job
// borrows request and response. INVALID_ARGUMENT or RESOURCE_EXHAUSTED name the bad field.
absl::StatusOr<std::unique_ptr<AttendJob>> ValidateAttendRequest(
    const v1::AttendRequest& request, const RequestLimits& limits);

// Sizes the response's o (and lse) tensors for job so that a backend can write into them.
void PrepareAttendResponse(const AttendJob& job, v1::AttendResponse* response);

}  // namespace attn
