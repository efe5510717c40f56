// attn-client-wire-bench: what the client's coding of an Attend costs, without a network. For
// each request size it times, on one thread, what Client::Attend does with a request before gRPC
// sends it and with an answer gRPC has received (in slices of --slice_bytes):
//   request, protobuf: BuildAttendRequest (q, k, v copied into the message), then the stub's
//     serialization into fresh slices (a second copy);
//   request, prebuilt: that serialization alone (attn-bench --client_coding protobuf, whose
//     message is built once);
//   request, wire: EncodeAttendRequest (tensors spliced in as borrowed slices: no copy);
//   response, protobuf: the stub's parse of the slices into an AttendResponse (o copied into a
//     string), then ParseAttendResponse (o copied into the result);
//   response, wire: AttendResultFromWire (o copied once, from the slices into a fresh result);
//   response, wire, reused: ReadAttendResponse into the same result every time (its buffer
//     reused, as attn-bench's workers do).
// Prints one row per size: GB/s of the tensor bytes and the median time of each.
//   attn-client-wire-bench [--seq 256,2048,8192] [--heads 16] [--head_dim 128]
// With --batch_step N it times what session.h's BatchStep does with a BatchStep of N decode steps
// (q [1, heads, head_dim], k_new and v_new [1, kv_heads, head_dim]) instead:
//   request, protobuf: BuildStepRequest of each step into a BatchStepRequest, then the stub's
//     serialization; request, wire: EncodeBatchStepRequest (tensors spliced in, no copy);
//   response, protobuf: the stub's parse into a BatchStepResponse, then ParseStepResult of each
//     item; response, wire: BatchStepResultsFromWire (each o copied once into its result).
//   attn-client-wire-bench --batch_step 64 --heads 32 --kv_heads 8 --head_dim 128
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "attn/util/median_time.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "attn/client/client.h"
#include "attn/client/session.h"
#include "attn/client/wire_coding.h"

ABSL_FLAG(std::vector<std::string>, seq, std::vector<std::string>({"256", "2048", "8192"}),
          "Tokens of q and of k/v per request (comma-separated sizes to measure)");
ABSL_FLAG(int, heads, 16, "Heads of q, k and v");
ABSL_FLAG(int, head_dim, 128, "Head dimension (bf16 elements)");
ABSL_FLAG(int, slice_bytes, 64 << 10, "Size of the slices the response arrives in");
ABSL_FLAG(double, seconds, 1.0, "Time spent on each measurement");
ABSL_FLAG(int, batch_step, 0, "Steps of a BatchStep of decode steps to time instead (0: Attend)");
ABSL_FLAG(int, kv_heads, 0, "--batch_step: KV heads of k_new and v_new (0: --heads)");

namespace attn::client {
namespace {


using util::MedianSeconds;

Tensor RandomTensor(std::mt19937_64& rng, int64_t tokens, int heads, int d) {
  Tensor t;
  t.dtype = DType::kBFloat16;
  t.shape = {tokens, heads, d};
  t.data.resize(size_t(tokens) * heads * d * 2);
  for (char& c : t.data) c = static_cast<char>(rng());
  return t;
}

// bytes as gRPC receives them: in slices of slice_bytes.
grpc::ByteBuffer Sliced(const std::string& bytes, size_t slice_bytes) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice_bytes) {
    slices.emplace_back(bytes.data() + at, std::min(slice_bytes, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void Row(int seq, int heads, int d, size_t slice_bytes, double seconds) {
  std::mt19937_64 rng(seq);
  const Tensor q = RandomTensor(rng, seq, heads, d), k = RandomTensor(rng, seq, heads, d),
               v = RandomTensor(rng, seq, heads, d);
  AttendOptions options;
  options.cu_seqlens_q = options.cu_seqlens_k = {0, seq};
  const double in_bytes = double(q.data.size() + k.data.size() + v.data.size());

  const double req_proto = MedianSeconds([&] {
    const v1::AttendRequest m = Client::BuildAttendRequest(q, k, v, options);
    grpc::ByteBuffer out;
    bool own = false;
    (void)grpc::SerializationTraits<v1::AttendRequest>::Serialize(m, &out, &own);
  }, seconds);
  const v1::AttendRequest prebuilt = Client::BuildAttendRequest(q, k, v, options);
  const double req_prebuilt = MedianSeconds([&] {
    grpc::ByteBuffer out;
    bool own = false;
    (void)grpc::SerializationTraits<v1::AttendRequest>::Serialize(prebuilt, &out, &own);
  }, seconds);
  const double req_wire = MedianSeconds([&] {
    BorrowedSlices borrowed;
    { const grpc::ByteBuffer out = EncodeAttendRequest(q, k, v, options, &borrowed); }
  }, seconds);

  v1::AttendResponse answer;
  ToWireTensor(q, answer.mutable_o());  // o is as large as q
  answer.mutable_timing()->set_compute_us(1);
  const grpc::ByteBuffer received = Sliced(answer.SerializeAsString(), slice_bytes);
  const double out_bytes = double(q.data.size());
  const double resp_proto = MedianSeconds([&] {
    grpc::ByteBuffer copy(received);  // references, as gRPC hands a received message over
    v1::AttendResponse m;
    (void)grpc::SerializationTraits<v1::AttendResponse>::Deserialize(&copy, &m);
    (void)Client::ParseAttendResponse(m);
  }, seconds);
  const double resp_wire = MedianSeconds([&] {
    grpc::ByteBuffer copy(received);
    (void)AttendResultFromWire(&copy);
  }, seconds);
  AttendResult reused;
  const double resp_reused = MedianSeconds([&] {
    grpc::ByteBuffer copy(received);
    (void)ReadAttendResponse(&copy, &reused);
  }, seconds);

  // The wire request copies no tensor byte: its time, not a rate.
  std::printf("| %d | %.1f MB / %.1f MB | %.2f | %.2f | %.1f | %.0f / %.0f | %.2f | %.2f | %.2f |"
              " %.2f | %.0f / %.0f / %.0f |\n",
              seq, in_bytes / 1e6, out_bytes / 1e6, in_bytes / req_proto / 1e9,
              in_bytes / req_prebuilt / 1e9, req_wire * 1e6, req_proto * 1e6, req_prebuilt * 1e6,
              out_bytes / resp_proto / 1e9, out_bytes / resp_wire / 1e9,
              out_bytes / resp_reused / 1e9, resp_proto / resp_reused, resp_proto * 1e6,
              resp_wire * 1e6, resp_reused * 1e6);
  std::fflush(stdout);
}

void BatchStepRow(int n, int heads, int kv_heads, int d, size_t slice_bytes, double seconds) {
  std::mt19937_64 rng(n);
  std::vector<StepInput> items(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    StepInput& in = items[size_t(i)];
    in.session_id = "r6a1f20c4.0123456789abcdef0123456789abcdef";
    in.layer = i % 4;
    in.q = RandomTensor(rng, 1, heads, d);
    in.k_new = RandomTensor(rng, 1, kv_heads, d);
    in.v_new = RandomTensor(rng, 1, kv_heads, d);
  }
  const double req_proto = MedianSeconds([&] {
    v1::BatchStepRequest m;
    for (const StepInput& in : items) *m.add_steps() = BuildStepRequest(in);
    grpc::ByteBuffer out;
    bool own = false;
    (void)grpc::SerializationTraits<v1::BatchStepRequest>::Serialize(m, &out, &own);
  }, seconds);
  const double req_wire = MedianSeconds([&] {
    BorrowedSlices borrowed;
    { const grpc::ByteBuffer out = EncodeBatchStepRequest(items, nullptr, &borrowed); }
  }, seconds);

  size_t request_bytes = 0;
  {
    BorrowedSlices borrowed;
    request_bytes = EncodeBatchStepRequest(items, nullptr, &borrowed).Length();
  }

  v1::BatchStepResponse answer;
  for (const StepInput& in : items) {
    v1::StepResponse* r = answer.add_results()->mutable_response();
    ToWireTensor(in.q, r->mutable_o());  // o is as large as q
    r->set_cached_tokens(4097);
    r->mutable_timing()->set_compute_us(80.25);
  }
  const grpc::ByteBuffer received = Sliced(answer.SerializeAsString(), slice_bytes);
  const double resp_proto = MedianSeconds([&] {
    grpc::ByteBuffer copy(received);  // references, as gRPC hands a received message over
    v1::BatchStepResponse m;
    (void)grpc::SerializationTraits<v1::BatchStepResponse>::Deserialize(&copy, &m);
    for (const v1::StepResult& r : m.results()) (void)ParseStepResult(r);
  }, seconds);
  const double resp_wire = MedianSeconds([&] {
    grpc::ByteBuffer copy(received);
    (void)BatchStepResultsFromWire(&copy, items.size());
  }, seconds);
  std::printf("| %d | %.3f MB / %.3f MB | %.1f | %.1f | %.2fx | %.1f | %.1f | %.2fx |\n", n,
              request_bytes / 1e6,
              received.Length() / 1e6, req_proto * 1e6, req_wire * 1e6, req_proto / req_wire,
              resp_proto * 1e6, resp_wire * 1e6, resp_proto / resp_wire);
  std::fflush(stdout);
}

}  // namespace
}  // namespace attn::client

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const int n = absl::GetFlag(FLAGS_batch_step); n > 0) {
    const int heads = absl::GetFlag(FLAGS_heads);
    std::printf("| steps | request / response | protobuf request us | wire request us | x | "
                "protobuf response us | wire response us | x |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    attn::client::BatchStepRow(n, heads, absl::GetFlag(FLAGS_kv_heads) > 0
                                             ? absl::GetFlag(FLAGS_kv_heads) : heads,
                               absl::GetFlag(FLAGS_head_dim),
                               static_cast<size_t>(absl::GetFlag(FLAGS_slice_bytes)),
                               absl::GetFlag(FLAGS_seconds));
    return 0;
  }
  std::printf("| seq | tensors in / out | protobuf request GB/s | prebuilt request GB/s | wire "
              "request us | protobuf / prebuilt request us | protobuf response GB/s | wire "
              "response GB/s | wire, reused result GB/s | x (reused) | response us (protobuf / "
              "wire / reused) |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const std::string& s : absl::GetFlag(FLAGS_seq)) {
    int seq = 0;
    if (!absl::SimpleAtoi(s, &seq) || seq < 1) {
      std::fprintf(stderr, "attn-client-wire-bench: bad --seq entry '%s'\n", s.c_str());
      return 64;
    }
    attn::client::Row(seq, absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_head_dim),
                      static_cast<size_t>(absl::GetFlag(FLAGS_slice_bytes)),
                      absl::GetFlag(FLAGS_seconds));
  }
  return 0;
}
