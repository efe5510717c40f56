// Puts an AttendResponse, StepResponse or BatchStepResponse on the wire without copying its
// tensors' bytes: the small fields are serialized by protobuf, o.data and lse.data are appended
// by hand as slices over the buffers the backend wrote them into. The bytes are exactly those
// protobuf would write for the full message (fields in number order), so any client's parser
// reads them as usual.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include <grpcpp/support/byte_buffer.h>

#include "attn/v1/attention.pb.h"

namespace attn {

// An output tensor's bytes in a buffer of their own (null: the tensor carries no data here).
struct OutputBytes {
  std::unique_ptr<char[]> data;
  size_t size = 0;

  static OutputBytes Allocate(size_t size) {
    return {std::make_unique_for_overwrite<char[]>(size), size};
  }
};

// header: the response with o.data and lse.data empty. Each buffer given is spliced in as the
// data of o or lse (the tensor must be set in header); ownership passes to the returned buffer's
// slices, which free it once gRPC has released them (after the bytes are sent, or the call died).
grpc::ByteBuffer EncodeAttendResponse(const v1::AttendResponse& header, OutputBytes o,
                                      OutputBytes lse);

// The same for a StepResponse.
grpc::ByteBuffer EncodeStepResponse(const v1::StepResponse& header, OutputBytes o,
                                    OutputBytes lse);

// One StepResult of a BatchStepResponse: its status and, unless null (a failed item), its
// response with o's and lse's data in o and lse (moved out by the encoder).
struct EncodedStepResult {
  int32_t status_code = 0;
  std::string status_message;
  const v1::StepResponse* response = nullptr;
  OutputBytes o, lse;
};

// A BatchStepResponse of results, in order.
grpc::ByteBuffer EncodeBatchStepResponse(std::span<EncodedStepResult> results);

}  // namespace attn
