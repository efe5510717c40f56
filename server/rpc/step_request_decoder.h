// Decodes StepRequest and BatchStepRequest from the slices gRPC received them in without copying
// their tensors' bytes: q.data, k_new.data and v_new.data come out as pieces of those slices
// (WireTensors' q, k and v), and every other field of a step (small: session id, layer, shapes,
// dtypes, options, regions) is re-encoded as it came and parsed by protobuf itself, in one parse
// per step. The result is what protobuf's own parser would give (fields in any order, repeated or
// split across slices, unknown fields skipped, the last data field of a tensor winning), except
// that the tensors' data fields stay empty. Malformed input gets INVALID_ARGUMENT naming the
// field and the byte it went wrong at.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "attn/v1/attention.pb.h"
#include "engine/wire_tensors.h"

namespace attn {

struct DecodedStepRequest {
  v1::StepRequest header;  // everything but the data fields of q, k_new and v_new
  WireTensors data;        // those (as q, k and v), as pieces of the input (borrowed)
};

// pieces: the message's bytes, in order (any split, empty pieces allowed). out must be fresh.
absl::Status DecodeStepRequest(std::span<const std::string_view> pieces, DecodedStepRequest* out);

// A BatchStepRequest: one DecodedStepRequest per item of steps, in order, appended to out.
absl::Status DecodeBatchStepRequest(std::span<const std::string_view> pieces,
                                    std::vector<DecodedStepRequest>* out);

}  // namespace attn
