// Decodes an AttendRequest from the slices gRPC received it in, without copying its tensors'
// bytes: q.data, k.data and v.data come out as pieces of those slices (WireTensors), and every
// other field (small: shapes, dtypes, flags, regions) is parsed by protobuf itself into a
// header message. The result is what protobuf's own parser would give (fields in any order,
// repeated or split across slices, packed or unpacked repeated ints, unknown fields skipped,
// the last data field of a tensor winning), except that header.q().data() etc. stay empty.
// Malformed input gets INVALID_ARGUMENT naming the field and the byte it went wrong at.
#pragma once

#include <span>
#include <string_view>

#include "absl/status/status.h"
#include "attn/v1/attention.pb.h"
#include "engine/wire_tensors.h"

namespace attn {

struct DecodedAttendRequest {
  v1::AttendRequest header;  // everything but the data fields of q, k and v
  WireTensors data;          // those, as pieces of the input (borrowed)
};

// pieces: the message's bytes, in order (any split, empty pieces allowed). out must be fresh.
absl::Status DecodeAttendRequest(std::span<const std::string_view> pieces,
                                 DecodedAttendRequest* out);

}  // namespace attn
