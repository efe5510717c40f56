// Client-side load balancing (ClientOptions::lb_policy): two attnd processes (CPU backend) on
// loopback, one client channel over both addresses. With round_robin both servers answer (their
// /metrics attn_requests_total count the calls); with gRPC's default (pick_first) one does.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <thread>

#include "attn/client/client.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::AttndProcess;
using testing::ScrapeMetric;

double AttendCount(const AttndProcess& p) {
  const double v = ScrapeMetric(p.metrics_port(), "attn_requests_total",
                                {"rpc=\"Attend\"", "code=\"OK\""});
  return std::isnan(v) ? -1 : v;
}

std::unique_ptr<client::Client> ClientOver(const AttndProcess& a, const AttndProcess& b,
                                           const std::string& lb_policy) {
  client::ClientOptions o;
  // gRPC's ipv4 resolver: a comma-separated list of addresses, all handed to the LB policy.
  o.target = "ipv4:127.0.0.1:" + std::to_string(a.port()) + ",127.0.0.1:" + std::to_string(b.port());
  o.lb_policy = lb_policy;
  o.unique_channel = true;
  o.wait_for_ready = true;
  auto c = client::Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

class ClientLbTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = AttndProcess::Start({"--threads=1"});
    b_ = AttndProcess::Start({"--threads=1"});
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    ASSERT_GT(a_->metrics_port(), 0);
    ASSERT_GT(b_->metrics_port(), 0);
    std::mt19937_64 rng(7);
    request_ = testing::MakeRandomRequest({}, rng);
    request_.options.timeout = std::chrono::milliseconds(30000);
  }
  void Send(client::Client& c, int n) {
    for (int i = 0; i < n; ++i) {
      auto r = c.Attend(request_.q, request_.k, request_.v, request_.options);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }

  std::unique_ptr<AttndProcess> a_, b_;
  testing::RandomRequest request_;
};

TEST_F(ClientLbTest, RoundRobinReachesBothServers) {
  auto c = ClientOver(*a_, *b_, "round_robin");
  ASSERT_NE(c, nullptr);
  // round_robin connects to every address; until the second connection is READY calls go to the
  // first. Warm up until both have answered (bounded), then count a fixed batch.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (AttendCount(*a_) < 1 || AttendCount(*b_) < 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "round_robin did not reach both servers: " << AttendCount(*a_) << " and "
        << AttendCount(*b_) << " Attend calls";
    Send(*c, 2);
  }
  const double a0 = AttendCount(*a_), b0 = AttendCount(*b_);
  constexpr int kCalls = 20;
  Send(*c, kCalls);
  const double da = AttendCount(*a_) - a0, db = AttendCount(*b_) - b0;
  EXPECT_EQ(da + db, kCalls);
  // Both subchannels READY: round_robin alternates (10 and 10); allow for a reconnect.
  EXPECT_GE(da, kCalls / 4) << "server A got " << da << " of " << kCalls;
  EXPECT_GE(db, kCalls / 4) << "server B got " << db << " of " << kCalls;
}

TEST_F(ClientLbTest, DefaultPolicyStaysOnOneServer) {
  // The control: without lb_policy gRPC's pick_first keeps one connection for every call.
  auto c = ClientOver(*a_, *b_, "");
  ASSERT_NE(c, nullptr);
  Send(*c, 10);
  const double da = AttendCount(*a_), db = AttendCount(*b_);
  EXPECT_EQ(std::max(da, 0.0) + std::max(db, 0.0), 10);
  EXPECT_TRUE(da <= 0 || db <= 0) << "pick_first spread calls: " << da << " and " << db;
}

TEST(ClientLbOptions, RejectsAMalformedPolicyName) {
  client::ClientOptions o;
  o.lb_policy = "round_robin\"}]}";
  EXPECT_FALSE(client::Client::Create(o).ok());
  o.lb_policy = "round_robin";
  EXPECT_TRUE(client::Client::Create(o).ok());
}

}  // namespace
}  // namespace attn
