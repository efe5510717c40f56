// The C++ client library of attnd: a blocking, thread-safe wrapper over the attn.v1 stubs that
// takes and returns plain tensors.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <functional>

#include <grpcpp/support/client_callback.h>

#include "absl/status/statusor.h"
#include "attn/v1/attention.grpc.pb.h"

namespace attn::client {

// kFloat8E4M3: OCP E4M3FN codes, one byte each, whose values are scaled by descales sent beside
// them (AttendOptions::fp8).
enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3 };
size_t DTypeBytes(DType t);
// "fp32"/"float32", "fp16"/"float16", "bf16"/"bfloat16", "fp8"/"float8_e4m3".
absl::StatusOr<DType> ParseDType(const std::string& name);

// A dense row-major tensor as raw little-endian bytes.
struct Tensor {
  DType dtype = DType::kBFloat16;
  std::vector<int64_t> shape;
  std::string data;

  int64_t NumElements() const;
  // Builds a tensor of dtype from floats (rounded to nearest even; kFloat8E4M3: the E4M3 codes of
  // the values as given, saturating at +-448: divide by the descale first).
  static Tensor FromFloats(DType dtype, std::vector<int64_t> shape, const std::vector<float>& v);
  std::vector<float> ToFloats() const;
};

struct AttendOptions {
  std::vector<int32_t> cu_seqlens_q;  // empty: one sequence
  std::vector<int32_t> cu_seqlens_k;
  bool causal = false;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  int32_t window_left = -1;
  int32_t window_right = -1;
  bool return_lse = false;
  bool high_priority = false;
  std::chrono::milliseconds timeout{0};  // 0: none
  // Descales of FP8 q, k, v (float32; 1 entry per tensor or [batch, num_kv_heads]) and the output
  // type when q is FP8 (kFloat16 or kBFloat16); see attention.proto's Fp8Attend. Sent when k is
  // FP8 or any of these is set.
  std::vector<float> q_descale;
  std::vector<float> k_descale;
  std::vector<float> v_descale;
  std::optional<DType> o_dtype;
};

// The fp8 field of the AttendRequest for these tensors and options, when it has one.
std::optional<v1::Fp8Attend> Fp8Field(const Tensor& k, const AttendOptions& options);

struct AttendResult {
  Tensor o;
  std::optional<Tensor> lse;  // float32 [num_heads, total_q]
  v1::ServerTiming timing;
};

struct ClientOptions {
  std::string target = "127.0.0.1:50051";
  int64_t max_message_bytes = 256ll << 20;
  std::string bearer_token;     // sent as "authorization: Bearer <token>" when set
  bool tls = false;             // TLS; with no tls_ca_pem, against the system's root CAs
  std::string tls_ca_pem;       // TLS when set: the CA that signed the server's certificate
  std::string tls_cert_pem;     // client certificate, for mTLS
  std::string tls_key_pem;
  std::string tls_server_name;  // override of the name checked in the server's certificate
  // A connection of this client's own instead of one shared with other channels to the same
  // target (load generators want one per worker).
  bool unique_channel = false;
  // Calls wait (up to their deadline) while the channel connects or reconnects instead of failing
  // at once with UNAVAILABLE; for callers that may start before the server is reachable or open
  // many connections at once. Off: a server that is down fails calls fast.
  bool wait_for_ready = false;
  // gRPC load-balancing policy of the channel, set as its default service config
  // {"loadBalancingConfig":[{"<lb_policy>":{}}]}: "round_robin" spreads calls over every address
  // the target resolves to (a headless Service's DNS name, or "ipv4:10.0.0.1:50051,10.0.0.2:50051");
  // "pick_first" (gRPC's default) keeps one connection. Empty: gRPC's default (or the resolver's
  // service config). A service config served by the resolver (DNS TXT) overrides this one.
  std::string lb_policy;
  // HTTP/2 connections this client spreads its calls over (round robin, one call each): one
  // connection moves about one core's worth of bytes (~1 GB/s), and gRPC channels with the same
  // target and arguments share one connection, so each of these channels gets arguments of its
  // own. 0: min(4, hardware threads). Calls of one thread run one at a time, so more connections
  // help only a client whose threads call concurrently.
  int connections = 0;
  // Size of gRPC's TCP reads (they grow up to 8x it); 0: gRPC's default (8 KiB, adaptive). Off
  // by default: no measured gain yet (docs/PERF.md, "Transport settings").
  int tcp_read_chunk_bytes = 0;
  // Retries, by gRPC's retry policy in the channel's service config, of the calls that change
  // nothing on the server (Attend, Echo, GetServerInfo, ListRegions, the health check) when they
  // fail with UNAVAILABLE (a replica restarting or draining, a connection lost before the call
  // was sent): up to retry_max_attempts attempts in all, with exponential backoff from
  // retry_initial_backoff up to retry_max_backoff (gRPC adds jitter). 1: no retries. Session
  // calls (Step, BatchStep, CreateSession, ...) and AttendStream are never retried: a step sent
  // twice would append its tokens twice. Requests up to retry_buffer_bytes are retried; gRPC
  // keeps references to their slices (not copies) until the call is done.
  int retry_max_attempts = 3;
  std::chrono::milliseconds retry_initial_backoff{50};
  std::chrono::milliseconds retry_max_backoff{1000};
  int64_t retry_buffer_bytes = 64ll << 20;
  // Keepalive pings every keepalive_time while calls are in flight: a connection whose peer does
  // not answer within keepalive_timeout is closed, so calls to a dead peer (a node gone, a
  // partition) fail with UNAVAILABLE instead of waiting for their deadlines. attnd accepts pings
  // every 10 s or more. 0: no pings.
  std::chrono::milliseconds keepalive_time{30000};
  std::chrono::milliseconds keepalive_timeout{10000};
  // Extra gRPC channel arguments (name, integer value), e.g. {"grpc.http2.max_frame_size",
  // 1 << 20}; for measuring transport settings (attn-bench --channel_arg).
  std::vector<std::pair<std::string, int>> channel_args;
  // Attend, Echo, Step and BatchStep as raw calls whose bytes this library writes and reads
  // itself (attn/client/wire_coding.h): the tensors go out as slices over the caller's memory, o (and
  // lse, and Echo's payload) come back with one copy, from the received slices into the result.
  // false: through protobuf messages and the generated stub (a copy into the message and one
  // into fresh slices each way, and one more out of the parsed response), for measuring the
  // difference. The bytes on the wire are the same either way. A call returns once gRPC has let
  // go of the caller's buffers (wire_coding.h, BorrowedSlices).
  bool wire_coding = true;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);

  absl::StatusOr<AttendResult> Attend(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const AttendOptions& options = {});
  // The same into *result, whose buffers the wire coding reuses where they are large enough: a
  // caller that calls in a loop saves an allocation (and the page faults of fresh memory) per
  // call. On an error *result is unspecified.
  absl::Status Attend(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttendOptions& options, AttendResult* result);
  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo();
  // The grpc.health.v1 status of service ("" is the whole server): true when SERVING.
  absl::StatusOr<bool> Health(const std::string& service = "");
  // Sends payload through the Echo RPC and returns what came back: all of it, or its first
  // response_bytes when 0 < response_bytes < its size.
  absl::StatusOr<std::string> Echo(std::string_view payload, int64_t response_bytes = 0);
  // The same into *out, whose buffer the wire coding reuses where it is large enough.
  absl::Status Echo(std::string_view payload, int64_t response_bytes, std::string* out);

  // The request message Attend would send; for callers that drive the stubs themselves.
  static v1::AttendRequest BuildAttendRequest(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const AttendOptions& options);
  static absl::StatusOr<AttendResult> ParseAttendResponse(const v1::AttendResponse& response);

  // A stub of the next connection, round robin (thread-safe).
  v1::Attention::Stub* stub();
  // The first connection's channel.
  const std::shared_ptr<grpc::Channel>& channel() const { return channels_.front(); }
  // The connections this client spreads its calls over.
  int connections() const { return static_cast<int>(channels_.size()); }
  // Sets the bearer token and deadline on a context for a direct stub call.
  void PrepareContext(grpc::ClientContext* ctx, std::chrono::milliseconds timeout) const;
  // ClientOptions::wire_coding: session.h's Step and BatchStep then go out as the raw calls below.
  bool wire_coding() const { return options_.wire_coding; }
  // ClientOptions::max_message_bytes: the largest message this client sends or receives.
  int64_t max_message_bytes() const { return options_.max_message_bytes; }
  // Step and BatchStep as blocking raw calls with bytes coded by the caller (wire_coding.h), on
  // the next connection.
  grpc::Status CallStep(grpc::ByteBuffer request, std::chrono::milliseconds timeout,
                        grpc::ByteBuffer* response);
  grpc::Status CallBatchStep(grpc::ByteBuffer request, std::chrono::milliseconds timeout,
                             grpc::ByteBuffer* response);
  // An AttendStream whose requests and responses are bytes coded by the caller (wire_coding.h:
  // EncodeAttendRequest, DecodeAttendResponse), on the next connection. ctx as for a stub's
  // stream (PrepareContext); it must outlive the stream.
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> OpenRawAttendStream(
      grpc::ClientContext* ctx);

  // The unary methods the raw calls go to.
  enum class RawMethod { kAttend, kEcho, kStep, kBatchStep };
  // A blocking raw unary call of method with bytes coded by the caller, on the next connection
  // (timeout 0: none). For bindings that code messages themselves (attn/client/c_api.h).
  grpc::Status CallUnary(RawMethod method, grpc::ByteBuffer request,
                         std::chrono::milliseconds timeout, grpc::ByteBuffer* response);
  // Starts a raw unary call of method on the next connection without blocking (gRPC's callback
  // API); done runs once, on a gRPC thread. ctx (PrepareContext'ed), request and response must
  // stay valid until then.
  void StartRawCall(RawMethod method, grpc::ClientContext* ctx, const grpc::ByteBuffer* request,
                    grpc::ByteBuffer* response, std::function<void(grpc::Status)> done);
  // Binds reactor to a new AttendStream of raw bytes on the next connection; the reactor starts
  // it (StartCall). ctx must outlive the stream.
  void PrepareRawAttendStream(grpc::ClientContext* ctx,
                              grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* reactor);

 private:
  Client(ClientOptions options, std::vector<std::shared_ptr<grpc::Channel>> channels);

  // The next connection's index, round robin.
  size_t NextConnection();
  // Attend through ClientOptions::wire_coding's raw call, and through protobuf messages.
  absl::Status AttendWire(const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttendOptions& options, AttendResult* result);
  absl::Status AttendProto(const Tensor& q, const Tensor& k, const Tensor& v,
                           const AttendOptions& options, AttendResult* result);
  // The raw calls' method of that kind on a connection.
  const grpc::internal::RpcMethod& RawMethodOf(RawMethod method, size_t connection) const;
  // A blocking unary call of method (one of the *_methods_) with bytes coded here.
  grpc::Status CallRaw(size_t connection, const grpc::internal::RpcMethod& method,
                       grpc::ByteBuffer request, std::chrono::milliseconds timeout,
                       grpc::ByteBuffer* response);

  ClientOptions options_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::Attention::Stub>> stubs_;
  // Per connection, the raw calls' methods, registered with its channel as a stub's are.
  std::vector<grpc::internal::RpcMethod> attend_methods_, echo_methods_, step_methods_,
      batch_step_methods_, attend_stream_methods_;
  std::atomic<uint64_t> next_stub_{0};
};

// The connection count that ClientOptions::connections = 0 stands for: min(4, hardware threads).
int DefaultConnections();

// grpc::Status -> absl::Status (same codes).
absl::Status FromGrpc(const grpc::Status& status);

// Plain tensor <-> wire tensor, for callers that build messages themselves. FromWireTensor fails
// (INTERNAL) on an unknown dtype or a byte length that does not match the shape.
void ToWireTensor(const Tensor& t, v1::Tensor* out);
absl::StatusOr<Tensor> FromWireTensor(const v1::Tensor& t);
v1::DType ToWireDType(DType t);
// INTERNAL for a number that is no DType.
absl::StatusOr<DType> FromWireDType(v1::DType t);

}  // namespace attn::client
