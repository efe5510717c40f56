#include "common/status_util.h"

#include <string>

namespace attn {

absl::Status FromKernelStatus(const kernels::Status& st) {
  switch (st.code()) {
    case kernels::StatusCode::kOk: return absl::OkStatus();
    case kernels::StatusCode::kInvalidArgument: return absl::InvalidArgumentError(st.message());
    case kernels::StatusCode::kUnimplemented: return absl::InvalidArgumentError(st.message());
    case kernels::StatusCode::kResourceExhausted:
      return absl::ResourceExhaustedError(st.message());
    case kernels::StatusCode::kInternal: return absl::InternalError(st.message());
  }
  return absl::UnknownError(st.message());
}

const char* StatusCodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal: return "INTERNAL";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss: return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

}  // namespace attn
