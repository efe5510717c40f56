#include "attn/client/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/support/client_callback.h>
#include <grpcpp/security/credentials.h>

#include <cctype>
#include <cstring>
#include <thread>
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/client/wire_coding.h"
#include "attn/kernels/dtype_convert.h"
#include "grpc_hand_off.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tensor_bytes.h"

namespace attn::client {
absl::StatusOr<DType> FromWireDType(v1::DType t) {
  switch (t) {
    case v1::DTYPE_FLOAT32: return DType::kFloat32;
    case v1::DTYPE_FLOAT16: return DType::kFloat16;
    case v1::DTYPE_BFLOAT16: return DType::kBFloat16;
    case v1::DTYPE_FLOAT8_E4M3: return DType::kFloat8E4M3;
    default: return absl::InternalError(absl::StrCat("server sent unknown dtype ", t));
  }
}

namespace {

// Seconds as a google.protobuf.Duration in JSON ("0.050s").
std::string JsonDuration(std::chrono::milliseconds d) {
  return absl::StrCat(d.count() / 1000, ".", absl::Dec(d.count() % 1000, absl::kZeroPad3), "s");
}

// The channel's default service config: its load-balancing policy, and the retry policy of the
// calls that change nothing on the server (ClientOptions::retry_max_attempts).
std::string ServiceConfigJson(const ClientOptions& o) {
  std::vector<std::string> parts;
  if (!o.lb_policy.empty()) {
    parts.push_back(absl::StrCat(R"("loadBalancingConfig":[{")", o.lb_policy, R"(":{}}])"));
  }
  if (o.retry_max_attempts > 1) {
    std::vector<std::string> names;
    for (const char* m : {"Attend", "Echo", "GetServerInfo"}) {
      names.push_back(absl::StrCat(R"({"service":"attn.v1.Attention","method":")", m, R"("})"));
    }
    names.push_back(R"({"service":"attn.v1.SharedMemory","method":"ListRegions"})");
    names.push_back(R"({"service":"grpc.health.v1.Health","method":"Check"})");
    parts.push_back(absl::StrCat(
        R"("methodConfig":[{"name":[)", absl::StrJoin(names, ","), R"(],"retryPolicy":{)",
        R"("maxAttempts":)", o.retry_max_attempts, R"(,"initialBackoff":")",
        JsonDuration(o.retry_initial_backoff), R"(","maxBackoff":")",
        JsonDuration(o.retry_max_backoff),
        R"(","backoffMultiplier":2,"retryableStatusCodes":["UNAVAILABLE"]}}])"));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

}  // namespace

v1::DType ToWireDType(DType t) {
  switch (t) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case DType::kFloat8E4M3: return v1::DTYPE_FLOAT8_E4M3;
  }
  return v1::DTYPE_UNSPECIFIED;
}

void ToWireTensor(const Tensor& t, v1::Tensor* out) {
  out->set_dtype(ToWireDType(t.dtype));
  for (int64_t s : t.shape) out->add_shape(s);
  out->set_data(t.data);
}

absl::StatusOr<Tensor> FromWireTensor(const v1::Tensor& t) {
  Tensor out;
  auto dtype = FromWireDType(t.dtype());
  if (!dtype.ok()) return dtype.status();
  out.dtype = *dtype;
  auto bytes = WireTensorBytes("tensor", t, out.dtype);
  if (!bytes.ok()) return bytes.status();
  if (t.data().size() != *bytes) {
    return absl::InternalError("server sent a tensor whose byte length does not match its shape");
  }
  out.shape.assign(t.shape().begin(), t.shape().end());
  out.data = t.data();
  return out;
}

size_t DTypeBytes(DType t) {
  return t == DType::kFloat32 ? 4 : t == DType::kFloat8E4M3 ? 1 : 2;
}

std::optional<v1::Fp8Attend> Fp8Field(const Tensor& k, const AttendOptions& o) {
  if (k.dtype != DType::kFloat8E4M3 && o.q_descale.empty() && o.k_descale.empty() &&
      o.v_descale.empty() && !o.o_dtype) {
    return std::nullopt;
  }
  v1::Fp8Attend f;
  f.mutable_q_descale()->Assign(o.q_descale.begin(), o.q_descale.end());
  f.mutable_k_descale()->Assign(o.k_descale.begin(), o.k_descale.end());
  f.mutable_v_descale()->Assign(o.v_descale.begin(), o.v_descale.end());
  if (o.o_dtype) f.set_o_dtype(ToWireDType(*o.o_dtype));
  return f;
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp8" || name == "float8_e4m3") return DType::kFloat8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': use fp32, fp16, bf16 or fp8"));
}

int64_t Tensor::NumElements() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Tensor Tensor::FromFloats(DType dtype, std::vector<int64_t> shape, const std::vector<float>& v) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(v.size() * DTypeBytes(dtype));
  if (dtype == DType::kFloat32) {
    std::memcpy(t.data.data(), v.data(), t.data.size());
    return t;
  }
  if (dtype == DType::kFloat8E4M3) {
    for (size_t i = 0; i < v.size(); ++i) t.data[i] = char(kernels::cpu::FloatToE4m3Bits(v[i]));
    return t;
  }
  auto* out = reinterpret_cast<uint16_t*>(t.data.data());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = dtype == DType::kFloat16 ? kernels::cpu::FloatToHalfBits(v[i])
                                      : kernels::cpu::FloatToBf16Bits(v[i]);
  }
  return t;
}

std::vector<float> Tensor::ToFloats() const {
  const size_t n = data.size() / DTypeBytes(dtype);
  std::vector<float> v(n);
  if (dtype == DType::kFloat32) {
    std::memcpy(v.data(), data.data(), n * 4);
    return v;
  }
  if (dtype == DType::kFloat8E4M3) {
    for (size_t i = 0; i < n; ++i) v[i] = kernels::cpu::E4m3BitsToFloat(uint8_t(data[i]));
    return v;
  }
  const auto* in = reinterpret_cast<const uint16_t*>(data.data());
  for (size_t i = 0; i < n; ++i) {
    v[i] = dtype == DType::kFloat16 ? kernels::cpu::HalfBitsToFloat(in[i])
                                    : kernels::cpu::Bf16BitsToFloat(in[i]);
  }
  return v;
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target is empty");
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("tls_cert_pem and tls_key_pem must be given together");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  // TLS when any TLS option is set; an empty CA means the system's roots.
  if (options.tls || !options.tls_ca_pem.empty() || !options.tls_cert_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  if (!options.lb_policy.empty()) {
    // A policy name is an identifier (round_robin, pick_first, ...): checked here so that it can
    // go into the JSON as it is.
    for (char c : options.lb_policy) {
      if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) ||
            c == '_')) {
        return absl::InvalidArgumentError(absl::StrCat(
            "lb_policy '", options.lb_policy, "': expected a gRPC policy name such as round_robin"));
      }
    }
  }
  if (options.retry_max_attempts < 1 || options.retry_max_attempts > 5) {
    // gRPC caps maxAttempts at 5.
    return absl::InvalidArgumentError(absl::StrCat(
        "retry_max_attempts must be 1..5 (1: no retries), got ", options.retry_max_attempts));
  }
  if (options.retry_initial_backoff.count() <= 0 ||
      options.retry_max_backoff < options.retry_initial_backoff) {
    return absl::InvalidArgumentError(
        "retry_initial_backoff must be > 0 and at most retry_max_backoff");
  }
  if (options.keepalive_time.count() < 0 || options.keepalive_timeout.count() < 0) {
    return absl::InvalidArgumentError("keepalive_time and keepalive_timeout must be >= 0");
  }
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(ServiceConfigJson(options));
  if (options.retry_max_attempts > 1) {
    args.SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE,
                static_cast<int>(std::min<int64_t>(options.retry_buffer_bytes, INT32_MAX)));
  }
  if (options.keepalive_time.count() > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(options.keepalive_time.count()));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(options.keepalive_timeout.count()));
  }
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (options.unique_channel) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  if (options.tcp_read_chunk_bytes > 0) {
    args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, options.tcp_read_chunk_bytes);
    args.SetInt(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, options.tcp_read_chunk_bytes);
    args.SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE,
                std::min(options.tcp_read_chunk_bytes, (1 << 30) / 8) * 8);
  }
  for (const auto& [name, value] : options.channel_args) args.SetInt(name, value);
  if (options.connections < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections must be >= 0 (0: ", DefaultConnections(), "), got ",
                     options.connections));
  }
  const int n = options.connections > 0 ? options.connections : DefaultConnections();
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < n; ++i) {
    grpc::ChannelArguments own = args;
    // Channels whose arguments differ do not share a connection (gRPC's subchannel pool is keyed
    // by them); a single channel keeps the arguments it always had, so that it still shares one
    // with other clients unless unique_channel asks otherwise.
    if (n > 1) own.SetInt("attn.client.connection", i);
    channels.push_back(grpc::CreateCustomChannel(options.target, creds, own));
  }
  return std::unique_ptr<Client>(new Client(options, std::move(channels)));
}

int DefaultConnections() {
  return static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 4));
}

Client::Client(ClientOptions options, std::vector<std::shared_ptr<grpc::Channel>> channels)
    : options_(std::move(options)), channels_(std::move(channels)) {
  using grpc::internal::RpcMethod;
  for (const auto& c : channels_) {
    stubs_.push_back(v1::Attention::NewStub(c));
    attend_methods_.emplace_back(kAttendMethod, RpcMethod::NORMAL_RPC, c);
    echo_methods_.emplace_back(kEchoMethod, RpcMethod::NORMAL_RPC, c);
    step_methods_.emplace_back(kStepMethod, RpcMethod::NORMAL_RPC, c);
    batch_step_methods_.emplace_back(kBatchStepMethod, RpcMethod::NORMAL_RPC, c);
    attend_stream_methods_.emplace_back(kAttendStreamMethod, RpcMethod::BIDI_STREAMING, c);
  }
}

size_t Client::NextConnection() {
  return next_stub_.fetch_add(1, std::memory_order_relaxed) % stubs_.size();
}

v1::Attention::Stub* Client::stub() { return stubs_[NextConnection()].get(); }

grpc::Status Client::CallRaw(size_t connection, const grpc::internal::RpcMethod& method,
                             grpc::ByteBuffer request, std::chrono::milliseconds timeout,
                             grpc::ByteBuffer* response) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, timeout);
  // What the generated stub's blocking methods call, here with bytes in and out.
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channels_[connection].get(), method, &ctx, request, response);
}

grpc::Status Client::CallStep(grpc::ByteBuffer request, std::chrono::milliseconds timeout,
                              grpc::ByteBuffer* response) {
  const size_t c = NextConnection();
  return CallRaw(c, step_methods_[c], std::move(request), timeout, response);
}

grpc::Status Client::CallBatchStep(grpc::ByteBuffer request, std::chrono::milliseconds timeout,
                                   grpc::ByteBuffer* response) {
  const size_t c = NextConnection();
  return CallRaw(c, batch_step_methods_[c], std::move(request), timeout, response);
}

const grpc::internal::RpcMethod& Client::RawMethodOf(RawMethod method, size_t connection) const {
  switch (method) {
    case RawMethod::kAttend: return attend_methods_[connection];
    case RawMethod::kEcho: return echo_methods_[connection];
    case RawMethod::kStep: return step_methods_[connection];
    case RawMethod::kBatchStep: break;
  }
  return batch_step_methods_[connection];
}

grpc::Status Client::CallUnary(RawMethod method, grpc::ByteBuffer request,
                               std::chrono::milliseconds timeout, grpc::ByteBuffer* response) {
  const size_t c = NextConnection();
  return CallRaw(c, RawMethodOf(method, c), std::move(request), timeout, response);
}

std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
Client::OpenRawAttendStream(grpc::ClientContext* ctx) {
  const size_t c = NextConnection();
  // What the generated stub's AttendStream does, here with bytes both ways.
  return std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channels_[c].get(), attend_stream_methods_[c], ctx));
}

void Client::StartRawCall(RawMethod method, grpc::ClientContext* ctx,
                          const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                          std::function<void(grpc::Status)> done) {
  const size_t c = NextConnection();
  const grpc::internal::RpcMethod* m = &RawMethodOf(method, c);
#if defined(__SANITIZE_THREAD__)
  // The call's context marks the hand-off to gRPC's thread that runs done (grpc_hand_off.h).
  done = [ctx, inner = std::move(done)](grpc::Status st) {
    internal::TakeBackFromGrpc(ctx);
    inner(std::move(st));
  };
  internal::HandOffToGrpc(ctx);
#endif
  // What a generated stub's callback method calls, here with bytes in and out.
  grpc::internal::CallbackUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channels_[c].get(), *m, ctx, request, response, std::move(done));
}

void Client::PrepareRawAttendStream(
    grpc::ClientContext* ctx, grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* reactor) {
  const size_t c = NextConnection();
  grpc::internal::ClientCallbackReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
      channels_[c].get(), attend_stream_methods_[c], ctx, reactor);
}

void Client::PrepareContext(grpc::ClientContext* ctx, std::chrono::milliseconds timeout) const {
  if (!options_.bearer_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
  if (timeout.count() > 0) ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  if (options_.wait_for_ready) ctx->set_wait_for_ready(true);
}

v1::AttendRequest Client::BuildAttendRequest(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttendOptions& o) {
  v1::AttendRequest r;
  ToWireTensor(q, r.mutable_q());
  ToWireTensor(k, r.mutable_k());
  ToWireTensor(v, r.mutable_v());
  r.mutable_cu_seqlens_q()->Assign(o.cu_seqlens_q.begin(), o.cu_seqlens_q.end());
  r.mutable_cu_seqlens_k()->Assign(o.cu_seqlens_k.begin(), o.cu_seqlens_k.end());
  r.set_causal(o.causal);
  r.set_softmax_scale(o.softmax_scale);
  if (o.window_left >= 0 || o.window_right >= 0) {
    r.mutable_window()->set_left(o.window_left);
    r.mutable_window()->set_right(o.window_right);
  }
  r.set_return_lse(o.return_lse);
  r.set_priority(o.high_priority ? v1::PRIORITY_HIGH : v1::PRIORITY_NORMAL);
  if (std::optional<v1::Fp8Attend> fp8 = Fp8Field(k, o)) *r.mutable_fp8() = *std::move(fp8);
  return r;
}

absl::StatusOr<AttendResult> Client::ParseAttendResponse(const v1::AttendResponse& response) {
  AttendResult result;
  auto o = FromWireTensor(response.o());
  if (!o.ok()) return o.status();
  result.o = std::move(*o);
  if (response.has_lse()) {
    auto lse = FromWireTensor(response.lse());
    if (!lse.ok()) return lse.status();
    result.lse = std::move(*lse);
  }
  result.timing = response.timing();
  return result;
}

absl::StatusOr<AttendResult> Client::Attend(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const AttendOptions& options) {
  AttendResult result;
  if (absl::Status st = Attend(q, k, v, options, &result); !st.ok()) return st;
  return result;
}

absl::Status Client::Attend(const Tensor& q, const Tensor& k, const Tensor& v,
                            const AttendOptions& options, AttendResult* result) {
  return options_.wire_coding ? AttendWire(q, k, v, options, result)
                              : AttendProto(q, k, v, options, result);
}

absl::Status Client::AttendWire(const Tensor& q, const Tensor& k, const Tensor& v,
                                const AttendOptions& options, AttendResult* result) {
  const size_t c = NextConnection();
  BorrowedSlices borrowed;
  grpc::ByteBuffer response;
  const grpc::Status st = CallRaw(c, attend_methods_[c],
                                  EncodeAttendRequest(q, k, v, options, &borrowed),
                                  options.timeout, &response);
  // The request's slices point into q, k and v: gRPC may hold them a little after the call
  // completed (a write finishing, the stream's teardown). The caller may free them on return.
  borrowed.Wait();
  if (!st.ok()) return FromGrpc(st);
  return ReadAttendResponse(&response, result);
}

absl::Status Client::AttendProto(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const AttendOptions& options, AttendResult* result) {
  const v1::AttendRequest request = BuildAttendRequest(q, k, v, options);
  v1::AttendResponse response;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, options.timeout);
  grpc::Status st = stub()->Attend(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  absl::StatusOr<AttendResult> parsed = ParseAttendResponse(response);
  if (!parsed.ok()) return parsed.status();
  *result = std::move(*parsed);
  return absl::OkStatus();
}

absl::StatusOr<v1::GetServerInfoResponse> Client::GetServerInfo() {
  v1::GetServerInfoResponse response;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, std::chrono::milliseconds(10000));
  grpc::Status st = stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &response);
  if (!st.ok()) return FromGrpc(st);
  return response;
}

absl::StatusOr<bool> Client::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel());
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, std::chrono::milliseconds(5000));
  grpc::Status st = health->Check(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<std::string> Client::Echo(std::string_view payload, int64_t response_bytes) {
  std::string out;
  if (absl::Status st = Echo(payload, response_bytes, &out); !st.ok()) return st;
  return out;
}

absl::Status Client::Echo(std::string_view payload, int64_t response_bytes, std::string* out) {
  constexpr std::chrono::milliseconds kTimeout(60000);
  if (options_.wire_coding) {
    const size_t c = NextConnection();
    BorrowedSlices borrowed;
    grpc::ByteBuffer response;
    const grpc::Status st =
        CallRaw(c, echo_methods_[c], EncodeEchoRequest(payload, response_bytes, &borrowed),
                kTimeout, &response);
    borrowed.Wait();  // as in AttendWire: payload is the caller's
    if (!st.ok()) return FromGrpc(st);
    return ReadEchoResponse(&response, out);
  }
  v1::EchoRequest request;
  request.set_payload(payload.data(), payload.size());
  request.set_response_bytes(response_bytes);
  v1::EchoResponse response;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, kTimeout);
  grpc::Status st = stub()->Echo(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  *out = std::move(*response.mutable_payload());
  return absl::OkStatus();
}

}  // namespace attn::client
