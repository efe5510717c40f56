// attnd as a real process on loopback, called through the client library.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <thread>

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

TEST(AttndEndToEnd, SigtermDrainsInFlightRequestsAndExitsZero) {
  auto attnd = AttndProcess::Start({"--max_queue_delay_us=0"});
  ASSERT_NE(attnd, nullptr);
  std::mt19937_64 rng(std::random_device{}());
  // Requests large enough (~0.1-0.3 s each on the CPU backend) to be in flight at SIGTERM.
  RequestShape shape;
  shape.seq_q = shape.seq_k = 1024;
  shape.heads = shape.kv_heads = 4;
  shape.head_dim = 64;
  constexpr int kClients = 6;
  std::vector<testing::RandomRequest> requests;
  for (int i = 0; i < kClients; ++i) requests.push_back(MakeRandomRequest(shape, rng));
  std::vector<std::future<absl::StatusOr<client::AttendResult>>> results;
  for (int i = 0; i < kClients; ++i) {
    results.push_back(std::async(std::launch::async, [&, i] {
      auto c = ClientFor(*attnd);
      return c->Attend(requests[i].q, requests[i].k, requests[i].v, requests[i].options);
    }));
  }
  // SIGTERM once every request has reached attnd (queued, running or answered), bounded; at
  // least one is still in flight then unless the host is very fast.
  const auto arrived = [&] {
    const int port = attnd->metrics_port();
    return testing::ScrapeMetric(port, "attn_pending_requests") +
           testing::ScrapeMetric(port, "attn_requests_total", {"rpc=\"Attend\""});
  };
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (arrived() < kClients && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const int exit_code = attnd->SignalAndWait(SIGTERM, 60000);
  int ok = 0;
  for (int i = 0; i < kClients; ++i) {
    auto r = results[i].get();  // none may hang: each completes or is refused
    if (r.ok()) {
      ++ok;
      EXPECT_LE(testing::ErrorAgainstReference(requests[i], r->o), 6e-3);
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    }
  }
  EXPECT_GT(ok, 0) << "requests in flight at SIGTERM should complete";
  EXPECT_EQ(exit_code, 0) << attnd->Log();
  EXPECT_NE(attnd->Log().find("draining"), std::string::npos);
}

}  // namespace
}  // namespace attn
