#include "rpc/attend_response_encoder.h"

#include <string>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/slice.h>

#include "common/tsan_annotations.h"

namespace attn {
namespace {

using google::protobuf::io::CodedOutputStream;

constexpr uint32_t kLengthDelimited = 2;

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// gRPC frees a slice's bytes on whichever thread drops the last reference to it.
void FreeBytes(void* p) {
  TakeBackFromGrpc(p);
  delete[] static_cast<char*>(p);
}

// Appends tensor (field `number` of AttendResponse) to head; with bytes, ends head with the data
// field's tag and length, moves head into slices and adds a slice that owns the bytes.
void AppendTensor(int number, const v1::Tensor& tensor, OutputBytes bytes, std::string* head,
                  std::vector<grpc::Slice>* slices) {
  const std::string fields = tensor.SerializeAsString();  // dtype, shape, region: data is empty
  AppendVarint(uint64_t(number) << 3 | kLengthDelimited, head);
  if (bytes.data == nullptr || bytes.size == 0) {  // no data: protobuf writes no empty field
    AppendVarint(fields.size(), head);
    head->append(fields);
    return;
  }
  const uint32_t data_tag = uint32_t{v1::Tensor::kDataFieldNumber} << 3 | kLengthDelimited;
  const size_t body = fields.size() + CodedOutputStream::VarintSize32(data_tag) +
                      CodedOutputStream::VarintSize64(bytes.size) + bytes.size;
  AppendVarint(body, head);
  head->append(fields);
  AppendVarint(data_tag, head);
  AppendVarint(bytes.size, head);
  slices->emplace_back(*head);  // a copy of the few header bytes
  head->clear();
  // The slice owns the buffer from here: gRPC calls FreeBytes when it drops its last reference.
  const size_t size = bytes.size;
  char* data = bytes.data.release();
  HandOffToGrpc(data);
  slices->emplace_back(data, size, &FreeBytes);
}

}  // namespace

grpc::ByteBuffer EncodeAttendResponse(const v1::AttendResponse& header, OutputBytes o,
                                      OutputBytes lse) {
  std::vector<grpc::Slice> slices;
  std::string head;
  if (header.has_o()) {
    AppendTensor(v1::AttendResponse::kOFieldNumber, header.o(), std::move(o), &head, &slices);
  }
  if (header.has_lse()) {
    AppendTensor(v1::AttendResponse::kLseFieldNumber, header.lse(), std::move(lse), &head,
                 &slices);
  }
  // The remaining fields (timing, request_id, status) follow o and lse, as in field order.
  v1::AttendResponse rest = header;
  rest.clear_o();
  rest.clear_lse();
  rest.AppendToString(&head);
  if (!head.empty()) slices.emplace_back(head);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace attn
