// ClientOptions::connections: a client spreads its calls over that many HTTP/2 connections to one
// target (gRPC would otherwise share one connection between channels with equal arguments).
// Counted as this process's established TCP connections to attnd's port (/proc/net/tcp{,6}).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attn/client/client.h"
#include "test_util.h"

namespace attn {
namespace {

// Established connections whose remote port is `port`, from /proc/self/net/tcp and tcp6 (these
// are this network namespace's; the test owns the only client of its server).
int EstablishedTo(int port) {
  int n = 0;
  for (const char* path : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state;
      f >> slot >> local >> remote >> state;
      const size_t colon = remote.rfind(':');
      if (colon == std::string::npos || state != "01") continue;  // 01: ESTABLISHED
      if (std::stoi(remote.substr(colon + 1), nullptr, 16) == port) ++n;
    }
  }
  return n;
}

// Makes `calls` Echo calls from 4 threads through one client.
void EchoFromThreads(client::Client& c, int calls) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&c, calls] {
      for (int i = 0; i < calls / 4; ++i) {
        auto r = c.Echo(std::string(1000, 'x'));
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(r->size(), 1000u);
      }
    });
  }
  for (auto& t : threads) t.join();
}

std::unique_ptr<client::Client> ClientWith(const std::string& target, int connections) {
  client::ClientOptions o;
  o.target = target;
  o.connections = connections;
  o.unique_channel = true;  // not shared with the fixture's own client
  auto c = client::Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

TEST(ClientConnectionsTest, OneConnectionWhenAskedForOne) {
  auto s = testing::StartLoopbackServer();
  s.client.reset();  // only the client under test connects
  auto c = ClientWith(s.target, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->connections(), 1);
  EchoFromThreads(*c, 40);
  EXPECT_EQ(EstablishedTo(s.server->port()), 1);
}

TEST(ClientConnectionsTest, CallsSpreadOverEveryConnection) {
  auto s = testing::StartLoopbackServer();
  s.client.reset();
  auto c = ClientWith(s.target, 3);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->connections(), 3);
  EchoFromThreads(*c, 40);
  // Round robin: every channel has carried calls, so every one is connected.
  EXPECT_EQ(EstablishedTo(s.server->port()), 3);
}

TEST(ClientConnectionsTest, DefaultIsMinOfFourAndHardwareThreads) {
  EXPECT_EQ(client::DefaultConnections(),
            static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency()))));
  auto s = testing::StartLoopbackServer();
  s.client.reset();
  auto c = ClientWith(s.target, 0);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->connections(), client::DefaultConnections());
}

TEST(ClientConnectionsTest, NegativeConnectionsRefused) {
  client::ClientOptions o;
  o.connections = -1;
  auto c = client::Client::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("connections"), std::string::npos);
}

}  // namespace
}  // namespace attn
