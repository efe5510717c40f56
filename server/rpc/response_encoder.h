// Puts the answers that carry output tensors (AttendResponse, StepResponse, BatchStepResponse) on
// the wire without copying those tensors: the small fields are serialized by protobuf, o.data and
// lse.data are appended by hand as slices over the memory the outputs were computed or brought
// back into (engine/output_bytes.h: a launch's pinned output staging on the CUDA backend), which
// the slices keep alive until gRPC has sent them. The bytes are exactly those protobuf would
// write for the full message (fields in number order), so any client's parser reads them as
// usual.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include <grpcpp/support/byte_buffer.h>

#include "attn/v1/attention.pb.h"
#include "engine/output_bytes.h"

namespace attn {

// header: the response with o.data and lse.data empty. Each output given (empty: none) is spliced
// in as the data of o or lse (the tensor must be set in header); its owner is held by the
// returned buffer's slices until gRPC has released them (after the bytes are sent, or the call
// died).
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
