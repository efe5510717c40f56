#include "rpc/step_request_decoder.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "attn/util/wire_fields.h"
#include "common/status_util.h"
#include "attn/util/wire_reader.h"

namespace attn {
namespace {

using wire::AppendVarint;
using wire::kLengthDelimited;
using wire::Tag;

// A field of a step, named only when a message needs it (names cost an allocation each).
struct Field {
  absl::string_view step;   // "StepRequest", or "steps[3]" in a batch
  uint64_t number = 0;      // StepRequest's field; 0: the step itself
  uint64_t tensor = 0;      // the tensor's field, when number is q, k_new or v_new; 0: none

  std::string Name() const {
    if (number == 0) return std::string(step);
    static constexpr const char* kStep[] = {nullptr, "session_id", "layer",      "q",
                                            "k_new", "v_new",      "softmax_scale",
                                            "return_lse", "window"};
    static constexpr const char* kTensor[] = {nullptr, "dtype", "shape", "data", "region"};
    // Inside a batch the step's name prefixes the field's ("steps[3].q").
    const std::string prefix = absl::StartsWith(step, "steps[") ? absl::StrCat(step, ".") : "";
    std::string name;
    if (number < std::size(kStep) && kStep[number] != nullptr) {
      name = absl::StrCat(prefix, kStep[number]);
    } else if (number == v1::StepRequest::kORegionFieldNumber) {
      name = absl::StrCat(prefix, "o_region");
    } else if (number == v1::StepRequest::kLseRegionFieldNumber) {
      name = absl::StrCat(prefix, "lse_region");
    } else {
      name = absl::StrCat(prefix, "field ", number);
    }
    if (tensor == 0) return name;
    if (tensor < std::size(kTensor) && kTensor[tensor] != nullptr) {
      return absl::StrCat(name, ".", kTensor[tensor]);
    }
    return absl::StrCat(name, ".field ", tensor);
  }
};

absl::Status Malformed(absl::string_view message, const std::string& field, absl::string_view what,
                       uint64_t at) {
  return absl::InvalidArgumentError(absl::StrCat(message, " is malformed: ", field, ": ", what,
                                                 " (at byte ", at, " of the message)"));
}

// Reads a tag; field names what is being read, for messages.
absl::Status ReadTag(WireReader& r, absl::string_view message, const Field& field, Tag* tag) {
  const uint64_t at = r.position();
  std::string error;
  if (!wire::ReadTag(r, tag, &error)) return Malformed(message, field.Name(), error, at);
  return absl::OkStatus();
}

// The length of the length-delimited field whose tag was just read, checked to fit.
absl::Status ReadLength(WireReader& r, absl::string_view message, const Field& field,
                        uint64_t at, uint64_t* n) {
  if (!r.ReadVarint(n)) return Malformed(message, field.Name(), "truncated or over-long length", at);
  if (*n > r.remaining()) {
    return Malformed(message, field.Name(),
                     absl::StrCat("length ", *n, " runs past the end of its message (",
                                  r.remaining(), " bytes left)"),
                     at);
  }
  return absl::OkStatus();
}

// Appends the field whose tag was just read to out (null: checked and skipped).
absl::Status CopyField(WireReader& r, const Tag& tag, absl::string_view message,
                       const Field& field, uint64_t at, std::string* out) {
  std::string error;
  if (!wire::CopyField(r, tag, out, &error)) return Malformed(message, field.Name(), error, at);
  return absl::OkStatus();
}

// The body of one occurrence of q, k_new or v_new (the reader limited to it): its data field's
// pieces into data (a later one replaces an earlier one), every other field into fields.
absl::Status DecodeTensor(WireReader& r, absl::string_view message, const Field& tensor,
                          std::string* fields, WireBytes* data) {
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, message, tensor, &tag));
    const Field field{tensor.step, tensor.number, tag.number};
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
  uint64_t number;
  uint64_t at;
};

// What decoding a step writes besides its result, reused from step to step of a batch.
struct Scratch {
  std::string head;           // the step's fields, tensors without their data
  std::string tensor_fields;  // one tensor's fields but data
  std::vector<FieldAt> fields;
};

// One step's fields (the reader limited to them); step names it in messages ("StepRequest", or
// "steps[3]" in a batch).
absl::Status DecodeStep(WireReader& r, absl::string_view message, absl::string_view step,
                        Scratch& scratch, DecodedStepRequest* out) {
  std::string& head = scratch.head;
  std::string& tensor_fields = scratch.tensor_fields;
  std::vector<FieldAt>& fields = scratch.fields;
  head.clear();
  fields.clear();
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, message, Field{step}, &tag));
    const Field field{step, tag.number};
    fields.push_back({head.size(), tag.number, at});
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
  if (out->header().MergeFromString(head)) return absl::OkStatus();
  // Refused (a bad embedded message, or a string that is not UTF-8): find the field, alone.
  for (size_t i = 0; i < fields.size(); ++i) {
    const size_t end = i + 1 < fields.size() ? fields[i + 1].offset : head.size();
    v1::StepRequest alone;
    if (!alone.MergeFromString(head.substr(fields[i].offset, end - fields[i].offset))) {
      return Malformed(message, Field{step, fields[i].number}.Name(),
                       "protobuf could not parse this field (a bad embedded message, or a string "
                       "that is not UTF-8)",
                       fields[i].at);
    }
  }
  return Malformed(message, std::string(step), "protobuf could not parse its fields together",
                   fields.empty() ? 0 : fields.front().at);
}

}  // namespace

absl::Status DecodeStepRequest(std::span<const std::string_view> pieces, DecodedStepRequest* out) {
  WireReader r(pieces);
  Scratch scratch;
  return DecodeStep(r, "StepRequest", "StepRequest", scratch, out);
}

absl::Status DecodeBatchStepRequest(std::span<const std::string_view> pieces,
                                    std::vector<DecodedStepRequest>* out,
                                    google::protobuf::Arena* arena) {
  constexpr absl::string_view kMessage = "BatchStepRequest";
  WireReader r(pieces);
  Scratch scratch;
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, kMessage, Field{kMessage}, &tag));
    if (tag.number != v1::BatchStepRequest::kStepsFieldNumber || tag.type != kLengthDelimited) {
      // Unknown to BatchStepRequest (or steps with another wire type): checked and skipped.
      std::string error;
      if (!wire::CopyField(r, tag, nullptr, &error)) {
        return Malformed(kMessage, absl::StrCat("field ", tag.number), error, at);
      }
      continue;
    }
    // Only its name in messages: built for every step, it is short enough to stay inline.
    char name[32];
    const int len = std::snprintf(name, sizeof name, "steps[%zu]", out->size());
    const absl::string_view step(name, static_cast<size_t>(len));
    uint64_t n, outer = 0;
    RETURN_IF_ERROR(ReadLength(r, kMessage, Field{step}, at, &n));
    r.PushLimit(n, &outer);
    RETURN_IF_ERROR(DecodeStep(r, kMessage, step, scratch, &out->emplace_back(arena)));
    r.PopLimit(outer);
  }
  return absl::OkStatus();
}

}  // namespace attn
