// attnd as a real process on loopback, called through the client library.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/message.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "fp8_attend_check.h"
#include "common/reference.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::AttndProcess;
using testing::MakeRandomRequest;
using testing::RequestShape;

std::unique_ptr<client::Client> ClientFor(const AttndProcess& p) {
  client::ClientOptions o;
  o.target = p.target();
  return std::move(*client::Client::Create(o));
}

TEST(AttndEndToEnd, ServesInfoHealthAndCorrectAnswers) {
  auto attnd = AttndProcess::Start({});
  ASSERT_NE(attnd, nullptr);
  auto client = ClientFor(*attnd);

  auto info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->device_name().empty());
  EXPECT_GT(info->head_dims_size(), 0);
  auto health = client->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(*health);
  auto service_health = client->Health("attn.v1.Attention");
  ASSERT_TRUE(service_health.ok());
  EXPECT_TRUE(*service_health);

  std::mt19937_64 rng(std::random_device{}());
  for (client::DType dtype :
       {client::DType::kFloat32, client::DType::kFloat16, client::DType::kBFloat16}) {
    for (bool causal : {false, true}) {
      RequestShape shape;
      shape.dtype = dtype;
      shape.causal = causal;
      shape.batch = 3;
      shape.seq_q = 17;
      shape.seq_k = 45;
      shape.heads = 8;
      shape.kv_heads = 2;
      shape.head_dim = 128;
      auto r = MakeRandomRequest(shape, rng);
      r.options.return_lse = true;
      auto result = client->Attend(r.q, r.k, r.v, r.options);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_LE(testing::ErrorAgainstReference(r, result->o), testing::ToleranceFor(dtype));
      ASSERT_TRUE(result->lse.has_value());
      EXPECT_EQ(result->lse->shape, (std::vector<int64_t>{8, 3 * 17}));
      for (float x : result->lse->ToFloats()) EXPECT_TRUE(std::isfinite(x));
      EXPECT_GT(result->timing.total_us(), 0);
      EXPECT_GE(result->timing.total_us(), result->timing.compute_us());
      EXPECT_GE(result->timing.batch_requests(), 1);
    }
  }
  auto echo = client->Echo(std::string(100000, 'x'));
  ASSERT_TRUE(echo.ok());
  EXPECT_EQ(echo->size(), 100000u);
  EXPECT_EQ(attnd->SignalAndWait(SIGTERM, 20000), 0) << attnd->Log();
}

// FP8 K/V (q of a 16- or 32-bit type) and all-FP8 q/k/v through a real attnd on the CPU backend:
// o must match the float64 reference computed on exactly the values the FP8 codes and descales
// stand for, to the output type's tolerance, with descales per tensor and per (sequence, KV head).
TEST(AttndEndToEnd, Fp8AttendMatchesTheReferenceOfItsDequantizedInputs) {
  auto attnd = AttndProcess::Start({});
  ASSERT_NE(attnd, nullptr);
  auto client = ClientFor(*attnd);
  auto info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->fp8().attend_fp8_kv());
  EXPECT_TRUE(info->fp8().attend_fp8_q());

  std::mt19937_64 rng(std::random_device{}());
  for (int d : {64, 128}) {
    for (bool causal : {false, true}) {
      for (bool per_head : {false, true}) {
        for (client::DType qt : {client::DType::kFloat32, client::DType::kFloat16,
                                 client::DType::kBFloat16, client::DType::kFloat8E4M3}) {
          SCOPED_TRACE(::testing::Message() << "d " << d << " causal " << causal << " per_head "
                                          << per_head << " q " << int(qt));
          testing::Fp8AttendCase c;
          c.cu_q = testing::CuSeqlens({5, 1, 17});
          c.cu_k = testing::CuSeqlens({40, 9, 33});
          c.head_dim = d;
          c.causal = causal;
          c.per_head = per_head;
          c.q_type = qt;
          const testing::Fp8Attend a = testing::MakeFp8Attend(c, rng);
          auto result = client->Attend(a.q, a.k.codes, a.v.codes, a.options);
          ASSERT_TRUE(result.ok()) << result.status();
          EXPECT_LE(testing::Fp8AttendError(a, result->o), testing::ToleranceFor(a.out_type));
        }
      }
    }
  }
}

TEST(AttndEndToEnd, AttendStreamAnswersEveryItemAndReportsBadOnes) {
  auto attnd = AttndProcess::Start({});
  ASSERT_NE(attnd, nullptr);
  auto client = ClientFor(*attnd);
  std::mt19937_64 rng(std::random_device{}());
  grpc::ClientContext ctx;
  auto stream = client->stub()->AttendStream(&ctx);
  constexpr int kItems = 40;
  std::map<uint64_t, testing::RandomRequest> sent;
  std::thread writer([&] {
    for (int i = 0; i < kItems; ++i) {
      RequestShape shape;
      shape.seq_q = 8 + i;
      shape.seq_k = 8 + 2 * i;
      shape.causal = i % 2;
      auto r = MakeRandomRequest(shape, rng);
      v1::AttendRequest request = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
      request.set_request_id(i);
      if (i == 13) request.mutable_q()->mutable_data()->pop_back();  // a bad item midway
      sent.emplace(i, std::move(r));
      ASSERT_TRUE(stream->Write(request));
    }
    stream->WritesDone();
  });
  writer.join();
  std::map<uint64_t, v1::AttendResponse> received;
  v1::AttendResponse response;
  while (stream->Read(&response)) received[response.request_id()] = response;
  const grpc::Status st = stream->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(received.size(), size_t(kItems));
  for (auto& [id, resp] : received) {
    if (id == 13) {
      EXPECT_EQ(resp.status_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_NE(resp.status_message().find("q.data"), std::string::npos);
      continue;
    }
    ASSERT_EQ(resp.status_code(), 0) << resp.status_message();
    auto parsed = client::Client::ParseAttendResponse(resp);
    ASSERT_TRUE(parsed.ok());
    EXPECT_LE(testing::ErrorAgainstReference(sent.at(id), parsed->o),
              testing::ToleranceFor(client::DType::kBFloat16))
        << "item " << id;
  }
}

// Sends sig while requests are queued: every one of them (counted in attn_pending_requests
// when the signal goes) completes OK and correct after the signal, and attnd exits 0 after
// draining. The requests wait in the queue for batch partners (a 60 s batching delay, a token
// limit they do not reach), so the state the signal is sent in is fixed: all of them pending,
// none computed; the drain must dispatch them without waiting out the delay. The lame-duck cap
// is out of reach, so that the quiet rule ends it however slowly the requests compute.
void ExpectSignalDrainsQueuedRequests(int sig) {
  auto attnd = AttndProcess::Start({"--max_queue_delay_us=60000000", "--gather_when_idle",
                                    "--max_batch_tokens=65536",
                                    "--drain_grace_s=600"});
  ASSERT_NE(attnd, nullptr);
  std::mt19937_64 rng(std::random_device{}());
  RequestShape shape;
  shape.seq_q = shape.seq_k = 256;
  shape.heads = shape.kv_heads = 4;
  shape.head_dim = 64;
  constexpr int kClients = 6;
  using Clock = std::chrono::steady_clock;
  std::vector<testing::RandomRequest> requests;
  for (int i = 0; i < kClients; ++i) requests.push_back(MakeRandomRequest(shape, rng));
  std::vector<Clock::time_point> answered(kClients);
  std::vector<std::future<absl::StatusOr<client::AttendResult>>> results;
  for (int i = 0; i < kClients; ++i) {
    results.push_back(std::async(std::launch::async, [&, i] {
      auto c = ClientFor(*attnd);
      auto r = c->Attend(requests[i].q, requests[i].k, requests[i].v, requests[i].options);
      answered[i] = Clock::now();
      return r;
    }));
  }
  // One gauge from one scrape: a request counts once it is queued, and none can leave the queue
  // before the signal.
  const auto pending = [&] {
    return testing::ScrapeMetric(attnd->metrics_port(), "attn_pending_requests");
  };
  const auto until = Clock::now() + std::chrono::seconds(120);
  while (!(pending() == kClients) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(pending(), kClients) << "the requests did not all reach the queue:\n" << attnd->Log();
  const auto signalled = Clock::now();
  const int exit_code = attnd->SignalAndWait(sig, 120000);
  for (int i = 0; i < kClients; ++i) {
    auto r = results[i].get();  // none may hang
    ASSERT_TRUE(r.ok()) << "request " << i << " was pending when " << strsignal(sig)
                        << " was sent and must complete: " << r.status();
    EXPECT_LE(testing::ErrorAgainstReference(requests[i], r->o), 6e-3);
    EXPECT_GT(answered[i], signalled) << "request " << i << " was answered before the signal";
    EXPECT_LT(r->timing.queue_us(), 60e6) << "request " << i << " waited out the batching delay";
  }
  EXPECT_EQ(exit_code, 0) << attnd->Log();
  EXPECT_NE(attnd->Log().find("draining"), std::string::npos) << attnd->Log();
  EXPECT_NE(attnd->Log().find("closing the listener"), std::string::npos) << attnd->Log();
}

TEST(AttndEndToEnd, SigtermDrainsInFlightRequestsAndExitsZero) {
  ExpectSignalDrainsQueuedRequests(SIGTERM);
}

TEST(AttndEndToEnd, SigintDrainsInFlightRequestsAndExitsZero) {
  ExpectSignalDrainsQueuedRequests(SIGINT);
}

// Streams during a drain: an item on an open stream is refused with UNAVAILABLE, a stream
// opened during the drain is refused as a whole, and a stream the client keeps open without
// sending ends with UNAVAILABLE when the lame-duck phase ends, so that attnd exits 0 without
// waiting for --drain_timeout_s (which would end the stream CANCELLED).
TEST(AttndEndToEnd, SigtermEndsOpenStreamsWithUnavailable) {
  auto attnd = AttndProcess::Start({"--drain_quiet_ms=1000", "--drain_grace_s=600",
                                    "--drain_timeout_s=600"});
  ASSERT_NE(attnd, nullptr);
  auto client = ClientFor(*attnd);
  std::mt19937_64 rng(7);
  const auto r = MakeRandomRequest(RequestShape{}, rng);
  const v1::AttendRequest item = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
  grpc::ClientContext idle_ctx, refused_ctx;
  for (grpc::ClientContext* ctx : {&idle_ctx, &refused_ctx}) {  // a failure must not hang
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }
  auto idle = client->stub()->AttendStream(&idle_ctx);
  auto refused = client->stub()->AttendStream(&refused_ctx);
  v1::AttendResponse response;
  ASSERT_TRUE(idle->Write(item));
  ASSERT_TRUE(idle->Read(&response));
  EXPECT_EQ(response.status_code(), 0) << response.status_message();
  ASSERT_TRUE(refused->Write(item));
  ASSERT_TRUE(refused->Read(&response));
  EXPECT_EQ(response.status_code(), 0) << response.status_message();

  ASSERT_EQ(kill(attnd->pid(), SIGTERM), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (attnd->Log().find("draining:") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_NE(attnd->Log().find("draining:"), std::string::npos) << attnd->Log();
  // An item on an open stream: refused, and the stream goes on.
  ASSERT_TRUE(refused->Write(item));
  ASSERT_TRUE(refused->Read(&response));
  EXPECT_EQ(response.status_code(), grpc::StatusCode::UNAVAILABLE) << response.status_message();
  refused->WritesDone();
  EXPECT_FALSE(refused->Read(&response));
  // OK (the client closed it first), or UNAVAILABLE should the lame-duck phase end before that.
  const grpc::Status refused_status = refused->Finish();
  EXPECT_TRUE(refused_status.ok() || refused_status.error_code() == grpc::StatusCode::UNAVAILABLE)
      << refused_status.error_code() << " " << refused_status.error_message();
  // A stream opened now: refused as a whole.
  {
    grpc::ClientContext ctx;
    auto late = client->stub()->AttendStream(&ctx);
    late->Write(item);  // may fail: the server can finish the call before reading anything
    EXPECT_FALSE(late->Read(&response));
    const grpc::Status st = late->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  }
  // The idle stream ends with UNAVAILABLE once the drain has been quiet for 1 s.
  EXPECT_FALSE(idle->Read(&response));
  const grpc::Status idle_status = idle->Finish();
  EXPECT_EQ(idle_status.error_code(), grpc::StatusCode::UNAVAILABLE) << idle_status.error_message();
  EXPECT_EQ(attnd->SignalAndWait(0, 60000), 0) << attnd->Log();  // signal 0: only waits
  EXPECT_NE(attnd->Log().find("closing the listener"), std::string::npos) << attnd->Log();
}

// A second SIGINT/SIGTERM during the drain ends attnd at once with 128 + that signal. Echo calls
// keep arriving on an open channel, so that the drain stays in its grace period
// (--drain_grace_s=60) until the second signal.
TEST(AttndEndToEnd, SecondSignalDuringDrainExitsAtOnceNonZero) {
  for (auto [first, second] : {std::pair{SIGTERM, SIGINT}, std::pair{SIGINT, SIGTERM}}) {
    SCOPED_TRACE(std::string(strsignal(first)) + " then " + strsignal(second));
    auto attnd = AttndProcess::Start({"--drain_grace_s=60", "--drain_timeout_s=60"});
    ASSERT_NE(attnd, nullptr);
    auto client = ClientFor(*attnd);
    ASSERT_TRUE(client->Echo("connect").ok());  // the channel is up before the drain starts
    std::atomic<bool> stop{false};
    std::thread caller([&] {
      while (!stop.load()) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        v1::EchoRequest request;
        v1::EchoResponse response;
        client->stub()->Echo(&ctx, request, &response);  // OK (Echo is served while draining)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    ASSERT_EQ(kill(attnd->pid(), first), 0);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (attnd->Log().find("draining:") == std::string::npos &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const std::string before = attnd->Log();
    EXPECT_NE(before.find("draining:"), std::string::npos) << before;
    EXPECT_EQ(before.find("drained"), std::string::npos) << "the drain ended by itself:\n"
                                                         << before;
    const auto sent = std::chrono::steady_clock::now();
    const int exit_code = attnd->SignalAndWait(second, 5000);
    const auto took = std::chrono::steady_clock::now() - sent;
    stop = true;
    caller.join();
    EXPECT_EQ(exit_code, 128 + second) << attnd->Log();
    EXPECT_LT(took, std::chrono::seconds(2));
    EXPECT_NE(attnd->Log().find("again while draining"), std::string::npos) << attnd->Log();
  }
}

// The attnd binary under test: the one AttndProcess runs.
std::string AttndBinaryPath() {
  auto attnd = AttndProcess::Start({});
  if (attnd == nullptr) return "";
  char buf[4096];
  const ssize_t n =
      readlink(("/proc/" + std::to_string(attnd->pid()) + "/exe").c_str(), buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : "";
}

// Runs `command` in a shell; its exit status and what it printed (stdout and stderr).
std::pair<int, std::string> RunCommand(const std::string& command) {
  FILE* f = popen((command + " 2>&1").c_str(), "r");
  if (f == nullptr) return {-1, ""};
  std::string out;
  char chunk[4096];
  for (size_t n; (n = fread(chunk, 1, sizeof(chunk), f)) > 0;) out.append(chunk, n);
  return {pclose(f), out};
}

// `attnd --help` lists attnd's own flags (Abseil lists only those of the main file by default).
TEST(AttndEndToEnd, HelpListsAttndFlags) {
  const std::string path = AttndBinaryPath();
  ASSERT_FALSE(path.empty());
  const auto [status, out] = RunCommand("'" + path + "' --help");
  ASSERT_TRUE(WIFEXITED(status)) << out;  // Abseil's --help exits 1 after printing
  EXPECT_EQ(out.find("No flags matched"), std::string::npos) << out;
  for (const char* flag : {"--listen", "--metrics_listen", "--backend", "--max_message_bytes",
                           "--max_inflight_bytes", "--max_tensor_elements", "--drain_grace_s",
                           "--drain_quiet_ms", "--drain_timeout_s", "--auth_token_file",
                           "--max_pending_per_client", "--fp8_attention"}) {
    EXPECT_NE(out.find(std::string(flag) + " ("), std::string::npos) << flag << " not in:\n" << out;
  }
}

// attnd on the CPU backend with `flag` exits at start-up (not by the 60 s timeout) with a message
// holding `message`.
void ExpectStartUpFails(const std::string& flag, const std::string& message) {
  const std::string path = AttndBinaryPath();
  ASSERT_FALSE(path.empty());
  const auto [status, out] = RunCommand("timeout 60 '" + path +
                                        "' --backend=cpu --listen=127.0.0.1:0 --metrics_listen= " + flag);
  ASSERT_TRUE(WIFEXITED(status)) << flag << ": " << out;
  EXPECT_NE(WEXITSTATUS(status), 0) << flag << ": " << out;
  EXPECT_NE(WEXITSTATUS(status), 124) << "attnd started with " << flag << ":\n" << out;
  EXPECT_NE(out.find(message), std::string::npos) << flag << ": " << out;
}

// A value --fp8_attention does not know stops attnd at start-up with a message naming the flag
// (the CPU backend too, which has no FP8 kernel choice to make); tensor_cores starts it.
TEST(AttndEndToEnd, BadFp8AttentionFailsStartUpWithAMessage) {
  ExpectStartUpFails("--fp8_attention=fast", "--fp8_attention must be auto, convert or tensor_cores");
  auto attnd = AttndProcess::Start({"--fp8_attention=tensor_cores"});
  ASSERT_NE(attnd, nullptr);
  EXPECT_TRUE(ClientFor(*attnd)->GetServerInfo().ok());
}

// A step-path flag out of its range stops attnd at start-up with a message naming the flag and
// its range, on the CPU backend too (the flags are checked before a backend is chosen).
TEST(AttndEndToEnd, StepFlagsOutOfRangeFailStartUpWithAMessage) {
  ExpectStartUpFails("--step_idle_poll_us=-5", "--step_idle_poll_us must be in [0, 1000000]");
  ExpectStartUpFails("--step_idle_poll_us=1000001", "--step_idle_poll_us must be in [0, 1000000]");
  ExpectStartUpFails("--step_lanes=65", "--step_lanes must be in [0, 64]");
  ExpectStartUpFails("--batch_step_chunk=-1", "--batch_step_chunk must be >= 0");
  ExpectStartUpFails("--max_small_step_launches=-1", "max_small_step_launches must be >= 0");
}

// gRPC server reflection (what grpcurl uses) lists attn.v1.Attention and grpc.health.v1.Health.
// The request and response are built from the reflection proto's descriptors that
// grpc++_reflection (linked into attnd's server library) registers, and sent on
// ServerReflectionInfo through a generic stub.
TEST(AttndEndToEnd, ReflectionListsAttentionAndHealth) {
  auto attnd = AttndProcess::Start({});
  ASSERT_NE(attnd, nullptr);
  namespace pb = google::protobuf;
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  const pb::Descriptor* request_type =
      pool->FindMessageTypeByName("grpc.reflection.v1alpha.ServerReflectionRequest");
  const pb::Descriptor* response_type =
      pool->FindMessageTypeByName("grpc.reflection.v1alpha.ServerReflectionResponse");
  ASSERT_NE(request_type, nullptr) << "grpc++_reflection's descriptors are not linked in";
  ASSERT_NE(response_type, nullptr);
  pb::MessageFactory* factory = pb::MessageFactory::generated_factory();
  std::unique_ptr<pb::Message> request(factory->GetPrototype(request_type)->New());
  request->GetReflection()->SetString(request.get(), request_type->FindFieldByName("list_services"),
                                      "*");
  std::string request_bytes;
  ASSERT_TRUE(request->SerializeToString(&request_bytes));

  auto channel = grpc::CreateChannel(attnd->target(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  ASSERT_NE(call, nullptr);
  const auto step = [&cq](intptr_t tag) {
    void* got = nullptr;
    bool ok = false;
    return cq.Next(&got, &ok) && got == reinterpret_cast<void*>(tag) && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(step(1));
  grpc::Slice slice(request_bytes);
  call->Write(grpc::ByteBuffer(&slice, 1), reinterpret_cast<void*>(2));
  ASSERT_TRUE(step(2));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(step(3));
  grpc::ByteBuffer response_buffer;
  call->Read(&response_buffer, reinterpret_cast<void*>(4));
  ASSERT_TRUE(step(4));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  ASSERT_TRUE(step(5));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();

  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response_buffer.Dump(&slices).ok());
  std::string response_bytes;
  for (const auto& s : slices) response_bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::unique_ptr<pb::Message> response(factory->GetPrototype(response_type)->New());
  ASSERT_TRUE(response->ParseFromString(response_bytes));
  const pb::FieldDescriptor* list_field = response_type->FindFieldByName("list_services_response");
  ASSERT_TRUE(response->GetReflection()->HasField(*response, list_field))
      << response->DebugString();
  const pb::Message& list = response->GetReflection()->GetMessage(*response, list_field);
  const pb::FieldDescriptor* service_field = list.GetDescriptor()->FindFieldByName("service");
  std::set<std::string> names;
  for (int i = 0; i < list.GetReflection()->FieldSize(list, service_field); ++i) {
    const pb::Message& service = list.GetReflection()->GetRepeatedMessage(list, service_field, i);
    names.insert(service.GetReflection()->GetString(
        service, service.GetDescriptor()->FindFieldByName("name")));
  }
  EXPECT_TRUE(names.count("attn.v1.Attention")) << response->DebugString();
  EXPECT_TRUE(names.count("grpc.health.v1.Health")) << response->DebugString();
  EXPECT_EQ(attnd->SignalAndWait(SIGTERM, 20000), 0) << attnd->Log();
}

}  // namespace
}  // namespace attn
