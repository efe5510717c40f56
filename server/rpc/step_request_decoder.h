// Decodes StepRequest and BatchStepRequest from the slices gRPC received them in without copying
// their tensors' bytes: q.data, k_new.data and v_new.data come out as pieces of those slices
// (WireTensors' q, k and v), and every other field of a step (small: session id, layer, shapes,
// dtypes, options, regions) is written straight into its header message as it is read. The
// result is what protobuf's own parser would give (fields in any order, repeated or split across
// slices, sub-messages merged, packed or unpacked repeated fields, unknown fields of every wire
// type kept as protobuf keeps them, the last data field of a tensor winning), except that the
// tensors' data fields stay empty; it refuses exactly what protobuf refuses (nesting, tag and
// length limits, strings that are not UTF-8). Malformed input gets INVALID_ARGUMENT naming the
// field and the byte it went wrong at.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/arena.h"
#include "attn/v1/attention.pb.h"
#include "engine/wire_tensors.h"

namespace attn {

class DecodedStepRequest {
 public:
  // The header on arena (then valid as long as the arena), or owned here when it is null: a
  // call's arena takes the many small allocations of a BatchStep's headers (sub-messages,
  // shapes) in a few blocks.
  explicit DecodedStepRequest(google::protobuf::Arena* arena = nullptr)
      : owned_(arena == nullptr ? std::make_unique<v1::StepRequest>() : nullptr),
        header_(arena == nullptr ? owned_.get()
                                 : google::protobuf::Arena::CreateMessage<v1::StepRequest>(arena)) {}

  // Everything but the data fields of q, k_new and v_new.
  v1::StepRequest& header() { return *header_; }
  const v1::StepRequest& header() const { return *header_; }
  WireTensors data;  // those (as q, k and v), as pieces of the input (borrowed)

 private:
  std::unique_ptr<v1::StepRequest> owned_;
  v1::StepRequest* header_;
};

// Options of the arena a Step/BatchStep call decodes its headers into: a BatchStep of 64 decode
// steps takes about 40 KiB of headers and responses, a few blocks.
inline google::protobuf::ArenaOptions StepCallArenaOptions() {
  google::protobuf::ArenaOptions o;
  o.start_block_size = size_t{16} << 10;
  o.max_block_size = size_t{256} << 10;
  return o;
}

// pieces: the message's bytes, in order (any split, empty pieces allowed). out must be fresh.
absl::Status DecodeStepRequest(std::span<const std::string_view> pieces, DecodedStepRequest* out);

// A BatchStepRequest: one DecodedStepRequest per item of steps, in order, appended to out, their
// headers on arena (null: each owns its own).
absl::Status DecodeBatchStepRequest(std::span<const std::string_view> pieces,
                                    std::vector<DecodedStepRequest>* out,
                                    google::protobuf::Arena* arena = nullptr);

}  // namespace attn
