// The client library's wire coding (ClientOptions::wire_coding) end to end, through real attnd
// servers on loopback: one on the wire path (the default) and one that codes whole protobuf
// messages (--attend_wire_path=false). Every pairing of client coding and server path gives the
// same answers byte for byte on fresh random requests (lse, varlen, GQA, masks, windows,
// priority), the generated stub's Echo works against the raw Echo and the client's raw Echo
// against both; 64 MB messages, empty tensors, bad requests and malformed responses (from a fake
// server) each get the expected result or a clear status, and the caller may free its tensors as
// soon as a call returns, however it ended.
#include <gtest/gtest.h>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "attn/client/wire_coding.h"
#include "common/tsan_annotations.h"
#include "test_util.h"

namespace attn {
namespace {

using client::Client;
using testing::MakeRandomRequest;
using testing::RequestShape;

constexpr int64_t kMaxMessage = 256 << 20;

std::unique_ptr<Client> MakeClient(const std::string& target, bool wire_coding) {
  client::ClientOptions o;
  o.target = target;
  o.max_message_bytes = kMaxMessage;
  o.wire_coding = wire_coding;
  o.connections = 1;
  auto c = Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

class ClientWireTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions wire;
    wire.max_message_bytes = kMaxMessage;
    ServerOptions proto = wire;
    proto.attend_wire_path = false;
    servers_[0] = new testing::LoopbackServer(testing::StartLoopbackServer(wire));
    servers_[1] = new testing::LoopbackServer(testing::StartLoopbackServer(proto));
    // clients_[server][coding]: coding 0 is the wire coding, 1 protobuf's.
    for (int s = 0; s < 2; ++s) {
      for (int c = 0; c < 2; ++c) clients_[s][c] = MakeClient(servers_[s]->target, c == 0).release();
    }
  }
  static void TearDownTestSuite() {
    for (int s = 0; s < 2; ++s) {
      for (int c = 0; c < 2; ++c) delete clients_[s][c];
      delete servers_[s];
    }
  }

  static std::string Name(int server, int coding) {
    return std::string(coding == 0 ? "wire client" : "protobuf client") + " -> " +
           (server == 0 ? "wire server" : "protobuf server");
  }

  // A random request (testing::MakeRandomShapedRequest) with a priority and, on one in three, a
  // softmax scale.
  testing::RandomRequest RandomRequest() {
    testing::RandomRequest r = testing::MakeRandomShapedRequest(rng_, 60);
    r.options.high_priority = rng_() % 2;
    if (rng_() % 3 == 0) r.options.softmax_scale = 0.05f + 0.1f * static_cast<float>(rng_() % 10);
    return r;
  }

  // r through every pairing: the same status, and for a good request the same o and lse bytes,
  // within the reference's tolerance. The first pairing's result is returned.
  absl::StatusOr<client::AttendResult> ExpectSameEveryWay(const testing::RandomRequest& r,
                                                          const std::string& what) {
    const absl::StatusOr<client::AttendResult> first =
        clients_[0][0]->Attend(r.q, r.k, r.v, r.options);
    for (int s = 0; s < 2; ++s) {
      for (int c = 0; c < 2; ++c) {
        if (s == 0 && c == 0) continue;
        const auto got = clients_[s][c]->Attend(r.q, r.k, r.v, r.options);
        const std::string name = what + ", " + Name(s, c);
        EXPECT_EQ(got.status().code(), first.status().code()) << name << ": " << got.status();
        EXPECT_EQ(got.status().message(), first.status().message()) << name;
        if (!got.ok() || !first.ok()) continue;
        EXPECT_EQ(got->o.shape, first->o.shape) << name;
        EXPECT_EQ(got->o.dtype, first->o.dtype) << name;
        EXPECT_TRUE(got->o.data == first->o.data) << name << ": o differs";
        EXPECT_EQ(got->lse.has_value(), first->lse.has_value()) << name;
        if (got->lse && first->lse) {
          EXPECT_EQ(got->lse->shape, first->lse->shape) << name;
          EXPECT_TRUE(got->lse->data == first->lse->data) << name << ": lse differs";
        }
      }
    }
    // Into a result reused from call to call (poisoned first): the same answer.
    const absl::Status st = clients_[0][0]->Attend(r.q, r.k, r.v, r.options, &reused_);
    EXPECT_EQ(st.code(), first.status().code()) << what << ", into a reused result: " << st;
    if (st.ok() && first.ok()) {
      EXPECT_EQ(reused_.o.shape, first->o.shape) << what;
      EXPECT_TRUE(reused_.o.data == first->o.data) << what << ": o differs in a reused result";
      EXPECT_EQ(reused_.lse.has_value(), first->lse.has_value()) << what;
      if (reused_.lse && first->lse) EXPECT_TRUE(reused_.lse->data == first->lse->data) << what;
    }
    if (!st.ok()) Poison();
    return first;
  }

  void Poison() {
    reused_.o.data.assign(rng_() % 300000, '\xEE');
    reused_.o.shape = {7};
    reused_.lse = client::Tensor();
    reused_.lse->data.assign(rng_() % 1000, '\xEE');
  }

  static testing::LoopbackServer* servers_[2];
  static Client* clients_[2][2];
  std::mt19937_64 rng_{Seed()};
  client::AttendResult reused_;

 private:
  static uint64_t Seed() {
    const uint64_t seed = std::random_device{}();
    std::printf("random seed %llu\n", static_cast<unsigned long long>(seed));
    return seed;
  }
};
testing::LoopbackServer* ClientWireTest::servers_[2] = {};
Client* ClientWireTest::clients_[2][2] = {};

TEST_F(ClientWireTest, RandomRequestsAnsweredAlikeByEveryPairing) {
  Poison();
  for (int i = 0; i < 40; ++i) {
    const testing::RandomRequest r = RandomRequest();
    const std::string what = "request " + std::to_string(i);
    const auto got = ExpectSameEveryWay(r, what);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status();
    EXPECT_EQ(got->lse.has_value(), r.options.return_lse) << what;
    EXPECT_LE(testing::ErrorAgainstReference(r, got->o), testing::ToleranceFor(r.q.dtype)) << what;
  }
}

// Tens of MB each way: 64 MiB of q out (one borrowed slice), 64 MiB of o back (many slices).
TEST_F(ClientWireTest, SixtyFourMegabyteMessages) {
  RequestShape s;
  s.heads = s.kv_heads = 16;
  s.head_dim = 128;
  s.seq_q = 16384;  // 16384 x 16 x 128 x 2 bytes = 64 MiB
  s.seq_k = 4;      // little compute: q and o carry the bytes
  testing::RandomRequest r = MakeRandomRequest(s, rng_);
  r.options.return_lse = true;
  ASSERT_EQ(r.q.data.size(), size_t{64} << 20);
  const auto wire = clients_[0][0]->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(wire.ok()) << wire.status();
  const auto proto = clients_[1][1]->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(proto.ok()) << proto.status();
  EXPECT_TRUE(wire->o.data == proto->o.data) << "o differs between the codings";
  EXPECT_TRUE(wire->lse->data == proto->lse->data) << "lse differs between the codings";
  EXPECT_LE(testing::ErrorAgainstReference(r, wire->o), testing::ToleranceFor(r.q.dtype));

  const std::string payload(size_t{64} << 20, 'p');
  for (int s2 = 0; s2 < 2; ++s2) {
    for (int c = 0; c < 2; ++c) {
      const auto echo = clients_[s2][c]->Echo(payload);
      ASSERT_TRUE(echo.ok()) << Name(s2, c) << ": " << echo.status();
      EXPECT_TRUE(*echo == payload) << Name(s2, c);
    }
  }
}

// Empty tensors go out as protobuf writes them (no data field) and get the server's
// INVALID_ARGUMENT alike; an empty Echo payload comes back empty.
TEST_F(ClientWireTest, EmptyTensorsAndPayloads) {
  RequestShape s;
  testing::RandomRequest r = MakeRandomRequest(s, rng_);
  r.q.shape[0] = 0;
  r.q.data.clear();
  auto got = ExpectSameEveryWay(r, "empty q");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  r = MakeRandomRequest(s, rng_);
  r.k.shape.clear();
  r.k.data.clear();
  r.v = r.k;
  got = ExpectSameEveryWay(r, "k and v without shape or data");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  for (int s2 = 0; s2 < 2; ++s2) {
    for (int c = 0; c < 2; ++c) {
      const auto echo = clients_[s2][c]->Echo("");
      ASSERT_TRUE(echo.ok()) << Name(s2, c) << ": " << echo.status();
      EXPECT_TRUE(echo->empty()) << Name(s2, c);
    }
  }
}

// Requests attnd refuses get the same status whatever the coding; the next good one is answered.
TEST_F(ClientWireTest, BadRequestsGetTheSameStatusEitherWay) {
  RequestShape s;
  testing::RandomRequest r = MakeRandomRequest(s, rng_);
  r.q.data.pop_back();  // one byte short of its shape
  auto got = ExpectSameEveryWay(r, "short q");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  r = MakeRandomRequest(s, rng_);
  r.options.cu_seqlens_q = {0, 5};  // ends short of total_q
  r.options.cu_seqlens_k = {0, 5};
  got = ExpectSameEveryWay(r, "cu_seqlens");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  r = MakeRandomRequest(s, rng_);
  r.k.dtype = client::DType::kFloat32;  // not q's (and k's bytes no longer match its shape)
  got = ExpectSameEveryWay(r, "k's dtype");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  got = ExpectSameEveryWay(MakeRandomRequest(s, rng_), "a good request after them");
  EXPECT_TRUE(got.ok()) << got.status();
}

// The generated stub's Echo against both servers' Echo (raw on the wire path): every
// response_bytes case of the contract.
TEST_F(ClientWireTest, GeneratedStubEchoWorksAgainstBothServers) {
  std::string reused;
  for (int i = 0; i < 60; ++i) {
    std::string payload(rng_() % 4 == 0 ? 0 : rng_() % 100000, '\0');
    for (char& c : payload) c = static_cast<char>(rng_());
    const int64_t cases[] = {0, -1, 1, static_cast<int64_t>(payload.size()),
                             static_cast<int64_t>(payload.size()) + 10,
                             static_cast<int64_t>(rng_() % (payload.size() + 1))};
    const int64_t response_bytes = cases[rng_() % std::size(cases)];
    const std::string expected =
        response_bytes > 0 && static_cast<size_t>(response_bytes) < payload.size()
            ? payload.substr(0, static_cast<size_t>(response_bytes))
            : payload;
    for (int s = 0; s < 2; ++s) {
      v1::EchoRequest request;
      request.set_payload(payload);
      request.set_response_bytes(response_bytes);
      v1::EchoResponse response;
      grpc::ClientContext ctx;
      const grpc::Status st = clients_[s][1]->stub()->Echo(&ctx, request, &response);
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_TRUE(response.payload() == expected) << "stub -> server " << s << ", case " << i;
      for (int c = 0; c < 2; ++c) {
        const auto echo = clients_[s][c]->Echo(payload, response_bytes);
        ASSERT_TRUE(echo.ok()) << Name(s, c) << ": " << echo.status();
        EXPECT_TRUE(*echo == expected) << Name(s, c) << ", case " << i;
        // Into a string kept from the last call (poisoned): the same.
        reused.append(rng_() % 3000, '\xEE');
        const absl::Status st = clients_[s][c]->Echo(payload, response_bytes, &reused);
        ASSERT_TRUE(st.ok()) << Name(s, c) << ": " << st;
        EXPECT_TRUE(reused == expected) << Name(s, c) << ", case " << i << ", reused string";
      }
    }
  }
}

// Bytes sent to a method of server `s` as they are (a raw call).
grpc::Status RawCall(const std::string& target, const char* method, const std::string& bytes,
                     grpc::ByteBuffer* response) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::Slice slice(bytes);
  const grpc::ByteBuffer request(&slice, 1);
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), grpc::internal::RpcMethod(method, grpc::internal::RpcMethod::NORMAL_RPC),
      &ctx, request, response);
}

// A malformed EchoRequest gets INVALID_ARGUMENT naming the field from the raw Echo (and an error
// from the protobuf one); both servers go on answering.
TEST_F(ClientWireTest, MalformedEchoRequestGetsAClearStatus) {
  std::string bytes = "\x0a\x64";  // payload claims 100 bytes
  bytes += "abc";
  grpc::ByteBuffer response;
  grpc::Status st = RawCall(servers_[0]->target, client::kEchoMethod, bytes, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("EchoRequest is malformed: payload: length 100"),
            std::string::npos) << st.error_message();
  st = RawCall(servers_[1]->target, client::kEchoMethod, bytes, &response);
  EXPECT_FALSE(st.ok());
  // Fields out of order (response_bytes first) are taken as protobuf takes them.
  st = RawCall(servers_[0]->target, client::kEchoMethod, "\x10\x03\x0a\x05hello", &response);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const auto back = client::EchoPayloadFromWire(&response);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, "hel");
  for (int s = 0; s < 2; ++s) {
    const auto echo = clients_[s][0]->Echo("still here", 5);
    ASSERT_TRUE(echo.ok()) << echo.status();
    EXPECT_EQ(*echo, "still");
  }
}

// Calls that end early: their deadline passes while 32 MB are on their way, or the server
// refuses the message as too large while it is still arriving. The caller frees and overwrites
// its tensors the moment the call returns, which is safe only if nothing of gRPC still reads
// them (the sanitizer builds check that); the client then works as before.
TEST_F(ClientWireTest, TensorsMayBeFreedAsSoonAsACallReturns) {
  RequestShape s;
  s.heads = s.kv_heads = 16;
  s.head_dim = 128;
  s.seq_q = 8192;
  s.seq_k = 4;
  const auto call_and_free = [&](Client* c, std::chrono::milliseconds timeout) {
    auto r = std::make_unique<testing::RandomRequest>(MakeRandomRequest(s, rng_));
    r->options.timeout = timeout;
    const auto got = c->Attend(r->q, r->k, r->v, r->options);
    std::fill(r->q.data.begin(), r->q.data.end(), '\x5a');
    r.reset();
    return got.status();
  };
  int expired = 0;
  for (int i = 0; i < 6; ++i) {
    const absl::Status st = call_and_free(clients_[i % 2][0], std::chrono::milliseconds(1 + i));
    EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kDeadlineExceeded) << st;
    expired += st.code() == absl::StatusCode::kDeadlineExceeded;
  }
  EXPECT_GT(expired, 0) << "no call ended before its answer: the case was not exercised";

  ServerOptions small;
  small.max_message_bytes = 1 << 20;
  testing::LoopbackServer refuses = testing::StartLoopbackServer(small);
  std::unique_ptr<Client> c = MakeClient(refuses.target, true);
  for (int i = 0; i < 3; ++i) {
    const absl::Status st = call_and_free(c.get(), std::chrono::milliseconds(0));
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  }
  const auto good = ExpectSameEveryWay(MakeRandomRequest(RequestShape(), rng_), "after them");
  EXPECT_TRUE(good.ok()) << good.status();
}

// ---- Malformed responses, from a fake server ---------------------------------------------------

// Answers every call with the bytes it was given (as they are), whatever the method.
class CannedServer {
 public:
  CannedServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~CannedServer() { server_->Shutdown(); }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  void Answer(std::string bytes) { service_.Set(std::move(bytes)); }

 private:
  class Reactor : public grpc::ServerGenericBidiReactor {
   public:
    // Each reaction hands the reactor to gRPC as it ends and the next takes it back: gRPC orders
    // them, but TSan cannot see that (tsan_annotations.h).
    explicit Reactor(std::string reply) : reply_(std::move(reply)) {
      attn::HandOffToGrpc(this);
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      attn::TakeBackFromGrpc(this);
      if (!ok) {
        attn::HandOffToGrpc(this);
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, "no request"));
        return;
      }
      const grpc::Slice slice(reply_);
      response_ = grpc::ByteBuffer(&slice, 1);
      attn::HandOffToGrpc(this);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override {
      attn::TakeBackFromGrpc(this);
      delete this;
    }

   private:
    std::string reply_;
    grpc::ByteBuffer request_, response_;
  };
  class Service : public grpc::CallbackGenericService {
   public:
    void Set(std::string bytes) {
      std::lock_guard<std::mutex> lock(mu_);
      reply_ = std::move(bytes);
    }
    grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
      std::lock_guard<std::mutex> lock(mu_);
      return new Reactor(reply_);
    }

   private:
    std::mutex mu_;
    std::string reply_;
  };

  Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST(ClientWireMalformedResponses, GetInternalNamingTheFieldAndNothingElseIsHarmed) {
  CannedServer fake;
  auto wire = MakeClient(fake.target(), true);
  auto proto = MakeClient(fake.target(), false);
  std::mt19937_64 rng(7);
  RequestShape s;
  const testing::RandomRequest r = MakeRandomRequest(s, rng);

  v1::AttendResponse good;
  client::ToWireTensor(client::Tensor::FromFloats(client::DType::kBFloat16, {2, 2}, {1, 2, 3, 4}),
                       good.mutable_o());
  good.mutable_timing()->set_compute_us(12.5);
  const std::string good_bytes = good.SerializeAsString();
  struct Case {
    std::string bytes, wanted;
  };
  const Case cases[] = {
      {good_bytes.substr(0, good_bytes.size() - 3), "AttendResponse is malformed: timing"},
      {std::string("\x0a\x05\x1a\xff\xff\xff\x0f", 7), "o.data: length"},
      {good_bytes + "\x1f", "unknown wire type 7"},
      {"", "has no o"},
      {std::string("\x0a\x08\x08\x03\x12\x02\x03\x03\x1a\x00", 10), "where its shape [3, 3]"},
      {std::string("\x0a\x04\x08\x09\x1a\x00", 6), "unknown dtype 9"},
  };
  for (const Case& c : cases) {
    fake.Answer(c.bytes);
    const auto got = wire->Attend(r.q, r.k, r.v, r.options);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
    EXPECT_NE(got.status().message().find(c.wanted), std::string::npos)
        << got.status().message() << "\nwanted: " << c.wanted;
    EXPECT_FALSE(proto->Attend(r.q, r.k, r.v, r.options).ok()) << "the protobuf coding took it";
  }
  fake.Answer(good_bytes);
  for (Client* c : {wire.get(), proto.get()}) {
    const auto got = c->Attend(r.q, r.k, r.v, r.options);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->o.ToFloats(), (std::vector<float>{1, 2, 3, 4}));
    EXPECT_EQ(got->timing.compute_us(), 12.5);
  }
  fake.Answer("\x0a\x10short");
  const auto echo = wire->Echo("x");
  EXPECT_EQ(echo.status().code(), absl::StatusCode::kInternal) << echo.status();
  EXPECT_NE(echo.status().message().find("EchoResponse is malformed: payload: length 16"),
            std::string::npos) << echo.status();
  fake.Answer("\x0a\x02ok\x10\x05");  // an unknown varint after the payload: skipped
  const auto ok = wire->Echo("x");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, "ok");
}

}  // namespace
}  // namespace attn
