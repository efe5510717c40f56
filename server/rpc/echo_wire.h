// Echo on the wire path: the request's payload is found in the slices gRPC received it in, and
// the answer is made of those same slices (references, not copies) behind a few bytes of header,
// so that Echo's cost is the transport's alone. The bytes are exactly protobuf's serialization of
// the EchoResponse, so the generated stub (or any client) reads them as usual.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"

namespace attn {

struct DecodedEchoRequest {
  std::vector<std::string_view> payload;  // pieces of the input (the last payload field's)
  uint64_t payload_size = 0;
  int64_t response_bytes = 0;
};

// Reads an EchoRequest from pieces as protobuf's parser would (fields in any order or repeated,
// unknown fields skipped); malformed bytes get INVALID_ARGUMENT naming the field and byte.
absl::Status DecodeEchoRequest(std::span<const std::string_view> pieces, DecodedEchoRequest* out);

// The EchoResponse for request, whose pieces lie in slices (in order): its payload cut down to
// response_bytes as Echo's contract says, as sub-slices of slices.
grpc::ByteBuffer EncodeEchoResponse(std::span<const grpc::Slice> slices,
                                    const DecodedEchoRequest& request);

}  // namespace attn
