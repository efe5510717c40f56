// absl::Status helpers: early-return macros, the kernels' status as absl's, and the canonical
// names of status codes. The conversion to grpc::Status belongs to the service edge
// (rpc/grpc_status.h).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/kernels/attention.h"

#define ATTN_STATUS_CONCAT_INNER(a, b) a##b
#define ATTN_STATUS_CONCAT(a, b) ATTN_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function when expr yields a non-OK absl::Status.
#define RETURN_IF_ERROR(expr)                         \
  do {                                                \
    if (absl::Status _st = (expr); !_st.ok()) return _st; \
  } while (0)

// lhs = value of a StatusOr expression, or return its status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(ATTN_STATUS_CONCAT(_status_or_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(*tmp)

namespace attn {

absl::Status FromKernelStatus(const kernels::Status& st);
// Name of a canonical code as gRPC, Prometheus labels and logs spell it: "OK",
// "INVALID_ARGUMENT", ... (absl and gRPC share the codes).
const char* StatusCodeName(absl::StatusCode code);

}  // namespace attn
