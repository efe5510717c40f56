// absl::Status to grpc::Status and back, at the service edge (absl and gRPC share the canonical
// code numbers).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attn {

grpc::Status ToGrpcStatus(const absl::Status& st);
absl::Status FromGrpcStatus(const grpc::Status& st);

}  // namespace attn
