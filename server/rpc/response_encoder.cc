#include "rpc/response_encoder.h"

#include <optional>
#include <string>
#include <vector>

#include <grpcpp/support/slice.h>

#include "attn/util/wire_fields.h"
#include "common/tsan_annotations.h"

namespace attn {
namespace {

using wire::AppendVarint;
using wire::kLengthDelimited;
using wire::MakeTag;
using wire::VarintSize;

// gRPC releases a slice on whichever thread drops the last reference to it: the output's owner
// goes with it (a pinned buffer back to its pool, say).
void ReleaseOwner(void* holder) {
  TakeBackFromGrpc(holder);
  delete static_cast<std::shared_ptr<const void>*>(holder);
}

// A message being written as slices: its small fields in one string (copied once into a slice
// that runs of it are cut from) between output buffers (owned by their slices from then on).
class SliceWriter {
 public:
  std::string& head() { return head_; }
  // Ends the current run of head and adds bytes after it.
  void Own(OutputBytes bytes) {
    cuts_.push_back(head_.size());
    owned_.push_back(std::move(bytes));
  }
  grpc::ByteBuffer Finish() {
    const grpc::Slice all(head_);
    std::vector<grpc::Slice> slices;
    slices.reserve(2 * owned_.size() + 1);
    size_t at = 0;
    for (size_t i = 0; i < owned_.size(); ++i) {
      if (cuts_[i] > at) slices.push_back(all.sub(at, cuts_[i]));
      at = cuts_[i];
      // The slice holds the output's owner from here: gRPC calls ReleaseOwner when it drops its
      // last reference.
      auto* holder = new std::shared_ptr<const void>(std::move(owned_[i].owner));
      HandOffToGrpc(holder);
      slices.emplace_back(owned_[i].data, owned_[i].size, &ReleaseOwner, holder);
    }
    if (at < head_.size()) slices.push_back(all.sub(at, head_.size()));
    return grpc::ByteBuffer(slices.data(), slices.size());
  }

 private:
  std::string head_;
  std::vector<size_t> cuts_;         // owned_[i] follows head_'s bytes before cuts_[i]
  std::vector<OutputBytes> owned_;
};

constexpr uint32_t kDataTag = MakeTag(v1::Tensor::kDataFieldNumber, kLengthDelimited);

// Bytes the data field of an output adds to its tensor's body (none without data: protobuf
// writes no empty field).
size_t DataFieldSize(const OutputBytes& b) {
  return b.size > 0 ? VarintSize(kDataTag) + VarintSize(b.size) + b.size : 0;
}

// A response whose o and lse (fields 1 and 2, as in AttendResponse and StepResponse) carry their
// data in buffers, with header's other fields serialized once by protobuf: o and lse, numbered
// first, come first in those bytes, each followed by its data field here.
struct ResponseParts {
  std::string fields;   // header serialized (o and lse without data)
  size_t o_end = 0;     // o's field in fields ends here (0: none)...
  size_t lse_end = 0;   // ...and lse's
  OutputBytes o, lse;

  template <typename Response>
  ResponseParts(const Response& header, OutputBytes o_bytes, OutputBytes lse_bytes)
      : fields(header.SerializeAsString()), o(std::move(o_bytes)), lse(std::move(lse_bytes)) {
    size_t at = 0;
    if (header.has_o()) at = o_end = FieldEnd(at);
    if (header.has_lse()) lse_end = FieldEnd(at);
  }
  size_t Size() const {
    size_t n = fields.size();
    if (o_end > 0) n += Grown(0, o_end, o) - o_end;
    if (lse_end > 0) n += Grown(o_end, lse_end, lse) - (lse_end - o_end);
    return n;
  }
  void Write(SliceWriter& w) {
    size_t at = 0;
    if (o_end > 0) at = WriteTensor(w, at, o_end, std::move(o));
    if (lse_end > 0) at = WriteTensor(w, at, lse_end, std::move(lse));
    w.head().append(fields, at, std::string::npos);
  }

 private:
  // Where the length-delimited field (one-byte tag) starting at `at` ends; its body length is
  // the varint after the tag.
  size_t FieldEnd(size_t at) const {
    size_t len = 0, shift = 0, i = at + 1;
    for (;; ++i, shift += 7) {
      const uint8_t b = static_cast<uint8_t>(fields[i]);
      len |= size_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) break;
    }
    return i + 1 + len;
  }
  // The field [begin, end) of fields (tag, length, body) and its body's length.
  size_t BodyOf(size_t begin, size_t end) const {
    size_t i = begin + 1;
    while (static_cast<uint8_t>(fields[i]) & 0x80) ++i;
    return end - (i + 1);
  }
  // The field's size once its data field is added.
  size_t Grown(size_t begin, size_t end, const OutputBytes& b) const {
    const size_t body = BodyOf(begin, end) + DataFieldSize(b);
    return 1 + VarintSize(body) + body;
  }
  size_t WriteTensor(SliceWriter& w, size_t begin, size_t end, OutputBytes b) {
    std::string& head = w.head();
    const size_t body = BodyOf(begin, end);
    head.push_back(fields[begin]);  // the tag
    AppendVarint(body + DataFieldSize(b), &head);
    head.append(fields, end - body, body);
    if (b.size > 0) {
      AppendVarint(kDataTag, &head);
      AppendVarint(b.size, &head);
      w.Own(std::move(b));
    }
    return end;
  }
};

}  // namespace

grpc::ByteBuffer EncodeAttendResponse(const v1::AttendResponse& header, OutputBytes o,
                                      OutputBytes lse) {
  SliceWriter w;
  ResponseParts(header, std::move(o), std::move(lse)).Write(w);
  return w.Finish();
}

grpc::ByteBuffer EncodeStepResponse(const v1::StepResponse& header, OutputBytes o,
                                    OutputBytes lse) {
  SliceWriter w;
  ResponseParts(header, std::move(o), std::move(lse)).Write(w);
  return w.Finish();
}

grpc::ByteBuffer EncodeBatchStepResponse(std::span<EncodedStepResult> results) {
  SliceWriter w;
  constexpr uint32_t kResultTag =
      MakeTag(v1::BatchStepResponse::kResultsFieldNumber, kLengthDelimited);
  constexpr uint32_t kResponseTag = MakeTag(v1::StepResult::kResponseFieldNumber, kLengthDelimited);
  std::string status;
  for (EncodedStepResult& r : results) {
    // status_code and status_message come before response (field 3), as protobuf writes them;
    // fields at their default are left out.
    status.clear();
    if (r.status_code != 0) {
      AppendVarint(MakeTag(v1::StepResult::kStatusCodeFieldNumber, wire::kVarint), &status);
      AppendVarint(static_cast<uint64_t>(int64_t{r.status_code}), &status);  // int32: sign-extended
    }
    if (!r.status_message.empty()) {
      AppendVarint(MakeTag(v1::StepResult::kStatusMessageFieldNumber, kLengthDelimited), &status);
      AppendVarint(r.status_message.size(), &status);
      status.append(r.status_message);
    }
    std::optional<ResponseParts> parts;
    size_t body = status.size();
    if (r.response != nullptr) {
      parts.emplace(*r.response, std::move(r.o), std::move(r.lse));
      const size_t n = parts->Size();
      body += VarintSize(kResponseTag) + VarintSize(n) + n;
    }
    std::string& head = w.head();
    AppendVarint(kResultTag, &head);
    AppendVarint(body, &head);
    head.append(status);
    if (!parts) continue;
    AppendVarint(kResponseTag, &head);
    AppendVarint(parts->Size(), &head);
    parts->Write(w);
  }
  return w.Finish();
}

}  // namespace attn
