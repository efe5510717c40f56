// The asynchronous client (attn/client/async_client.h) against real attnd servers on loopback:
// many calls in flight from one thread, each answer checked against the float64 reference;
// session steps; AttendPipeline's depth bound and bad items; cancellation and deadlines of calls
// and streams; retries of UNAVAILABLE by the channel's service config (against a fake service
// that fails on purpose); and keepalive finding a peer that stopped answering.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attn/client/async_client.h"
#include "attn/client/wire_coding.h"
#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using client::AsyncClient;
using client::AttendPipeline;
using client::AttendResult;
using client::StepResult;
using testing::MakeRandomRequest;
using testing::RequestShape;
using namespace std::chrono_literals;

std::unique_ptr<AsyncClient> MakeAsyncClient(const std::string& target,
                                             client::ClientOptions o = {}) {
  o.target = target;
  auto c = AsyncClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// A request that keeps the CPU backend busy for a good while (seconds on two cores).
testing::RandomRequest SlowRequest(std::mt19937_64& rng) {
  RequestShape s;
  s.seq_q = s.seq_k = 4096;
  s.heads = 16;
  s.kv_heads = 16;
  s.head_dim = 128;
  s.dtype = client::DType::kFloat32;
  return MakeRandomRequest(s, rng);
}

class AsyncClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new testing::LoopbackServer(testing::StartLoopbackServer());
  }
  static void TearDownTestSuite() { delete server_; }
  static testing::LoopbackServer* server_;
  std::mt19937_64 rng_{std::random_device{}()};
};
testing::LoopbackServer* AsyncClientTest::server_ = nullptr;

TEST_F(AsyncClientTest, SixtyFourAttendsInFlightFromOneThread) {
  auto client = MakeAsyncClient(server_->target);
  ASSERT_NE(client, nullptr);
  constexpr int kCalls = 64;
  std::vector<testing::RandomRequest> requests;
  for (int i = 0; i < kCalls; ++i) {
    RequestShape s;
    s.batch = 1 + i % 3;
    s.seq_q = 1 + (i * 7) % 40;
    s.seq_k = s.seq_q + i % 5;
    s.causal = i % 2 == 0;
    s.dtype = i % 3 == 0 ? client::DType::kFloat16
                         : (i % 3 == 1 ? client::DType::kBFloat16 : client::DType::kFloat32);
    requests.push_back(MakeRandomRequest(s, rng_));
  }
  std::vector<std::future<absl::StatusOr<AttendResult>>> futures;
  for (auto& r : requests) futures.push_back(client->Attend(r.q, r.k, r.v, r.options));
  EXPECT_GT(client->in_flight(), 0);
  for (int i = 0; i < kCalls; ++i) {
    absl::StatusOr<AttendResult> result = futures[i].get();
    ASSERT_TRUE(result.ok()) << "call " << i << ": " << result.status();
    EXPECT_LT(testing::ErrorAgainstReference(requests[i], result->o),
              testing::ToleranceFor(requests[i].q.dtype))
        << "call " << i;
  }
}

TEST_F(AsyncClientTest, CallbackMayFreeTheTensorsAndBadRequestsGetTheirStatus) {
  auto client = MakeAsyncClient(server_->target);
  ASSERT_NE(client, nullptr);
  RequestShape s;
  auto owned = std::make_shared<testing::RandomRequest>(MakeRandomRequest(s, rng_));
  const testing::RandomRequest copy = *owned;
  std::promise<absl::StatusOr<AttendResult>> got;
  // The callback frees the tensors the call borrowed: gRPC must be done with them by then
  // (AddressSanitizer builds would see a late read).
  client->Attend(owned->q, owned->k, owned->v, owned->options,
                 [&got, owned](absl::StatusOr<AttendResult> r) mutable {
                   owned.reset();
                   got.set_value(std::move(r));
                 });
  owned.reset();
  absl::StatusOr<AttendResult> result = got.get_future().get();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(testing::ErrorAgainstReference(copy, result->o), testing::ToleranceFor(copy.q.dtype));

  testing::RandomRequest bad = MakeRandomRequest(s, rng_);
  bad.k.shape[2] = 32;  // head dim of k differs from q's
  bad.k.data.resize(bad.k.data.size() / 2);
  bad.v = bad.k;
  absl::StatusOr<AttendResult> refused = client->Attend(bad.q, bad.k, bad.v, bad.options).get();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("head"), std::string::npos) << refused.status();
}

TEST_F(AsyncClientTest, CancelledAndLateCallsEndWithTheirCodeAndTheServerGoesOn) {
  auto client = MakeAsyncClient(server_->target);
  ASSERT_NE(client, nullptr);
  const testing::RandomRequest slow = SlowRequest(rng_);
  std::promise<absl::StatusOr<AttendResult>> cancelled;
  client::AsyncCall call = client->Attend(slow.q, slow.k, slow.v, slow.options,
                                          [&](absl::StatusOr<AttendResult> r) {
                                            cancelled.set_value(std::move(r));
                                          });
  std::this_thread::sleep_for(50ms);
  const auto t0 = std::chrono::steady_clock::now();
  call.Cancel();
  absl::StatusOr<AttendResult> r = cancelled.get_future().get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << "the cancellation took effect late";

  client::AttendOptions late = slow.options;
  late.timeout = 20ms;
  absl::StatusOr<AttendResult> expired = client->Attend(slow.q, slow.k, slow.v, late).get();
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kDeadlineExceeded) << expired.status();

  RequestShape s;
  testing::RandomRequest next = MakeRandomRequest(s, rng_);
  absl::StatusOr<AttendResult> ok = client->Attend(next.q, next.k, next.v, next.options).get();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_LT(testing::ErrorAgainstReference(next, ok->o), testing::ToleranceFor(next.q.dtype));
}

client::StepInput ToStepInput(const v1::StepRequest& r) {
  client::StepInput in;
  in.session_id = r.session_id();
  in.layer = r.layer();
  in.q = *client::FromWireTensor(r.q());
  in.k_new = *client::FromWireTensor(r.k_new());
  in.v_new = *client::FromWireTensor(r.v_new());
  in.options.return_lse = r.return_lse();
  return in;
}

v1::StepResponse ToStepResponse(const StepResult& r) {
  v1::StepResponse out;
  client::ToWireTensor(r.o, out.mutable_o());
  if (r.lse) client::ToWireTensor(*r.lse, out.mutable_lse());
  out.set_cached_tokens(r.cached_tokens);
  return out;
}

TEST_F(AsyncClientTest, StepsAndBatchStepsMatchTheReferenceOverTheWholeCache) {
  auto client = MakeAsyncClient(server_->target);
  ASSERT_NE(client, nullptr);
  testing::SessionSpec spec;
  spec.layers = 2;
  std::vector<std::string> ids;
  std::vector<testing::SessionShadow> shadows;
  for (int i = 0; i < 3; ++i) {
    v1::CreateSessionResponse created;
    ASSERT_TRUE(testing::CreateSession(server_->client->stub(), spec, &created).ok());
    ids.push_back(created.session_id());
    shadows.emplace_back(spec);
  }
  // Prefill chunks as single steps, every session's layers in flight at once; then decode
  // tokens as BatchSteps of every (session, layer).
  std::vector<v1::StepRequest> requests;
  std::vector<std::future<absl::StatusOr<StepResult>>> futures;
  for (int i = 0; i < 3; ++i) {
    for (int layer = 0; layer < spec.layers; ++layer) {
      requests.push_back(testing::RandomStep(ids[i], layer, 9 + i, spec, rng_));
      requests.back().set_return_lse(true);
      futures.push_back(client->Step(ToStepInput(requests.back())));
    }
  }
  for (size_t j = 0; j < futures.size(); ++j) {
    absl::StatusOr<StepResult> r = futures[j].get();
    ASSERT_TRUE(r.ok()) << r.status();
    testing::SessionShadow& shadow = shadows[j / spec.layers];
    shadow.Append(requests[j]);
    const auto err = shadow.Check(requests[j], ToStepResponse(*r));
    EXPECT_LT(err.o, testing::StepTolerance(spec.dtype));
    EXPECT_EQ(err.non_finite, 0);
  }
  for (int token = 0; token < 3; ++token) {
    std::vector<v1::StepRequest> batch;
    std::vector<client::StepInput> inputs;
    for (int i = 0; i < 3; ++i) {
      for (int layer = 0; layer < spec.layers; ++layer) {
        batch.push_back(testing::RandomStep(ids[i], layer, 1, spec, rng_));
        inputs.push_back(ToStepInput(batch.back()));
      }
    }
    std::promise<absl::StatusOr<AsyncClient::BatchStepResults>> got;
    client->BatchStep(inputs, 10s, [&](absl::StatusOr<AsyncClient::BatchStepResults> r) {
      got.set_value(std::move(r));
    });
    absl::StatusOr<AsyncClient::BatchStepResults> results = got.get_future().get();
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), batch.size());
    for (size_t j = 0; j < batch.size(); ++j) {
      ASSERT_TRUE((*results)[j].ok()) << (*results)[j].status();
      testing::SessionShadow& shadow = shadows[j / spec.layers];
      shadow.Append(batch[j]);
      EXPECT_LT(shadow.Check(batch[j], ToStepResponse(*(*results)[j])).o,
                testing::StepTolerance(spec.dtype));
    }
  }
  // A step on a session that does not exist: NOT_FOUND through the callback.
  client::StepInput unknown = ToStepInput(testing::RandomStep(ids[0], 0, 1, spec, rng_));
  unknown.session_id = ids[0].substr(0, ids[0].find('.')) + ".0123456789abcdef0123456789abcdef";
  EXPECT_EQ(client->Step(unknown).get().status().code(), absl::StatusCode::kNotFound);
  for (const std::string& id : ids) {
    EXPECT_TRUE(testing::CloseSession(server_->client->stub(), id).ok());
  }
}

TEST_F(AsyncClientTest, PipelineKeepsAtMostDepthInFlightAndAnswersEveryItem) {
  auto client = MakeAsyncClient(server_->target);
  ASSERT_NE(client, nullptr);
  AttendPipeline::Options o;
  o.depth = 4;
  auto pipeline = AttendPipeline::Open(*client, o);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  constexpr int kItems = 40;
  std::vector<testing::RandomRequest> requests;
  for (int i = 0; i < kItems; ++i) {
    RequestShape s;
    s.seq_q = 8 + i;
    s.seq_k = 8 + 2 * i;
    s.causal = i % 3 == 0;
    requests.push_back(MakeRandomRequest(s, rng_));
  }
  const int bad = 17;
  requests[bad].v.data.resize(requests[bad].v.data.size() - 2);  // v shorter than its shape
  std::vector<absl::StatusOr<AttendResult>> results(kItems, absl::UnknownError("no answer"));
  std::atomic<int> answered{0};
  int most_in_flight = 0;
  for (int i = 0; i < kItems; ++i) {
    const testing::RandomRequest& r = requests[i];
    ASSERT_TRUE((*pipeline)
                    ->Submit(r.q, r.k, r.v, r.options,
                             [&, i](absl::StatusOr<AttendResult> result) {
                               results[i] = std::move(result);
                               answered.fetch_add(1);
                             })
                    .ok());
    most_in_flight = std::max(most_in_flight, (*pipeline)->in_flight());
  }
  EXPECT_TRUE((*pipeline)->Finish().ok());
  EXPECT_EQ(answered.load(), kItems);
  EXPECT_LE(most_in_flight, o.depth);
  for (int i = 0; i < kItems; ++i) {
    if (i == bad) {
      EXPECT_EQ(results[i].status().code(), absl::StatusCode::kInvalidArgument)
          << results[i].status();
      continue;
    }
    ASSERT_TRUE(results[i].ok()) << "item " << i << ": " << results[i].status();
    EXPECT_LT(testing::ErrorAgainstReference(requests[i], results[i]->o),
              testing::ToleranceFor(requests[i].q.dtype));
  }
  const testing::RandomRequest& r = requests[0];
  EXPECT_EQ((*pipeline)->Submit(r.q, r.k, r.v, r.options, [](auto) {}).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(AsyncClientTest, CancelledPipelineFailsItsItemsInFlight) {
  auto client = MakeAsyncClient(server_->target);
  ASSERT_NE(client, nullptr);
  auto pipeline = AttendPipeline::Open(*client, {});
  ASSERT_TRUE(pipeline.ok());
  const testing::RandomRequest slow = SlowRequest(rng_);
  std::promise<absl::Status> got;
  ASSERT_TRUE((*pipeline)
                  ->Submit(slow.q, slow.k, slow.v, slow.options,
                           [&](absl::StatusOr<AttendResult> r) { got.set_value(r.status()); })
                  .ok());
  std::this_thread::sleep_for(50ms);
  (*pipeline)->Cancel();
  EXPECT_EQ(got.get_future().get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ((*pipeline)->Finish().code(), absl::StatusCode::kCancelled);
}

// A service whose Echo fails with UNAVAILABLE a given number of times before it answers, and
// whose Step always fails so: what the client's retry policy does with each.
class FlakyService final : public v1::Attention::Service {
 public:
  explicit FlakyService(int failures) : failures_(failures) {}
  grpc::Status Echo(grpc::ServerContext*, const v1::EchoRequest* request,
                    v1::EchoResponse* response) override {
    if (echo_calls_.fetch_add(1) < failures_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "restarting");
    }
    response->set_payload(request->payload());
    return grpc::Status::OK;
  }
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest*, v1::StepResponse*) override {
    step_calls_.fetch_add(1);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "restarting");
  }
  std::atomic<int> echo_calls_{0}, step_calls_{0};

 private:
  const int failures_;
};

TEST(AsyncClientRetry, IdempotentCallsAreRetriedOnUnavailableAndStepsNever) {
  FlakyService service(2);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string target = "127.0.0.1:" + std::to_string(port);

  auto client = MakeAsyncClient(target);  // default: 3 attempts
  std::promise<absl::StatusOr<std::string>> echoed;
  client->Echo("payload", [&](absl::StatusOr<std::string> r) { echoed.set_value(std::move(r)); });
  absl::StatusOr<std::string> payload = echoed.get_future().get();
  ASSERT_TRUE(payload.ok()) << payload.status();
  EXPECT_EQ(*payload, "payload");
  EXPECT_EQ(service.echo_calls_.load(), 3);

  client::StepInput in;
  in.session_id = "r1.00";
  in.q = client::Tensor::FromFloats(client::DType::kBFloat16, {1, 1, 8}, std::vector<float>(8, 1));
  in.k_new = in.v_new = in.q;
  EXPECT_EQ(client->Step(in).get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(service.step_calls_.load(), 1) << "a step was sent more than once";

  client::ClientOptions no_retry;
  no_retry.retry_max_attempts = 1;
  service.echo_calls_ = 0;
  auto plain = MakeAsyncClient(target, no_retry);
  std::promise<absl::StatusOr<std::string>> failed;
  plain->Echo("x", [&](absl::StatusOr<std::string> r) { failed.set_value(std::move(r)); });
  EXPECT_EQ(failed.get_future().get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(service.echo_calls_.load(), 1);

  client::ClientOptions bad;
  bad.target = target;
  bad.retry_max_attempts = 9;
  EXPECT_EQ(AsyncClient::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  server->Shutdown();
}

// kill() only queues SIGSTOP: a thread of the target still running on another core can answer a
// request sent right after it. Returns once every thread of `pid` is in the stopped state.
bool WaitUntilStopped(pid_t pid, std::chrono::milliseconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  while (std::chrono::steady_clock::now() < give_up) {
    bool all_stopped = true;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // The state is the first field after the parenthesised command name.
      const size_t close = line.rfind(')');
      if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') {
        all_stopped = false;
        break;
      }
    }
    if (!ec && all_stopped) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

TEST(AsyncClientKeepalive, ACallToAPeerThatStoppedAnsweringFailsLongBeforeItsDeadline) {
  auto attnd = testing::AttndProcess::Start({"--backend=cpu"});
  ASSERT_NE(attnd, nullptr);
  client::ClientOptions o;
  o.keepalive_time = 500ms;
  o.keepalive_timeout = 500ms;
  o.connections = 1;
  o.retry_max_attempts = 1;  // a retry would wait on a connection attempt to the stopped peer
  auto client = MakeAsyncClient(attnd->target(), o);
  std::mt19937_64 rng(7);
  RequestShape s;
  testing::RandomRequest r = MakeRandomRequest(s, rng);
  ASSERT_TRUE(client->Attend(r.q, r.k, r.v, r.options).get().ok());
  // The process stays, its socket open, but nothing answers: only the pings can tell.
  ASSERT_EQ(kill(attnd->pid(), SIGSTOP), 0);
  ASSERT_TRUE(WaitUntilStopped(attnd->pid(), 10s)) << "attnd did not stop";
  client::AttendOptions patient = r.options;
  patient.timeout = 60s;
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<AttendResult> lost = client->Attend(r.q, r.k, r.v, patient).get();
  const auto took = std::chrono::steady_clock::now() - t0;
  kill(attnd->pid(), SIGCONT);
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
  EXPECT_LT(took, 15s);
}

}  // namespace
}  // namespace attn
