// attn-wire-bench: where the host copies of an Attend go, without a network. For each request
// size it times, on one thread, what attnd does with a received message and with an answer:
//   request, protobuf: gRPC's parse of the slices into an AttendRequest (q, k, v copied into
//     strings), then the copy of q, k, v into staging (the CUDA backend's pinned buffer);
//   request, wire path: DecodeAttendRequest over the slices, then the one copy of the pieces into
//     staging (Backend::StageWireInputs);
//   response, protobuf: o copied from staging into the response message, then gRPC's
//     serialization into slices;
//   response, wire path: o copied from staging into a buffer of its own, then
//     EncodeAttendResponse (no copy).
// Prints one row per size: GB/s of the tensor bytes and the median time of each.
//   attn-wire-bench [--seq 256,2048,8192] [--heads 16] [--head_dim 128] [--slice_bytes 65536]
// With --batch_step N it times a BatchStep of N decode steps instead (q [1, heads, head_dim], k_new
// and v_new [1, kv_heads, head_dim]):
//   request, protobuf: gRPC's parse into a BatchStepRequest (what attnd's typed handler got);
//   request, wire path: DecodeBatchStepRequest, then each step's one copy of its tensors, from
//     the pieces, into the launch's staging (as the step pipeline stages a launch);
//   response, protobuf: each step's o written from the launch's output into its StepResponse,
//     then gRPC's serialization;
//   response, wire path: EncodeBatchStepResponse with each o a part of the launch's output (the
//     pinned buffer it came back into on the CUDA backend), sent from there: no copy.
//   attn-wire-bench --batch_step 64 --heads 32 --kv_heads 8 --head_dim 128
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "attn/util/median_time.h"
#include "absl/flags/parse.h"
#include "rpc/attend_request_decoder.h"
#include "rpc/response_encoder.h"
#include "engine/backend.h"
#include "rpc/step_request_decoder.h"

ABSL_FLAG(std::vector<std::string>, seq, std::vector<std::string>({"256", "2048", "8192"}),
          "Tokens of q and of k/v per request (comma-separated sizes to measure)");
ABSL_FLAG(int, heads, 16, "Heads of q, k and v");
ABSL_FLAG(int, head_dim, 128, "Head dimension (bf16 elements)");
ABSL_FLAG(int, slice_bytes, 64 << 10, "Size of the slices the request arrives in");
ABSL_FLAG(double, seconds, 1.0, "Time spent on each measurement");
ABSL_FLAG(int, batch_step, 0, "Steps of a BatchStep of decode steps to time instead (0: Attend)");
ABSL_FLAG(int, kv_heads, 0, "--batch_step: KV heads of k_new and v_new (0: --heads)");

namespace attn {
namespace {


using util::MedianSeconds;

// bytes as gRPC receives them: in slices of slice_bytes.
grpc::ByteBuffer Sliced(const std::string& bytes, size_t slice_bytes) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice_bytes) {
    slices.emplace_back(bytes.data() + at, std::min(slice_bytes, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(&s[i], &x, 8);
  }
  return s;
}

void Measure(int seq, std::mt19937_64& rng) {
  const int heads = absl::GetFlag(FLAGS_heads), d = absl::GetFlag(FLAGS_head_dim);
  const double secs = absl::GetFlag(FLAGS_seconds);
  const size_t tensor = size_t(seq) * heads * d * 2;
  v1::AttendRequest request;
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::DTYPE_BFLOAT16);
    for (int64_t s : {int64_t(seq), int64_t(heads), int64_t(d)}) t->add_shape(s);
    t->set_data(RandomBytes(rng, tensor));
  }
  const grpc::ByteBuffer received =
      Sliced(request.SerializeAsString(), static_cast<size_t>(absl::GetFlag(FLAGS_slice_bytes)));
  std::vector<char> staging(3 * tensor);  // the backend's (pinned) staging, reused

  const double req_proto = MedianSeconds([&] {
    grpc::ByteBuffer bb = received;  // shares the slices
    v1::AttendRequest parsed;
    if (!grpc::SerializationTraits<v1::AttendRequest>::Deserialize(&bb, &parsed).ok()) std::abort();
    size_t at = 0;
    for (const v1::Tensor* t : {&parsed.q(), &parsed.k(), &parsed.v()}) {
      std::memcpy(staging.data() + at, t->data().data(), t->data().size());
      at += t->data().size();
    }
  }, secs);
  const double req_wire = MedianSeconds([&] {
    std::vector<grpc::Slice> slices;
    if (!received.Dump(&slices).ok()) std::abort();
    std::vector<std::string_view> pieces;
    for (const grpc::Slice& s : slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    DecodedAttendRequest decoded;
    if (!DecodeAttendRequest(pieces, &decoded).ok()) std::abort();
    size_t at = 0;
    for (const WireBytes* w : {&decoded.data.q, &decoded.data.k, &decoded.data.v}) {
      w->CopyTo(staging.data() + at);
      at += w->size;
    }
  }, secs);

  v1::AttendResponse header;
  header.mutable_o()->set_dtype(v1::DTYPE_BFLOAT16);
  header.mutable_o()->mutable_shape()->CopyFrom(request.q().shape());
  header.set_request_id(7);
  header.mutable_timing()->set_compute_us(1);
  const double resp_proto = MedianSeconds([&] {
    v1::AttendResponse response = header;
    response.mutable_o()->mutable_data()->resize(tensor);
    std::memcpy(response.mutable_o()->mutable_data()->data(), staging.data(), tensor);
    grpc::ByteBuffer out;
    bool own = false;
    if (!grpc::SerializationTraits<v1::AttendResponse>::Serialize(response, &out, &own).ok()) {
      std::abort();
    }
  }, secs);
  const double resp_wire = MedianSeconds([&] {
    OutputBytes o = OutputBytes::Allocate(tensor);
    std::memcpy(o.data, staging.data(), tensor);
    grpc::ByteBuffer out = EncodeAttendResponse(header, std::move(o), OutputBytes());
  }, secs);

  const double in_gb = 3.0 * tensor / 1e9, out_gb = double(tensor) / 1e9;
  std::printf("%6d %9.1f %9.1f %11.2f %11.2f %7.2fx %9.1f %11.2f %11.2f %7.2fx\n", seq,
              3.0 * tensor / 1e6, req_proto * 1e3, in_gb / req_proto, in_gb / req_wire,
              req_proto / req_wire, tensor / 1e6, out_gb / resp_proto, out_gb / resp_wire,
              resp_proto / resp_wire);
  std::fflush(stdout);
}

// One BatchStep of n decode steps: its request from slices to per-step host copies, its response
// from the outputs to slices, each through protobuf and on the wire path.
void MeasureBatchStep(int n, std::mt19937_64& rng) {
  const int heads = absl::GetFlag(FLAGS_heads), d = absl::GetFlag(FLAGS_head_dim);
  const int kv_heads = absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads) : heads;
  const double secs = absl::GetFlag(FLAGS_seconds);
  const size_t q_bytes = size_t(heads) * d * 2;
  v1::BatchStepRequest request;
  for (int i = 0; i < n; ++i) {
    v1::StepRequest* step = request.add_steps();
    step->set_session_id("r6a1f20c4.0123456789abcdef0123456789abcdef");
    step->set_layer(i % 4);
    const std::pair<v1::Tensor*, int> tensors[] = {
        {step->mutable_q(), heads}, {step->mutable_k_new(), kv_heads}, {step->mutable_v_new(), kv_heads}};
    for (const auto& [t, h] : tensors) {
      t->set_dtype(v1::DTYPE_BFLOAT16);
      for (int64_t s : {int64_t{1}, int64_t(h), int64_t(d)}) t->add_shape(s);
      t->set_data(RandomBytes(rng, size_t(h) * d * 2));
    }
  }
  const std::string bytes = request.SerializeAsString();
  const grpc::ByteBuffer received =
      Sliced(bytes, static_cast<size_t>(absl::GetFlag(FLAGS_slice_bytes)));

  const double req_proto = MedianSeconds([&] {
    grpc::ByteBuffer bb = received;  // shares the slices
    v1::BatchStepRequest parsed;
    if (!grpc::SerializationTraits<v1::BatchStepRequest>::Deserialize(&bb, &parsed).ok()) {
      std::abort();
    }
  }, secs);
  std::vector<char> launch_staging;
  const double req_wire = MedianSeconds([&] {
    std::vector<grpc::Slice> slices;
    if (!received.Dump(&slices).ok()) std::abort();
    std::vector<std::string_view> pieces;
    for (const grpc::Slice& s : slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    std::vector<DecodedStepRequest> decoded;
    if (!DecodeBatchStepRequest(pieces, &decoded).ok()) std::abort();
    // Each step's tensors copied once, into the launch's staging (q, k_new, v_new packed).
    size_t q_total = 0, kv_total = 0;
    for (const DecodedStepRequest& step : decoded) {
      q_total += step.data.q.size;
      kv_total += step.data.k.size;
    }
    launch_staging.resize(q_total + 2 * kv_total);
    char* q_at = launch_staging.data();
    char* k_at = q_at + q_total;
    char* v_at = k_at + kv_total;
    for (const DecodedStepRequest& step : decoded) {
      step.data.q.CopyTo(q_at);
      step.data.k.CopyTo(k_at);
      step.data.v.CopyTo(v_at);
      q_at += step.data.q.size;
      k_at += step.data.k.size;
      v_at += step.data.v.size;
    }
  }, secs);

  // The launch's output: every step's o, as the device brought them back.
  const std::string o_bytes = RandomBytes(rng, q_bytes * size_t(n));
  OutputBytes launch_out = OutputBytes::Allocate(o_bytes.size());
  std::memcpy(launch_out.data, o_bytes.data(), o_bytes.size());
  v1::StepResponse header;
  header.mutable_o()->set_dtype(v1::DTYPE_BFLOAT16);
  for (int64_t s : {int64_t{1}, int64_t(heads), int64_t(d)}) header.mutable_o()->add_shape(s);
  header.set_cached_tokens(4097);
  header.mutable_timing()->set_queue_us(12.5);
  header.mutable_timing()->set_compute_us(80.25);
  header.mutable_timing()->set_batch_requests(n);
  const double resp_proto = MedianSeconds([&] {
    v1::BatchStepResponse response;
    for (int i = 0; i < n; ++i) {
      v1::StepResponse* r = response.add_results()->mutable_response();
      *r = header;
      r->mutable_o()->mutable_data()->resize(q_bytes);
      std::memcpy(r->mutable_o()->mutable_data()->data(), launch_out.data + size_t(i) * q_bytes,
                  q_bytes);
    }
    grpc::ByteBuffer out;
    bool own = false;
    if (!grpc::SerializationTraits<v1::BatchStepResponse>::Serialize(response, &out, &own).ok()) {
      std::abort();
    }
  }, secs);
  const double resp_wire = MedianSeconds([&] {
    std::vector<v1::StepResponse> headers(size_t(n), header);
    std::vector<EncodedStepResult> results(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      results[i].response = &headers[i];
      results[i].o = launch_out.Part(size_t(i) * q_bytes, q_bytes);
    }
    grpc::ByteBuffer out = EncodeBatchStepResponse(results);
  }, secs);
  std::printf("%6d %9.3f %9.1f %9.1f %7.2fx %9.3f %9.1f %9.1f %7.2fx\n", n, bytes.size() / 1e6,
              req_proto * 1e6, req_wire * 1e6, req_proto / req_wire,
              n * (q_bytes + 64) / 1e6, resp_proto * 1e6, resp_wire * 1e6, resp_proto / resp_wire);
  std::fflush(stdout);
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (const int n = absl::GetFlag(FLAGS_batch_step); n > 0) {
    std::printf("BatchStep of %d decode steps: request slices -> launch staging; response "
                "launch output -> slices (bf16, %d/%d heads, d=%d, %d-byte slices, one thread, median)\n",
                n, absl::GetFlag(FLAGS_heads),
                absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads)
                                                  : absl::GetFlag(FLAGS_heads),
                absl::GetFlag(FLAGS_head_dim), absl::GetFlag(FLAGS_slice_bytes));
    std::printf("%6s %9s %9s %9s %8s %9s %9s %9s %8s\n", "steps", "req_MB", "proto_us", "wire_us",
                "speedup", "resp_MB", "proto_us", "wire_us", "speedup");
    std::mt19937_64 rng(std::random_device{}());
    attn::MeasureBatchStep(n, rng);
    return 0;
  }
  std::printf("request: slices -> staging; response: staging -> slices (bf16, %d heads, d=%d, "
              "%d-byte slices, one thread, median)\n",
              absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_head_dim),
              absl::GetFlag(FLAGS_slice_bytes));
  std::printf("%6s %9s %9s %11s %11s %8s %9s %11s %11s %8s\n", "seq", "req_MB", "proto_ms",
              "proto_GB/s", "wire_GB/s", "speedup", "resp_MB", "proto_GB/s", "wire_GB/s",
              "speedup");
  std::mt19937_64 rng(std::random_device{}());
  for (const std::string& s : absl::GetFlag(FLAGS_seq)) attn::Measure(std::stoi(s), rng);
  return 0;
}
