#include "rpc/attend_request_decoder.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "attn/util/wire_fields.h"
#include "attn/util/wire_reader.h"

namespace attn {
namespace {

using wire::kFixed32;
using wire::kLengthDelimited;
using wire::Tag;

// The names of AttendRequest's and Tensor's fields, for messages.
std::string RequestFieldName(uint64_t number) {
  static constexpr const char* kNames[] = {
      nullptr,        "q",             "k",      "v",          "cu_seqlens_q",
      "cu_seqlens_k", "causal",        "softmax_scale", "window", "return_lse",
      "priority",     "request_id",    "o_region", "lse_region"};
  if (number < std::size(kNames) && kNames[number] != nullptr) return kNames[number];
  return absl::StrCat("field ", number);
}

std::string TensorFieldName(const std::string& tensor, uint64_t number) {
  static constexpr const char* kNames[] = {nullptr, "dtype", "shape", "data", "region"};
  if (number < std::size(kNames) && kNames[number] != nullptr) {
    return absl::StrCat(tensor, ".", kNames[number]);
  }
  return absl::StrCat(tensor, ".field ", number);
}

absl::Status Malformed(const std::string& field, const std::string& what, uint64_t at) {
  return absl::InvalidArgumentError(absl::StrCat("AttendRequest is malformed: ", field, ": ", what,
                                                 " (at byte ", at, " of the message)"));
}

// Reads a tag (its wire type is checked by CheckWireType); where names the message in errors.
absl::Status ReadTag(WireReader& r, const std::string& where, Tag* tag) {
  const uint64_t at = r.position();
  uint64_t raw;
  if (!r.ReadVarint(&raw)) return Malformed(where, "truncated or over-long field tag", at);
  // Tags are 32 bits: protobuf's parser drops any higher bits of the varint, and so does this.
  tag->number = (raw & 0xffffffffu) >> 3;
  tag->type = static_cast<uint32_t>(raw & 7);
  if (tag->number == 0) {
    return Malformed(where, absl::StrCat("field number ", tag->number, " out of range"), at);
  }
  return absl::OkStatus();
}

// Wire types 6 and 7 do not exist; field names the field whose tag carries one.
absl::Status CheckWireType(const Tag& tag, const std::string& field, uint64_t at) {
  if (tag.type <= kFixed32) return absl::OkStatus();
  return Malformed(field, absl::StrCat("unknown wire type ", tag.type), at);
}

// Appends the field whose tag was just read, encoded as on the wire, to out.
absl::Status CopyField(WireReader& r, const Tag& tag, const std::string& field, std::string* out) {
  const uint64_t at = r.position();
  std::string error;
  if (!wire::CopyField(r, tag, out, &error)) return Malformed(field, error, at);
  return absl::OkStatus();
}

// Merges one field (already in wire form) into message, as protobuf's parser would.
absl::Status MergeField(const std::string& bytes, const std::string& field, uint64_t at,
                        google::protobuf::Message* message) {
  if (!message->MergeFromString(bytes)) {
    return Malformed(field, "protobuf could not parse this field (a bad embedded message, or a "
                            "string that is not UTF-8)", at);
  }
  return absl::OkStatus();
}

// The body of one occurrence of q, k or v (the reader limited to it).
absl::Status DecodeTensor(WireReader& r, const std::string& name, v1::Tensor* tensor,
                          WireBytes* data) {
  std::string field_bytes;
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, name, &tag));
    const std::string field = TensorFieldName(name, tag.number);
    RETURN_IF_ERROR(CheckWireType(tag, field, at));
    if (tag.number == v1::Tensor::kDataFieldNumber && tag.type == kLengthDelimited) {
      uint64_t n;
      if (!r.ReadVarint(&n)) return Malformed(field, "truncated or over-long length", at);
      data->pieces.clear();  // a later data field replaces an earlier one
      data->size = n;
      if (!r.ReadPieces(n, &data->pieces)) {
        return Malformed(field, absl::StrCat("length ", n, " runs past the end of ", name, " (",
                                             r.remaining(), " bytes left)"), at);
      }
      continue;
    }
    field_bytes.clear();
    RETURN_IF_ERROR(CopyField(r, tag, field, &field_bytes));
    RETURN_IF_ERROR(MergeField(field_bytes, field, at, tensor));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeAttendRequest(std::span<const std::string_view> pieces,
                                 DecodedAttendRequest* out) {
  WireReader r(pieces);
  std::string field_bytes;
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    Tag tag;
    RETURN_IF_ERROR(ReadTag(r, "AttendRequest", &tag));
    const std::string field = RequestFieldName(tag.number);
    RETURN_IF_ERROR(CheckWireType(tag, field, at));
    // q, k or v with another wire type is an unknown field to protobuf: left to MergeField.
    v1::Tensor* tensor = nullptr;
    WireBytes* data = nullptr;
    if (tag.type == kLengthDelimited) {
      switch (tag.number) {
        case v1::AttendRequest::kQFieldNumber:
          tensor = out->header.mutable_q();
          data = &out->data.q;
          break;
        case v1::AttendRequest::kKFieldNumber:
          tensor = out->header.mutable_k();
          data = &out->data.k;
          break;
        case v1::AttendRequest::kVFieldNumber:
          tensor = out->header.mutable_v();
          data = &out->data.v;
          break;
        default:
          break;
      }
    }
    if (tensor != nullptr) {
      uint64_t n, outer;
      if (!r.ReadVarint(&n)) return Malformed(field, "truncated or over-long length", at);
      if (!r.PushLimit(n, &outer)) {
        return Malformed(field, absl::StrCat("length ", n, " runs past the end of the message (",
                                             r.remaining(), " bytes left)"), at);
      }
      RETURN_IF_ERROR(DecodeTensor(r, field, tensor, data));
      r.PopLimit(outer);
      continue;
    }
    // Every other field.
    field_bytes.clear();
    RETURN_IF_ERROR(CopyField(r, tag, field, &field_bytes));
    RETURN_IF_ERROR(MergeField(field_bytes, field, at, &out->header));
  }
  return absl::OkStatus();
}

}  // namespace attn
