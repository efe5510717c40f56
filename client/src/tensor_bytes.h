// The byte size a wire tensor's shape and dtype call for, shared by both codings' response
// checks.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "attn/client/client.h"

namespace attn::client {

// product(shape) * DTypeBytes(dtype); INTERNAL naming `name` (e.g. "o") for a negative size or a
// product that overflows.
absl::StatusOr<uint64_t> WireTensorBytes(const std::string& name, const v1::Tensor& t, DType dtype);

}  // namespace attn::client
