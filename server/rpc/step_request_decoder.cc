#include "rpc/step_request_decoder.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "attn/util/wire_fields.h"
#include "common/status_util.h"
#include "attn/util/wire_reader.h"

namespace attn {
namespace {

using wire::AppendVarint;
using wire::kLengthDelimited;
using wire::Tag;

absl::Status Malformed(absl::string_view message, absl::string_view field, absl::string_view what,
                       uint64_t at) {
  return absl::InvalidArgumentError(absl::StrCat(message, " is malformed: ", field, ": ", what,
                                                 " (at byte ", at, " of the message)"));
}

// The name of StepRequest's field `number` for messages, after prefix ("steps[3]." in a batch).
std::string StepFieldName(absl::string_view prefix, uint64_t number) {
  static constexpr const char* kNames[] = {nullptr,  "session_id",    "layer",      "q",
                                           "k_new",  "v_new",         "softmax_scale",
                                           "return_lse", "window"};
  if (number < std::size(kNames) && kNames[number] != nullptr) {
    return absl::StrCat(prefix, kNames[number]);
  }
  if (number == v1::StepRequest::kORegionFieldNumber) return absl::StrCat(prefix, "o_region");
  if (number == v1::StepRequest::kLseRegionFieldNumber) return absl::StrCat(prefix, "lse_region");
  return absl::StrCat(prefix, "field ", number);
}

std::string TensorFieldName(absl::string_view tensor, uint64_t number) {
  static constexpr const char* kNames[] = {nullptr, "dtype", "shape", "data", "region"};
  if (number < std::size(kNames) && kNames[number] != nullptr) {
    return absl::StrCat(tensor, ".", kNames[number]);
  }
  return absl::StrCat(tensor, ".field ", number);
}

// Reads a tag; field names what is being read, for messages.
absl::Status ReadTag(WireReader& r, absl::string_view message, absl::string_view field, Tag* tag) {
  const uint64_t at = r.position();
  std::string error;
  if (!wire::ReadTag(r, tag, &error)) return Malformed(message, field, error, at);
  return absl::OkStatus();
}

// The length of the length-delimited field whose tag was just read, checked to fit.
absl::Status ReadLength(WireReader& r, absl::string_view message, absl::string_view field,
                        uint64_t at, uint64_t* n) {
  if (!r.ReadVarint(n)) return Malformed(message, field, "truncated or over-long length", at);
  if (*n > r.remaining()) {
    return Malformed(message, field,
                     absl::StrCat("length ", *n, " runs past the end of its message (",
                                  r.remaining(), " bytes left)"),
                     at);
  }
  return absl::OkStatus();
}

// Appends the field whose tag was just read to out (null: checked and skipped).
absl::Status CopyField(WireReader& r, const Tag& tag, absl::string_view message,
                       absl::string_view field, uint64_t at, std::string* out) {
  std::string error;
  if (!wire::CopyField(r, tag, out, &error)) return Malformed(message, field, error, at);
  return absl::OkStatus();
}

// The body of one occurrence of q, k_new or v_new (the reader limited to it): its data field's
// pieces into data (a later one replaces an earlier one), every other field into fields.
absl::Status DecodeTensor(WireReader& r, absl::string_view message, const std::string& name,
                          std::string* fields, WireBytes* data) {
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, message, name, &tag));
    const std::string field = TensorFieldName(name, tag.number);
    if (tag.number == v1::Tensor::kDataFieldNumber && tag.type == kLengthDelimited) {
      uint64_t n;
      RETURN_IF_ERROR(ReadLength(r, message, field, at, &n));
      data->pieces.clear();
      data->size = n;
      r.ReadPieces(n, &data->pieces);
      continue;
    }
    RETURN_IF_ERROR(CopyField(r, tag, message, field, at, fields));
  }
  return absl::OkStatus();
}

// Where a field starts in the re-encoded bytes, to name it should protobuf refuse them.
struct FieldAt {
  size_t offset;
  std::string name;
  uint64_t at;
};

// One step's fields (the reader limited to them). prefix names the step in messages.
absl::Status DecodeStep(WireReader& r, absl::string_view message, absl::string_view prefix,
                        DecodedStepRequest* out) {
  // The step as a whole in messages: "StepRequest", or "steps[3]" in a batch.
  const std::string step =
      prefix.empty() ? std::string(message) : std::string(prefix.substr(0, prefix.size() - 1));
  std::string head, tensor_fields;
  std::vector<FieldAt> fields;
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, message, step, &tag));
    const std::string field = StepFieldName(prefix, tag.number);
    fields.push_back({head.size(), field, at});
    // q, k_new or v_new with another wire type is an unknown field to protobuf: copied as is.
    WireBytes* data = nullptr;
    if (tag.type == kLengthDelimited) {
      switch (tag.number) {
        case v1::StepRequest::kQFieldNumber: data = &out->data.q; break;
        case v1::StepRequest::kKNewFieldNumber: data = &out->data.k; break;
        case v1::StepRequest::kVNewFieldNumber: data = &out->data.v; break;
        default: break;
      }
    }
    if (data == nullptr) {
      RETURN_IF_ERROR(CopyField(r, tag, message, field, at, &head));
      continue;
    }
    uint64_t n, outer = 0;  // ReadLength checked n: PushLimit succeeds
    RETURN_IF_ERROR(ReadLength(r, message, field, at, &n));
    r.PushLimit(n, &outer);
    tensor_fields.clear();
    RETURN_IF_ERROR(DecodeTensor(r, message, field, &tensor_fields, data));
    r.PopLimit(outer);
    // The tensor without its data: protobuf merges it into the step as it would the original.
    AppendVarint(tag.number << 3 | kLengthDelimited, &head);
    AppendVarint(tensor_fields.size(), &head);
    head.append(tensor_fields);
  }
  if (out->header.MergeFromString(head)) return absl::OkStatus();
  // Refused (a bad embedded message, or a string that is not UTF-8): find the field, alone.
  for (size_t i = 0; i < fields.size(); ++i) {
    const size_t end = i + 1 < fields.size() ? fields[i + 1].offset : head.size();
    v1::StepRequest alone;
    if (!alone.MergeFromString(head.substr(fields[i].offset, end - fields[i].offset))) {
      return Malformed(message, fields[i].name,
                       "protobuf could not parse this field (a bad embedded message, or a string "
                       "that is not UTF-8)",
                       fields[i].at);
    }
  }
  return Malformed(message, step, "protobuf could not parse its fields together",
                   fields.empty() ? 0 : fields.front().at);
}

}  // namespace

absl::Status DecodeStepRequest(std::span<const std::string_view> pieces, DecodedStepRequest* out) {
  WireReader r(pieces);
  return DecodeStep(r, "StepRequest", "", out);
}

absl::Status DecodeBatchStepRequest(std::span<const std::string_view> pieces,
                                    std::vector<DecodedStepRequest>* out) {
  constexpr absl::string_view kMessage = "BatchStepRequest";
  WireReader r(pieces);
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, kMessage, kMessage, &tag));
    if (tag.number != v1::BatchStepRequest::kStepsFieldNumber || tag.type != kLengthDelimited) {
      // Unknown to BatchStepRequest (or steps with another wire type): checked and skipped.
      RETURN_IF_ERROR(CopyField(r, tag, kMessage, absl::StrCat("field ", tag.number), at,
                                nullptr));
      continue;
    }
    const std::string name = absl::StrCat("steps[", out->size(), "]");
    uint64_t n, outer = 0;
    RETURN_IF_ERROR(ReadLength(r, kMessage, name, at, &n));
    r.PushLimit(n, &outer);
    RETURN_IF_ERROR(DecodeStep(r, kMessage, name + ".", &out->emplace_back()));
    r.PopLimit(outer);
  }
  return absl::OkStatus();
}

}  // namespace attn
