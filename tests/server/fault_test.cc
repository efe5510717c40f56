// Faults on loopback, each bounded in time: cancellation while queued and mid-stream, deadlines
// that expire in the queue and during compute, a client process killed mid-stream, SIGTERM with
// many clients and streams in flight, and request-memory exhaustion. After each fault the
// server's attn_pending_requests returns to 0, its pool gauges to their idle values, and it
// answers a good request correctly.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <future>
#include <map>
#include <thread>

#include "test_util.h"

namespace attn {
namespace {

using namespace std::chrono_literals;
using testing::MakeRandomRequest;
using testing::RequestShape;
using testing::ScrapeMetric;

// Sanitized builds (scripts/sanitize.sh sets ATTN_SANITIZER) run several times slower.
double Slowdown() {
  const char* s = std::getenv("ATTN_SANITIZER");
  if (s == nullptr || *s == '\0') return 1.0;
  return std::string(s) == "thread" ? 8.0 : 3.0;
}
std::chrono::milliseconds Scaled(std::chrono::milliseconds d) {
  return std::chrono::milliseconds(static_cast<int64_t>(d.count() * Slowdown()));
}

// The gauges that must come back to their idle values after a fault.
struct Gauges {
  double pending = 0;
  double device_used = 0, device_reserved = 0, pinned_used = 0, pinned_reserved = 0;
  bool operator==(const Gauges&) const = default;
};
Gauges ReadGauges(int port) {
  Gauges g;
  g.pending = ScrapeMetric(port, "attn_pending_requests");
  g.device_used = ScrapeMetric(port, "attn_device_pool_bytes", {"state=\"used\""});
  g.device_reserved = ScrapeMetric(port, "attn_device_pool_bytes", {"state=\"reserved\""});
  g.pinned_used = ScrapeMetric(port, "attn_pinned_pool_bytes", {"state=\"used\""});
  g.pinned_reserved = ScrapeMetric(port, "attn_pinned_pool_bytes", {"state=\"reserved\""});
  return g;
}

// Polls /metrics until the gauges equal idle (pending 0); false after timeout.
bool WaitIdle(int port, const Gauges& idle, std::chrono::milliseconds timeout = 10s) {
  const auto until = std::chrono::steady_clock::now() + Scaled(timeout);
  Gauges g;
  while (std::chrono::steady_clock::now() < until) {
    g = ReadGauges(port);
    if (g == idle) return true;
    std::this_thread::sleep_for(20ms);
  }
  ADD_FAILURE() << "not idle: pending " << g.pending << ", device used/reserved "
                << g.device_used << "/" << g.device_reserved << ", pinned used/reserved "
                << g.pinned_used << "/" << g.pinned_reserved;
  return false;
}

double Batches(int port) { return ScrapeMetric(port, "attn_compute_duration_seconds_count"); }
double Requests(int port, const char* rpc, const char* code) {
  return ScrapeMetric(port, "attn_requests_total",
                      {std::string("rpc=\"") + rpc + "\"", std::string("code=\"") + code + "\""});
}

std::unique_ptr<client::Client> ClientFor(const std::string& target) {
  client::ClientOptions o;
  o.target = target;
  return std::move(*client::Client::Create(o));
}

// A small request: 32 query tokens, 4 heads over 2, d 64, bf16.
testing::RandomRequest Small(std::mt19937_64& rng) {
  RequestShape shape;
  return MakeRandomRequest(shape, rng);
}

// A request that takes a noticeable time on the CPU backend (~0.1-0.5 s).
testing::RandomRequest Large(std::mt19937_64& rng) {
  RequestShape shape;
  // Under TSan the float64 reference of each answer is slow; the test is about bytes, not time.
  shape.seq_q = shape.seq_k = Slowdown() >= 8 ? 256 : 1024;
  shape.heads = shape.kv_heads = 4;
  return MakeRandomRequest(shape, rng);
}

void ExpectAnswered(client::Client& c, const testing::RandomRequest& r, const std::string& after) {
  auto result = c.Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(result.ok()) << "after " << after << ": " << result.status();
  EXPECT_LE(testing::ErrorAgainstReference(r, result->o), testing::ToleranceFor(r.q.dtype))
      << "after " << after;
}

// In-process server whose small requests wait max_queue_delay (2 s) in the queue, while
// requests of >= max_batch_tokens (64) tokens go at once.
class QueuedFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.max_queue_delay_us = 2'000'000;
    options.gather_when_idle = true;
    options.max_batch_tokens = 64;
    s_ = testing::StartLoopbackServer(options);
    ASSERT_NE(s_.server, nullptr);
    port_ = s_.server->metrics_port();
    ASSERT_GT(port_, 0);
    idle_ = ReadGauges(port_);
    ASSERT_EQ(idle_.pending, 0);
  }
  testing::RandomRequest Flushing() {  // 64 tokens: its batch is full at once
    RequestShape shape;
    shape.seq_q = shape.seq_k = 64;
    shape.heads = 2;
    shape.kv_heads = 1;
    return MakeRandomRequest(shape, rng_);
  }
  void ExpectRecovered(const std::string& after) {
    EXPECT_TRUE(WaitIdle(port_, idle_)) << after;
    ExpectAnswered(*s_.client, Flushing(), after);
    EXPECT_TRUE(WaitIdle(port_, idle_)) << after;
  }

  testing::LoopbackServer s_;
  int port_ = 0;
  Gauges idle_;
  std::mt19937_64 rng_{1};
};

TEST_F(QueuedFaultTest, ClientCancelsWhileQueued) {
  const double batches = Batches(port_);
  const auto r = Small(rng_);
  v1::AttendRequest request = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
  grpc::ClientContext ctx;
  v1::AttendResponse response;
  auto call = std::async(std::launch::async, [&] {
    return s_.client->stub()->Attend(&ctx, request, &response);
  });
  // Wait until it is queued, then cancel.
  const auto until = std::chrono::steady_clock::now() + Scaled(5s);
  while (ScrapeMetric(port_, "attn_pending_requests") < 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(ScrapeMetric(port_, "attn_pending_requests"), 1);
  const auto cancelled_at = std::chrono::steady_clock::now();
  ctx.TryCancel();
  ASSERT_EQ(call.wait_for(Scaled(5s)), std::future_status::ready);
  EXPECT_EQ(call.get().error_code(), grpc::StatusCode::CANCELLED);
  // The server drops it from the queue (well before its 2 s batching delay) without computing.
  EXPECT_TRUE(WaitIdle(port_, idle_, 1500ms));
  EXPECT_LT(std::chrono::steady_clock::now() - cancelled_at, Scaled(1900ms));
  EXPECT_EQ(Batches(port_), batches) << "a cancelled request was computed";
  ExpectRecovered("cancel while queued");
}

TEST_F(QueuedFaultTest, ClientCancelsMidStream) {
  grpc::ClientContext ctx;
  auto stream = s_.client->stub()->AttendStream(&ctx);
  // One item answered at once, then small items that sit in the queue.
  auto f = Flushing();
  v1::AttendRequest first = client::Client::BuildAttendRequest(f.q, f.k, f.v, f.options);
  first.set_request_id(1);
  ASSERT_TRUE(stream->Write(first));
  v1::AttendResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.status_code(), 0) << response.status_message();
  for (int i = 0; i < 10; ++i) {
    auto r = Small(rng_);
    r.options.softmax_scale = 0.1f + 0.01f * i;  // a key of its own: no batch fills up
    v1::AttendRequest req = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
    req.set_request_id(100 + i);
    ASSERT_TRUE(stream->Write(req));
  }
  const auto until = std::chrono::steady_clock::now() + Scaled(5s);
  while (ScrapeMetric(port_, "attn_pending_requests") < 10 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(ScrapeMetric(port_, "attn_pending_requests"), 10);
  const double batches = Batches(port_);
  ctx.TryCancel();
  auto finish = std::async(std::launch::async, [&] {
    while (stream->Read(&response)) {
    }
    return stream->Finish();
  });
  ASSERT_EQ(finish.wait_for(Scaled(5s)), std::future_status::ready);
  EXPECT_EQ(finish.get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitIdle(port_, idle_, 1500ms));
  EXPECT_EQ(Batches(port_), batches) << "items of a cancelled stream were computed";
  ExpectRecovered("cancel mid-stream");
}

TEST_F(QueuedFaultTest, DeadlineExpiresInQueueAndIsNotComputed) {
  const double batches = Batches(port_);
  const auto r = Small(rng_);
  auto opts = r.options;
  // Well inside the 2 s batching delay, also when scaled for sanitizers.
  opts.timeout = std::min<std::chrono::milliseconds>(Scaled(300ms), 1000ms);
  const auto start = std::chrono::steady_clock::now();
  auto result = s_.client->Attend(r.q, r.k, r.v, opts);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, Scaled(1500ms));
  EXPECT_TRUE(WaitIdle(port_, idle_, 1500ms));
  // The server saw the deadline pass (or the call cancelled by it) while queued; no batch ran.
  EXPECT_EQ(Requests(port_, "Attend", "DEADLINE_EXCEEDED") + Requests(port_, "Attend", "CANCELLED"),
            1);
  EXPECT_EQ(Batches(port_), batches) << "an expired request was computed";
  ExpectRecovered("deadline in queue");
}

// A server that starts each request at once.
class ImmediateFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.max_queue_delay_us = 0;
    s_ = testing::StartLoopbackServer(options);
    ASSERT_NE(s_.server, nullptr);
    port_ = s_.server->metrics_port();
    idle_ = ReadGauges(port_);
    ASSERT_EQ(idle_.pending, 0);
  }
  testing::LoopbackServer s_;
  int port_ = 0;
  Gauges idle_;
  std::mt19937_64 rng_{2};
};

TEST_F(ImmediateFaultTest, DeadlineExpiresDuringCompute) {
  RequestShape shape;
  shape.seq_q = shape.seq_k = 4096;
  shape.heads = shape.kv_heads = 4;
  const auto big = MakeRandomRequest(shape, rng_);
  // ~4.3 GFLOP: over a second on two idle cores of a 2020s x86 server, far more than the
  // 300 ms timeout (sanitized builds: timeout and work scaled up); with no batching delay its
  // compute starts within a few ms of arrival.
  ExpectAnswered(*s_.client, Small(rng_), "warm-up");
  ASSERT_TRUE(WaitIdle(port_, idle_));  // the warm-up's batch is counted once pending is 0
  auto opts = big.options;
  opts.timeout = Scaled(300ms);
  const double batches = Batches(port_);
  const auto start = std::chrono::steady_clock::now();
  auto result = s_.client->Attend(big.q, big.k, big.v, opts);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(result.ok()) << "answered in " << std::chrono::duration<double>(elapsed).count()
                            << " s, within its timeout";
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  EXPECT_LT(elapsed, Scaled(1500ms));  // the client was not kept waiting for the compute
  EXPECT_TRUE(WaitIdle(port_, idle_, 60s));
  // It had started computing (so the batch ran to its end and was counted) ...
  EXPECT_EQ(Batches(port_), batches + 1);
  // (attnd then finishes the call with the computed answer, which gRPC drops; the request is
  // counted under the code attnd finished it with, OK.)
  ExpectAnswered(*s_.client, Small(rng_), "deadline during compute");
  EXPECT_TRUE(WaitIdle(port_, idle_));
}

// Several large requests at once against a max_inflight_bytes that holds two of them: some get
// RESOURCE_EXHAUSTED naming the limit, the rest correct answers; the bytes all come back.
TEST(MemoryExhaustionFault, ConcurrentLargeRequestsGetResourceExhaustedOrCorrectAnswers) {
  std::mt19937_64 rng(3);
  const auto probe = Large(rng);
  // Inputs + o: what the batcher counts for one request.
  const int64_t bytes = int64_t(probe.q.data.size() * 2 + probe.k.data.size() * 2);
  ServerOptions options;
  options.max_inflight_bytes = 2 * bytes + bytes / 2;
  options.max_queue_delay_us = 200'000;  // they pile up in the queue together
  options.gather_when_idle = true;
  auto s = testing::StartLoopbackServer(options);
  ASSERT_NE(s.server, nullptr);
  const int port = s.server->metrics_port();
  const Gauges idle = ReadGauges(port);
  constexpr int kClients = 8;
  std::vector<testing::RandomRequest> requests;
  for (int i = 0; i < kClients; ++i) requests.push_back(Large(rng));
  std::atomic<int> ready{0};
  std::vector<std::future<absl::StatusOr<client::AttendResult>>> futures;
  for (int i = 0; i < kClients; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      auto c = ClientFor(s.target);
      ++ready;
      while (ready.load() < kClients) std::this_thread::yield();
      return c->Attend(requests[i].q, requests[i].k, requests[i].v, requests[i].options);
    }));
  }
  int ok = 0, exhausted = 0;
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(futures[i].wait_for(Scaled(60s)), std::future_status::ready);
    auto r = futures[i].get();
    if (r.ok()) {
      ++ok;
      EXPECT_LE(testing::ErrorAgainstReference(requests[i], r->o), 6e-3);
    } else {
      ++exhausted;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      EXPECT_NE(r.status().message().find("max_inflight_bytes"), std::string::npos)
          << r.status();
    }
  }
  EXPECT_GE(ok, 2);
  EXPECT_GE(exhausted, 1);
  EXPECT_EQ(Requests(port, "Attend", "RESOURCE_EXHAUSTED"), exhausted);
  EXPECT_TRUE(WaitIdle(port, idle));
  // All the bytes came back: two large ones fit again, one after the other.
  ExpectAnswered(*s.client, requests[0], "memory exhaustion");
  ExpectAnswered(*s.client, requests[1], "memory exhaustion");
  EXPECT_TRUE(WaitIdle(port, idle));
}

// --- A client process killed during a stream -----------------------------------------------

// The child side: run only when fault_test re-executes itself with ATTN_FAULT_STREAM_TARGET set.
// Opens an AttendStream, writes items forever, prints "streaming" once answers flow.
TEST(FaultChild, StreamForever) {
  const char* target = std::getenv("ATTN_FAULT_STREAM_TARGET");
  if (target == nullptr) GTEST_SKIP() << "only run as the child of ClientProcessKilledMidStream";
  auto c = ClientFor(target);
  grpc::ClientContext ctx;
  auto stream = c->stub()->AttendStream(&ctx);
  std::mt19937_64 rng(4);
  RequestShape shape;
  shape.seq_q = shape.seq_k = 64;  // small: the dead stream's last batch must not take long
  const auto r = MakeRandomRequest(shape, rng);
  v1::AttendRequest req = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
  std::thread writer([&] {
    for (uint64_t i = 0;; ++i) {
      req.set_request_id(i);
      if (!stream->Write(req)) return;
    }
  });
  v1::AttendResponse response;
  for (int n = 0; stream->Read(&response); ++n) {
    if (n == 2) {
      std::printf("streaming\n");
      std::fflush(stdout);
    }
  }
  writer.join();
}

TEST(ClientProcessFault, ClientKilledMidStream) {
  auto attnd = testing::AttndProcess::Start({"--max_queue_delay_us=1000"});
  ASSERT_NE(attnd, nullptr);
  const Gauges idle = ReadGauges(attnd->metrics_port());
  ASSERT_EQ(idle.pending, 0);
  for (int round = 0; round < 2; ++round) {
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    const std::string target = attnd->target();
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      dup2(pipefd[1], 1);
      close(pipefd[0]);
      setenv("ATTN_FAULT_STREAM_TARGET", target.c_str(), 1);
      execl("/proc/self/exe", "fault_test", "--gtest_filter=FaultChild.StreamForever",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    close(pipefd[1]);
    // Wait (bounded) for "streaming" from the child.
    std::string out;
    const auto until = std::chrono::steady_clock::now() + Scaled(30s);
    while (out.find("streaming") == std::string::npos && std::chrono::steady_clock::now() < until) {
      fd_set fds;
      FD_ZERO(&fds);
      FD_SET(pipefd[0], &fds);
      timeval tv{0, 100000};
      if (select(pipefd[0] + 1, &fds, nullptr, nullptr, &tv) > 0) {
        char buf[256];
        const ssize_t n = read(pipefd[0], buf, sizeof(buf));
        if (n <= 0) break;
        out.append(buf, size_t(n));
      }
    }
    close(pipefd[0]);
    EXPECT_NE(out.find("streaming"), std::string::npos) << "child output: " << out;
    std::this_thread::sleep_for(100ms);  // items queued and running at the kill
    kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    // attnd is alive, drops the dead stream's items, and serves.
    EXPECT_EQ(kill(attnd->pid(), 0), 0) << attnd->Log();
    EXPECT_TRUE(WaitIdle(attnd->metrics_port(), idle, 20s)) << "round " << round;
    std::mt19937_64 rng(5 + round);
    auto c = ClientFor(attnd->target());
    ExpectAnswered(*c, Small(rng), "client killed mid-stream");
  }
  EXPECT_GE(Requests(attnd->metrics_port(), "AttendStream", "CANCELLED"), 1);
  EXPECT_EQ(attnd->SignalAndWait(SIGTERM, 30000), 0) << attnd->Log();
}

// --- SIGTERM with many clients and streams in flight ---------------------------------------

TEST(SigtermFault, ManyClientsAndStreamsEachCompleteOrUnavailableAndExitZero) {
  // All clients share one identity (127.0.0.1): no per-client limit, this test is about SIGTERM.
  // A grace long enough for every client to see UNAVAILABLE and stop, so that the quiet rule,
  // not the cap, is what ends it (checked in the log below). The quiet period is what a client
  // answered during the drain has to send its next call in (which must still find the listener
  // open): 1 s, scaled for sanitizers, is far above a client's turnaround on a loaded machine.
  const std::string quiet_ms = std::to_string(Scaled(1000ms).count());
  auto attnd = testing::AttndProcess::Start({"--max_queue_delay_us=2000", "--drain_grace_s=120",
                                             "--drain_quiet_ms=" + quiet_ms,
                                             "--drain_timeout_s=20", "--max_pending_per_client=0"});
  ASSERT_NE(attnd, nullptr);
  const std::string target = attnd->target();
  constexpr int kUnary = 8, kStreams = 4;
  std::atomic<bool> stop{false};
  std::atomic<int> answered_before{0};
  struct Tally {
    int ok = 0, unavailable = 0, other = 0;
    int told = 0;  // clients that saw UNAVAILABLE (a unary status, a stream item or a stream's)
    std::string others;
  };
  auto unary = [&](int id) {
    Tally t;
    std::mt19937_64 rng(100 + id);
    auto c = ClientFor(target);
    RequestShape shape;
    shape.seq_q = shape.seq_k = 64 + 16 * id;
    shape.causal = id % 2;
    // Answers are checked after the loop: a client that pauses between calls longer than the
    // drain's quiet period (200 ms) could send its next call just as the listener closes.
    std::vector<std::pair<testing::RandomRequest, client::Tensor>> answers;
    while (!stop.load()) {
      auto r = MakeRandomRequest(shape, rng);
      auto opts = r.options;
      opts.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(Scaled(60s));
      auto res = c->Attend(r.q, r.k, r.v, opts);
      if (res.ok()) {
        ++t.ok;
        ++answered_before;
        answers.emplace_back(std::move(r), std::move(res->o));
      } else if (res.status().code() == absl::StatusCode::kUnavailable) {
        ++t.unavailable;
        t.told = 1;
        break;  // the server is going away; later calls would only be refused too
      } else {
        ++t.other;
        t.others += res.status().ToString() + "\n";
        break;
      }
    }
    for (const auto& [request, o] : answers) {
      EXPECT_LE(testing::ErrorAgainstReference(request, o), testing::ToleranceFor(o.dtype));
    }
    return t;
  };
  auto streaming = [&](int id) {
    Tally t;
    std::mt19937_64 rng(200 + id);
    auto c = ClientFor(target);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + Scaled(120s));
    auto stream = c->stub()->AttendStream(&ctx);
    std::map<uint64_t, testing::RandomRequest> sent;
    std::mutex mu;
    std::atomic<bool> refused{false};
    std::thread writer([&] {
      RequestShape shape;
      shape.seq_q = 64;
      shape.seq_k = 96 + 16 * id;
      for (uint64_t i = 0; !stop.load() && !refused.load(); ++i) {
        auto r = MakeRandomRequest(shape, rng);
        v1::AttendRequest req = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
        req.set_request_id(i);
        {
          std::lock_guard<std::mutex> lock(mu);
          sent.emplace(i, std::move(r));
        }
        if (!stream->Write(req)) break;
        std::this_thread::sleep_for(Scaled(20ms));  // an offered load the build can keep up with
      }
      stream->WritesDone();
    });
    v1::AttendResponse resp;
    while (stream->Read(&resp)) {
      if (resp.status_code() == 0) {
        ++t.ok;
        auto parsed = client::Client::ParseAttendResponse(resp);
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_TRUE(parsed.ok());
        if (parsed.ok()) {
          EXPECT_LE(testing::ErrorAgainstReference(sent.at(resp.request_id()), parsed->o),
                    testing::ToleranceFor(client::DType::kBFloat16));
        }
      } else if (resp.status_code() == grpc::StatusCode::UNAVAILABLE) {
        ++t.unavailable;
        t.told = 1;
        refused = true;
      } else {
        ++t.other;
        t.others += "item: " + std::to_string(resp.status_code()) + " " + resp.status_message() + "\n";
      }
    }
    writer.join();
    const grpc::Status st = stream->Finish();
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {  // ended by the drain
      ++t.unavailable;
      t.told = 1;
    } else if (!st.ok()) {
      ++t.other;
      t.others += "stream: " + std::to_string(st.error_code()) + " " + st.error_message() + "\n";
    }
    return t;
  };
  std::vector<std::future<Tally>> futures;
  for (int i = 0; i < kUnary; ++i) futures.push_back(std::async(std::launch::async, unary, i));
  for (int i = 0; i < kStreams; ++i) futures.push_back(std::async(std::launch::async, streaming, i));
  // Let traffic flow, then SIGTERM in the middle of it: with requests queued or running.
  const auto until = std::chrono::steady_clock::now() + Scaled(60s);
  while (answered_before.load() < 3 * kUnary && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GE(answered_before.load(), 3 * kUnary) << attnd->Log();
  while (!(ScrapeMetric(attnd->metrics_port(), "attn_pending_requests") >= 1) &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  const int exit_code = attnd->SignalAndWait(SIGTERM, static_cast<int>(Scaled(60s).count()));
  stop = true;
  Tally total;
  for (auto& f : futures) {
    ASSERT_EQ(f.wait_for(Scaled(60s)), std::future_status::ready) << "a client hangs";
    Tally t = f.get();
    total.ok += t.ok;
    total.unavailable += t.unavailable;
    total.other += t.other;
    total.told += t.told;
    total.others += t.others;
  }
  std::cout << "SIGTERM under load: " << total.ok << " answered, " << total.unavailable
            << " UNAVAILABLE, " << total.other << " with another outcome\n";
  EXPECT_EQ(exit_code, 0) << attnd->Log();
  EXPECT_EQ(total.other, 0) << total.others;
  EXPECT_GT(total.ok, 0);
  // Every client was told before the end: unary clients stop at their first UNAVAILABLE, stream
  // writers at their first refused item.
  EXPECT_EQ(total.told, kUnary + kStreams);
  EXPECT_NE(attnd->Log().find("closing the listener"), std::string::npos) << attnd->Log();
  EXPECT_NE(attnd->Log().find("drained"), std::string::npos) << attnd->Log();
  EXPECT_EQ(attnd->Log().find("drain grace over"), std::string::npos) << attnd->Log();
}

}  // namespace
}  // namespace attn
