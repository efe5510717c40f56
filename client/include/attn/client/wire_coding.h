// The client's side of the one-copy wire path of Attend, Echo, Step and BatchStep: requests are written in
// protobuf's wire format by hand, their tensors spliced in as slices over the caller's memory (no
// copy), and responses are read from the slices gRPC received them in, each tensor copied once,
// straight into the result. The bytes are exactly those the generated serializer writes (fields
// in number order), so any attnd, or any other gRPC server of attn.v1, reads them as usual; the
// reader takes whatever protobuf's parser takes (fields in any order or repeated, packed or
// unpacked shapes, unknown fields). Client (ClientOptions::wire_coding) sends its calls this way,
// and so do session.h's Step and BatchStep.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attn/client/client.h"
#include "attn/client/session.h"
#include "attn/v1/attention.pb.h"

namespace attn::client {

// The full names of the methods the raw calls go to.
inline constexpr char kAttendMethod[] = "/attn.v1.Attention/Attend";
inline constexpr char kEchoMethod[] = "/attn.v1.Attention/Echo";
inline constexpr char kStepMethod[] = "/attn.v1.Attention/Step";
inline constexpr char kBatchStepMethod[] = "/attn.v1.Attention/BatchStep";
inline constexpr char kAttendStreamMethod[] = "/attn.v1.Attention/AttendStream";

// Slices over memory of the caller's, counted until every holder of them has let go: the buffers
// they are in and gRPC, which may keep a sent message's slices a little after its call has
// completed (a write still finishing, the stream's teardown). The memory must stay valid and
// unchanged until Wait returns. On a connection whose peer stopped reading in the middle of a
// write, that is only once the connection closes: a call that borrows cannot return before.
class BorrowedSlices {
 public:
  BorrowedSlices() = default;
  BorrowedSlices(const BorrowedSlices&) = delete;
  BorrowedSlices& operator=(const BorrowedSlices&) = delete;
  // Waits (see Wait): a slice's release touches this object. Destroy the buffers first.
  ~BorrowedSlices() { Wait(); }

  // A slice over [data, data + size), not a copy.
  grpc::Slice Borrow(const void* data, size_t size);
  // Blocks until every slice Borrow made has been released.
  void Wait();
  // Calls fn once every slice Borrow made has been released: at once, on this thread, when none
  // is outstanding, else on the thread that releases the last one. For callers that must not
  // block; fn may destroy this object. At most one fn at a time, set after the last Borrow.
  void NotifyWhenReleased(std::function<void()> fn);
  // Slices not yet released.
  int64_t outstanding() const;

 private:
  static void Release(void* self);

  mutable std::mutex mu_;
  std::condition_variable released_;
  int64_t outstanding_ = 0;  // guarded by mu_
  std::function<void()> on_released_;  // guarded by mu_
};

// The bytes of Client::BuildAttendRequest(q, k, v, options) (with request_id set) as protobuf
// serializes them: the small fields in one slice (cut into the runs between the tensors), each
// tensor's data a slice borrowed through borrowed.
grpc::ByteBuffer EncodeAttendRequest(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttendOptions& options, BorrowedSlices* borrowed,
                                     uint64_t request_id = 0);

// An EchoRequest{payload, response_bytes} as protobuf serializes it, payload borrowed.
grpc::ByteBuffer EncodeEchoRequest(std::string_view payload, int64_t response_bytes,
                                   BorrowedSlices* borrowed);

// A tensor's dtype, shape and bytes, owned by someone else: what the encoders read, so that a
// caller whose tensors are not Tensors (a binding's arrays) sends them without a copy.
struct TensorRef {
  DType dtype = DType::kBFloat16;
  std::span<const int64_t> shape;
  std::string_view data;
};
TensorRef RefOf(const Tensor& t);

// A StepInput whose strings, tensors and scales are references.
struct StepInputRef {
  std::string_view session_id;
  int32_t layer = 0;
  TensorRef q, k_new, v_new;
  StepOptions options;
  std::span<const float> k_new_scales, v_new_scales;
};
StepInputRef RefOf(const StepInput& in);

// The bytes of BuildStepRequest(in) as protobuf serializes them, q's, k_new's and v_new's data
// borrowed.
grpc::ByteBuffer EncodeStepRequest(const StepInput& in, BorrowedSlices* borrowed);
grpc::ByteBuffer EncodeStepRequest(const StepInputRef& in, BorrowedSlices* borrowed);

// A BatchStepRequest of items[indices] (all of them when indices is null), in order, as protobuf
// serializes it, every tensor's data borrowed.
grpc::ByteBuffer EncodeBatchStepRequest(const std::vector<StepInput>& items,
                                        const std::vector<size_t>* indices,
                                        BorrowedSlices* borrowed);
grpc::ByteBuffer EncodeBatchStepRequest(std::span<const StepInputRef> items,
                                        BorrowedSlices* borrowed);

// A received message's bytes as pieces of its slices (which it holds).
struct ReceivedBytes {
  std::vector<grpc::Slice> slices;
  std::vector<std::string_view> pieces;

  // Takes buffer's slices (references, not copies); buffer is left empty.
  absl::Status Take(grpc::ByteBuffer* buffer);
};

// An AttendResponse or StepResponse with the data of o and lse left in the input, as pieces of
// it.
template <typename Header>
struct DecodedOutputs {
  Header header;  // everything but o.data and lse.data
  std::vector<std::string_view> o_data, lse_data;
  uint64_t o_size = 0, lse_size = 0;
};
using DecodedAttendResponse = DecodedOutputs<v1::AttendResponse>;
using DecodedStepResponse = DecodedOutputs<v1::StepResponse>;

// Reads an AttendResponse from pieces (any split) as protobuf's parser would, except that o.data
// and lse.data stay in the input. Malformed bytes give INTERNAL ("the server's AttendResponse is
// malformed: ..." naming the field and byte). out must be fresh.
absl::Status DecodeAttendResponse(std::span<const std::string_view> pieces,
                                  DecodedAttendResponse* out);

// The result of a decoded response, into *result: o and lse checked (known dtype, sizes that
// fit, data as long as the shape says; INTERNAL otherwise, *result left as it was) and copied
// from the pieces into result's tensors, whose buffers are reused where large enough.
absl::Status ReadAttendResult(const DecodedAttendResponse& decoded, AttendResult* result);

// Both of the above over a received response (left empty).
absl::Status ReadAttendResponse(grpc::ByteBuffer* response, AttendResult* result);
absl::StatusOr<AttendResult> AttendResultFromWire(grpc::ByteBuffer* response);

// The same for a StepResponse ("the server's StepResponse is malformed: ...") and its result.
absl::Status DecodeStepResponse(std::span<const std::string_view> pieces,
                                DecodedStepResponse* out);
absl::Status ReadStepResult(const DecodedStepResponse& decoded, StepResult* result);
absl::StatusOr<StepResult> StepResultFromWire(grpc::ByteBuffer* response);

// One result of a BatchStepResponse: its status fields, and its response with o's and lse's data
// left in the input.
struct DecodedStepResult {
  v1::StepResult status;  // status_code and status_message only
  DecodedStepResponse response;
};
// Reads a BatchStepResponse from pieces; INTERNAL when it is malformed or has another number of
// results than `items`.
absl::Status DecodeBatchStepResponse(std::span<const std::string_view> pieces, size_t items,
                                     std::vector<DecodedStepResult>* out);

// The items of a received BatchStepResponse (left empty), each its own status or its result; the
// whole fails (INTERNAL) when it is malformed or has another number of results than `items`.
absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> BatchStepResultsFromWire(
    grpc::ByteBuffer* response, size_t items);

// The payload of a received EchoResponse (left empty), copied once into *payload (its buffer
// reused where large enough); INTERNAL when malformed.
absl::Status ReadEchoResponse(grpc::ByteBuffer* response, std::string* payload);
absl::StatusOr<std::string> EchoPayloadFromWire(grpc::ByteBuffer* response);

}  // namespace attn::client
