#include "rpc/attend_response_encoder.h"

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

// gRPC frees a slice's bytes on whichever thread drops the last reference to it.
void FreeBytes(void* p) {
  TakeBackFromGrpc(p);
  delete[] static_cast<char*>(p);
}

// A message being written as slices: runs of small fields (copied) between output buffers
// (owned by their slices from then on).
class SliceWriter {
 public:
  std::string& head() { return head_; }
  // Ends the current run and adds a slice that owns bytes.
  void Own(OutputBytes bytes) {
    slices_.emplace_back(head_);  // a copy of the few header bytes
    head_.clear();
    // The slice owns the buffer from here: gRPC calls FreeBytes when it drops its last reference.
    const size_t size = bytes.size;
    char* data = bytes.data.release();
    HandOffToGrpc(data);
    slices_.emplace_back(data, size, &FreeBytes);
  }
  grpc::ByteBuffer Finish() {
    if (!head_.empty()) slices_.emplace_back(head_);
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  std::string head_;
  std::vector<grpc::Slice> slices_;
};

// An output tensor (field `number` of its message) with its data in a buffer of its own (or
// none: a tensor without data, or one in a region).
struct TensorPart {
  uint32_t number;
  std::string fields;  // dtype, shape, region: data is empty in the header
  OutputBytes bytes;

  static constexpr uint32_t kDataTag = MakeTag(v1::Tensor::kDataFieldNumber, kLengthDelimited);

  bool HasData() const { return bytes.data != nullptr && bytes.size > 0; }
  size_t Body() const {
    // No data: protobuf writes no empty field.
    return fields.size() +
           (HasData() ? VarintSize(kDataTag) + VarintSize(bytes.size) + bytes.size : 0);
  }
  // Bytes of the whole field, tag to end.
  size_t Size() const {
    return VarintSize(MakeTag(number, kLengthDelimited)) + VarintSize(Body()) + Body();
  }
  void Write(SliceWriter& w) {
    std::string& head = w.head();
    AppendVarint(MakeTag(number, kLengthDelimited), &head);
    AppendVarint(Body(), &head);
    head.append(fields);
    if (!HasData()) return;
    AppendVarint(kDataTag, &head);
    AppendVarint(bytes.size, &head);
    w.Own(std::move(bytes));
  }
};

// A response whose o and lse (fields 1 and 2, as in AttendResponse and StepResponse) carry their
// data in buffers: the parts in field order, the other fields (all numbered after them) in rest.
template <typename Response>
struct ResponseParts {
  std::vector<TensorPart> tensors;
  std::string rest;

  ResponseParts(const Response& header, OutputBytes o, OutputBytes lse) {
    if (header.has_o()) {
      tensors.push_back({Response::kOFieldNumber, header.o().SerializeAsString(), std::move(o)});
    }
    if (header.has_lse()) {
      tensors.push_back(
          {Response::kLseFieldNumber, header.lse().SerializeAsString(), std::move(lse)});
    }
    Response others = header;
    others.clear_o();
    others.clear_lse();
    others.AppendToString(&rest);
  }
  size_t Size() const {
    size_t n = rest.size();
    for (const TensorPart& t : tensors) n += t.Size();
    return n;
  }
  void Write(SliceWriter& w) {
    for (TensorPart& t : tensors) t.Write(w);
    w.head().append(rest);
  }
};

}  // namespace

grpc::ByteBuffer EncodeAttendResponse(const v1::AttendResponse& header, OutputBytes o,
                                      OutputBytes lse) {
  SliceWriter w;
  ResponseParts<v1::AttendResponse>(header, std::move(o), std::move(lse)).Write(w);
  return w.Finish();
}

grpc::ByteBuffer EncodeStepResponse(const v1::StepResponse& header, OutputBytes o,
                                    OutputBytes lse) {
  SliceWriter w;
  ResponseParts<v1::StepResponse>(header, std::move(o), std::move(lse)).Write(w);
  return w.Finish();
}

grpc::ByteBuffer EncodeBatchStepResponse(std::span<EncodedStepResult> results) {
  SliceWriter w;
  constexpr uint32_t kResultTag =
      MakeTag(v1::BatchStepResponse::kResultsFieldNumber, kLengthDelimited);
  constexpr uint32_t kResponseTag = MakeTag(v1::StepResult::kResponseFieldNumber, kLengthDelimited);
  for (EncodedStepResult& r : results) {
    // status_code and status_message come before response (field 3), as protobuf writes them.
    v1::StepResult status;
    status.set_status_code(r.status_code);
    status.set_status_message(r.status_message);
    const std::string status_fields = status.SerializeAsString();
    std::optional<ResponseParts<v1::StepResponse>> parts;
    size_t body = status_fields.size();
    if (r.response != nullptr) {
      parts.emplace(*r.response, std::move(r.o), std::move(r.lse));
      const size_t n = parts->Size();
      body += VarintSize(kResponseTag) + VarintSize(n) + n;
    }
    std::string& head = w.head();
    AppendVarint(kResultTag, &head);
    AppendVarint(body, &head);
    head.append(status_fields);
    if (!parts) continue;
    AppendVarint(kResponseTag, &head);
    AppendVarint(parts->Size(), &head);
    parts->Write(w);
  }
  return w.Finish();
}

}  // namespace attn
