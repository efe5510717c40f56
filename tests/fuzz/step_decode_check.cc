#include "step_decode_check.h"

#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"

#include "attn/v1/attention.pb.h"
#include "fuzz_env.h"
#include "rpc/step_request_decoder.h"

namespace attn::fuzz {
namespace {

// want (protobuf's step, data cleared here) against the decoder's.
std::string CompareStep(v1::StepRequest want, const DecodedStepRequest& got, size_t index) {
  const std::pair<v1::Tensor*, const WireBytes*> tensors[] = {
      {want.has_q() ? want.mutable_q() : nullptr, &got.data.q},
      {want.has_k_new() ? want.mutable_k_new() : nullptr, &got.data.k},
      {want.has_v_new() ? want.mutable_v_new() : nullptr, &got.data.v}};
  for (const auto& [t, wire] : tensors) {
    std::string joined;
    for (std::string_view p : wire->pieces) joined.append(p);
    if (joined.size() != wire->size) return absl::StrCat("step ", index, ": pieces do not add up");
    if (joined != (t != nullptr ? t->data() : "")) {
      return absl::StrCat("step ", index, ": a tensor's data differs from protobuf's");
    }
    if (t != nullptr) t->clear_data();
  }
  // Bit for bit (floats as bits, NaNs included): serialized, unknown fields and all.
  if (got.header().SerializeAsString() != want.SerializeAsString()) {
    return absl::StrCat("step ", index, ": header differs from protobuf's: decoder ",
                        got.header().ShortDebugString(), " protobuf ", want.ShortDebugString());
  }
  return "";
}

}  // namespace

std::string CheckStepDecoder(const uint8_t* data, size_t size, bool batch) {
  const std::vector<std::string_view> pieces = PiecesOf(data, size);
  const char* message = batch ? "BatchStepRequest" : "StepRequest";
  v1::BatchStepRequest want;
  bool parsed;
  std::vector<DecodedStepRequest> got;
  google::protobuf::Arena arena;
  absl::Status st;
  if (batch) {
    parsed = want.ParseFromArray(data, static_cast<int>(size));
    st = DecodeBatchStepRequest(pieces, &got, size % 2 ? &arena : nullptr);
  } else {
    parsed = want.add_steps()->ParseFromArray(data, static_cast<int>(size));
    st = DecodeStepRequest(pieces, &got.emplace_back());
  }
  if (!st.ok()) {
    if (st.code() != absl::StatusCode::kInvalidArgument ||
        st.message().find(absl::StrCat(message, " is malformed: ")) != 0) {
      return absl::StrCat("step decoder refused with an unexpected status: ", st.ToString());
    }
    return parsed ? absl::StrCat("step decoder refused what protobuf parses: ", st.ToString())
                  : "";
  }
  if (!parsed) return absl::StrCat("step decoder accepted a ", message, " protobuf refuses");
  if (got.size() != static_cast<size_t>(want.steps_size())) {
    return absl::StrCat("step decoder found ", got.size(), " steps, protobuf ", want.steps_size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    std::string diff = CompareStep(want.steps(static_cast<int>(i)), got[i], i);
    if (!diff.empty()) return diff;
  }
  return "";
}

}  // namespace attn::fuzz
