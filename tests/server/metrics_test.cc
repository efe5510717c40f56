// Scrapes attnd's /metrics over HTTP and checks that the counters moved by exactly what the
// traffic implies, and that the exposition passes `promtool check metrics`.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "test_util.h"

namespace attn {
namespace {

using testing::HttpGet;
using testing::MetricValue;

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.max_queue_delay_us = 0;
    server_ = testing::StartLoopbackServer(options);
    ASSERT_NE(server_.server, nullptr);
    ASSERT_GT(server_.server->metrics_port(), 0);
  }
  std::string Scrape() { return HttpGet(server_.server->metrics_port(), "/metrics"); }

  testing::LoopbackServer server_;
  std::mt19937_64 rng_{std::random_device{}()};
};

TEST_F(MetricsTest, CountersMoveByWhatTheTrafficImplies) {
  const std::string before = Scrape();
  ASSERT_FALSE(before.empty());
  EXPECT_EQ(MetricValue(before, "attn_requests_total", {"rpc=\"Attend\""}), 0);
  EXPECT_EQ(MetricValue(before, "attn_build_info", {"backend=\"cpu\""}), 1);

  constexpr int kGood = 5, kBad = 3, kEcho = 2;
  double request_bytes = 0, response_bytes = 0;
  for (int i = 0; i < kGood + kBad; ++i) {
    testing::RequestShape shape;
    shape.seq_q = 16 + i;
    auto r = testing::MakeRandomRequest(shape, rng_);
    v1::AttendRequest request = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
    if (i >= kGood) request.mutable_q()->set_shape(2, 65);  // INVALID_ARGUMENT
    request_bytes += request.ByteSizeLong();
    v1::AttendResponse response;
    grpc::ClientContext ctx;
    const grpc::Status st = server_.client->stub()->Attend(&ctx, request, &response);
    ASSERT_EQ(st.ok(), i < kGood) << st.error_message();
    if (st.ok()) response_bytes += response.ByteSizeLong();
  }
  for (int i = 0; i < kEcho; ++i) ASSERT_TRUE(server_.client->Echo(std::string(1000, 'e')).ok());
  ASSERT_TRUE(server_.client->GetServerInfo().ok());

  const std::string after = Scrape();
  EXPECT_EQ(MetricValue(after, "attn_requests_total", {"rpc=\"Attend\"", "code=\"OK\""}), kGood);
  EXPECT_EQ(MetricValue(after, "attn_requests_total",
                        {"rpc=\"Attend\"", "code=\"INVALID_ARGUMENT\""}),
            kBad);
  EXPECT_EQ(MetricValue(after, "attn_requests_total", {"rpc=\"Echo\"", "code=\"OK\""}), kEcho);
  EXPECT_EQ(MetricValue(after, "attn_requests_total", {"rpc=\"GetServerInfo\""}), 1);
  EXPECT_EQ(MetricValue(after, "attn_request_duration_seconds_count", {"rpc=\"Attend\""}),
            kGood + kBad);
  EXPECT_EQ(MetricValue(after, "attn_received_bytes_total", {"rpc=\"Attend\""}), request_bytes);
  EXPECT_EQ(MetricValue(after, "attn_sent_bytes_total", {"rpc=\"Attend\""}), response_bytes);
  // Only valid requests are queued and computed; the warm-up request is not counted.
  EXPECT_EQ(MetricValue(after, "attn_queue_duration_seconds_count", {}), kGood);
  EXPECT_EQ(MetricValue(after, "attn_batch_requests_sum", {}), kGood);
  EXPECT_EQ(MetricValue(after, "attn_batch_tokens_sum", {}), 16 + 17 + 18 + 19 + 20);
  EXPECT_GE(MetricValue(after, "attn_compute_duration_seconds_count", {}), 1);
  EXPECT_GT(MetricValue(after, "attn_kernel_flops_per_second_count", {}), 0);
  EXPECT_EQ(MetricValue(after, "attn_pending_requests", {}), 0);
  EXPECT_EQ(MetricValue(after, "attn_max_queue_size", {}), ServerOptions().max_queue_size);
  // Histogram buckets reach from microseconds to tens of seconds.
  EXPECT_NE(after.find("attn_request_duration_seconds_bucket{rpc=\"Attend\",le=\"1e-05\"}"),
            std::string::npos);
  EXPECT_NE(after.find("le=\"20.97152\""), std::string::npos);
}

TEST_F(MetricsTest, ExpositionPassesPromtool) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  ASSERT_TRUE(server_.client->Echo("x").ok());
  const std::string text = Scrape();
  char path[] = "/tmp/attn-metrics-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  const std::string cmd = std::string("promtool check metrics < ") + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  unlink(path);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "") << out;  // no lint warnings either
}

TEST_F(MetricsTest, HealthTurnsNotServingWhileDraining) {
  ASSERT_TRUE(*server_.client->Health());
  // A request big enough to still run while the drain starts.
  testing::RequestShape shape;
  shape.seq_q = shape.seq_k = 2048;
  shape.heads = shape.kv_heads = 4;
  auto r = testing::MakeRandomRequest(shape, rng_);
  std::thread caller([&] {
    auto result = server_.client->Attend(r.q, r.k, r.v, r.options);
    EXPECT_TRUE(result.ok()) << result.status();
  });
  while (MetricValue(Scrape(), "attn_pending_requests", {}) < 1) std::this_thread::yield();
  std::thread drainer([&] { server_.server->Drain(); });
  bool saw_not_serving = false;
  for (int i = 0; i < 2000 && !saw_not_serving; ++i) {
    auto health = server_.client->Health();
    if (health.ok() && !*health) saw_not_serving = true;
    if (!health.ok()) break;  // the server has finished shutting down
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  caller.join();
  drainer.join();
  EXPECT_TRUE(saw_not_serving);
}

}  // namespace
}  // namespace attn
