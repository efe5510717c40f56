#include "rpc/echo_wire.h"

#include <algorithm>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "attn/util/wire_fields.h"
#include "attn/util/wire_reader.h"
#include "attn/v1/attention.pb.h"

namespace attn {
namespace {

absl::Status Malformed(const std::string& field, const std::string& what, uint64_t at) {
  return absl::InvalidArgumentError(absl::StrCat("EchoRequest is malformed: ", field, ": ", what,
                                                 " (at byte ", at, " of the message)"));
}

std::string FieldName(uint64_t number) {
  if (number == v1::EchoRequest::kPayloadFieldNumber) return "payload";
  if (number == v1::EchoRequest::kResponseBytesFieldNumber) return "response_bytes";
  return absl::StrCat("field ", number);
}

// The slice that p (a piece of the input) lies in, from *next on (pieces come in order), and p's
// offset there; false when none holds it.
bool FindSlice(std::span<const grpc::Slice> slices, std::string_view p, size_t* next,
               size_t* offset) {
  for (; *next < slices.size(); ++*next) {
    const auto* begin = reinterpret_cast<const char*>(slices[*next].begin());
    const auto* end = reinterpret_cast<const char*>(slices[*next].end());
    if (std::less_equal<>()(begin, p.data()) && std::less_equal<>()(p.data() + p.size(), end)) {
      *offset = static_cast<size_t>(p.data() - begin);
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Status DecodeEchoRequest(std::span<const std::string_view> pieces, DecodedEchoRequest* out) {
  WireReader r(pieces);
  v1::EchoRequest header;  // every field but payload, merged as protobuf does
  std::string field_bytes, error;
  while (!r.AtLimit()) {
    const uint64_t at = r.position();
    wire::Tag tag;
    if (!wire::ReadTag(r, &tag, &error)) return Malformed("EchoRequest", error, at);
    const std::string field = FieldName(tag.number);
    if (tag.number == v1::EchoRequest::kPayloadFieldNumber && tag.type == wire::kLengthDelimited) {
      uint64_t n;
      if (!r.ReadVarint(&n)) return Malformed(field, "truncated or over-long length", at);
      out->payload.clear();  // a later payload replaces an earlier one
      out->payload_size = n;
      if (!r.ReadPieces(n, &out->payload)) {
        return Malformed(field, absl::StrCat("length ", n, " runs past the end of the message (",
                                             r.remaining(), " bytes left)"), at);
      }
      continue;
    }
    field_bytes.clear();
    if (!wire::CopyField(r, tag, &field_bytes, &error)) return Malformed(field, error, at);
    if (!header.MergeFromString(field_bytes)) {
      return Malformed(field, "protobuf could not parse this field", at);
    }
  }
  out->response_bytes = header.response_bytes();
  return absl::OkStatus();
}

grpc::ByteBuffer EncodeEchoResponse(std::span<const grpc::Slice> slices,
                                    const DecodedEchoRequest& request) {
  const int64_t want = request.response_bytes;
  uint64_t left = want > 0 ? std::min(request.payload_size, static_cast<uint64_t>(want))
                           : request.payload_size;
  std::vector<grpc::Slice> out;
  if (left > 0) {  // protobuf writes no empty bytes field: an empty payload is an empty message
    std::string head;
    wire::AppendVarint(wire::MakeTag(v1::EchoResponse::kPayloadFieldNumber,
                                     wire::kLengthDelimited), &head);
    wire::AppendVarint(left, &head);
    out.emplace_back(head);
  }
  size_t next = 0;
  for (std::string_view p : request.payload) {
    if (left == 0) break;
    const size_t take = static_cast<size_t>(std::min<uint64_t>(left, p.size()));
    if (take == 0) continue;
    size_t offset = 0;
    if (FindSlice(slices, p, &next, &offset)) {
      out.push_back(slices[next].sub(offset, offset + take));  // a reference, not a copy
    } else {
      out.emplace_back(p.data(), take);  // pieces not of these slices: copied
    }
    left -= take;
  }
  // Zero slices still make a valid (empty) message, which gRPC sends.
  return grpc::ByteBuffer(out.data(), out.size());
}

}  // namespace attn
