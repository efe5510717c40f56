// KV-cache sessions end to end on the CPU backend, through a real gRPC server on loopback:
// every Step answer is checked against the float64 reference over the concatenated cache that
// the test keeps itself (SessionShadow), over random interleavings of sessions, layers, chunk
// sizes, BatchSteps, truncates, forks and closes, with the KV cache's free list shuffled so that
// page tables are not contiguous; then the limits, the bad ids and the bookkeeping.
#include <gtest/gtest.h>

#include <grpcpp/client_context.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <thread>

#include "attn/kernels/dtype_convert.h"
#include "sessions/kv_page_pool.h"
#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::SessionShadow;
using testing::SessionSpec;

uint64_t FreshSeed() { return std::random_device{}() | 1; }

// Small pages (8 tokens of a 256-byte row) so that short caches span many pages.
ServerOptions SmallPageOptions() {
  ServerOptions o;
  o.kv_page_tokens = 1;              // 2 KiB pages
  o.kv_cache_bytes = int64_t{8} << 20;
  o.kv_shuffle_seed = FreshSeed();
  o.replica_id = "replica-a";
  return o;
}

class SessionTest : public ::testing::Test {
 protected:
  void Start(ServerOptions o = SmallPageOptions()) {
    server_ = testing::StartLoopbackServer(o);
    ASSERT_NE(server_.server, nullptr);
    stub_ = server_.client->stub();
    if (!o.auth_token_file.empty()) return;
    v1::KvCacheInfo info;
    ASSERT_TRUE(testing::GetKvCache(stub_, &info).ok());
    total_pages_ = info.total_pages();
    ASSERT_EQ(info.free_pages(), total_pages_);
  }
  std::string Create(const SessionSpec& spec, int64_t max_tokens = 0) {
    v1::CreateSessionResponse r;
    const grpc::Status st = testing::CreateSession(stub_, spec, &r, max_tokens);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return r.session_id();
  }
  // Sends a step and checks it against shadow (appending on success).
  void StepAndCheck(SessionShadow& shadow, v1::StepRequest step) {
    v1::StepResponse response;
    const grpc::Status st = testing::Step(stub_, step, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    shadow.Append(step);
    ExpectMatches(shadow, step, response);
  }
  void ExpectMatches(const SessionShadow& shadow, const v1::StepRequest& step,
                     const v1::StepResponse& response) {
    EXPECT_EQ(response.cached_tokens(), shadow.Tokens(step.layer()));
    const auto e = shadow.Check(step, response);
    EXPECT_EQ(e.non_finite, 0);
    EXPECT_LE(e.o, testing::StepTolerance(shadow.spec().dtype))
        << "layer " << step.layer() << ", " << step.q().shape(0) << " new tokens after "
        << shadow.Tokens(step.layer()) - step.q().shape(0);
    EXPECT_LE(e.lse, 2e-5);
  }
  int64_t FreePages() {
    v1::KvCacheInfo info;
    EXPECT_TRUE(testing::GetKvCache(stub_, &info).ok());
    return info.free_pages();
  }
  grpc::Status Truncate(const std::string& id, int64_t tokens,
                        v1::TruncateSessionResponse* r = nullptr) {
    grpc::ClientContext ctx;
    v1::TruncateSessionRequest req;
    req.set_session_id(id);
    req.set_tokens(tokens);
    v1::TruncateSessionResponse local;
    return stub_->TruncateSession(&ctx, req, r ? r : &local);
  }
  grpc::Status Fork(const std::string& id, v1::ForkSessionResponse* r) {
    grpc::ClientContext ctx;
    v1::ForkSessionRequest req;
    req.set_session_id(id);
    return stub_->ForkSession(&ctx, req, r);
  }

  testing::LoopbackServer server_;
  v1::Attention::Stub* stub_ = nullptr;
  int64_t total_pages_ = 0;
  std::mt19937_64 rng_{FreshSeed()};
};

TEST_F(SessionTest, RandomInterleavingsMatchTheReference) {
  Start();
  const std::vector<SessionSpec> specs = {
      {3, 4, 2, 64, v1::DTYPE_BFLOAT16},  // GQA, 8 tokens per page
      {2, 8, 1, 64, v1::DTYPE_FLOAT16},   // MQA, 16 tokens per page
      {2, 4, 4, 32, v1::DTYPE_BFLOAT16},  // MHA, 8 tokens per page
  };
  testing::WorkloadOptions o;
  o.ops = 220;
  std::cout << testing::RunRandomSessionWorkload(stub_, specs, o, rng_) << "\n";
  EXPECT_EQ(FreePages(), total_pages_) << "pages leaked";
}

// A KV row that does not divide a page (3 KV heads, head dim 96) lives in runs of adjacent pages
// that hold whole rows: every step matches the reference through appends, forks, truncates and
// closes, and the pages come back.
TEST_F(SessionTest, RowsThatDoNotDivideAPageAreServedInRunsOfPages) {
  Start();
  const SessionSpec odd_heads{2, 6, 3, 64, v1::DTYPE_BFLOAT16};  // 384-byte rows: 3 pages, 16 rows
  const SessionSpec d96{2, 4, 1, 96, v1::DTYPE_FLOAT16};         // 192-byte rows: 3 pages, 32 rows
  for (const auto& [spec, rows] : {std::pair{odd_heads, 16}, std::pair{d96, 32}}) {
    v1::CreateSessionResponse r;
    ASSERT_TRUE(testing::CreateSession(stub_, spec, &r).ok());
    EXPECT_EQ(r.page_tokens(), rows);
    SessionShadow shadow(spec);
    const int64_t before = FreePages();
    StepAndCheck(shadow, testing::RandomStep(r.session_id(), 0, 1, spec, rng_));
    EXPECT_EQ(FreePages(), before - 3) << "one page of the table is a run of 3 pool pages";
    StepAndCheck(shadow, testing::RandomStep(r.session_id(), 0, rows, spec, rng_));
    EXPECT_EQ(FreePages(), before - 6);
    ASSERT_TRUE(testing::CloseSession(stub_, r.session_id()).ok());
    EXPECT_EQ(FreePages(), before);
  }
  testing::WorkloadOptions o;
  o.ops = 160;
  std::cout << testing::RunRandomSessionWorkload(stub_, {odd_heads, d96}, o, rng_) << "\n";
  EXPECT_EQ(FreePages(), total_pages_) << "pages leaked";
}

// Concurrent Step calls of different sessions: each is right, and they share launches.
TEST_F(SessionTest, ConcurrentStepsOfManySessionsAreCorrect) {
  Start();
  const SessionSpec spec{2, 8, 2, 64, v1::DTYPE_BFLOAT16};
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> max_batch{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(FreshSeed() + t);
      SessionShadow shadow(spec);
      const std::string id = Create(spec);
      for (int i = 0; i < 30; ++i) {
        v1::StepRequest step = testing::RandomStep(id, i % 2, i < 2 ? 40 : 1, spec, rng);
        v1::StepResponse response;
        const grpc::Status st = testing::Step(stub_, step, &response);
        ASSERT_TRUE(st.ok()) << st.error_message();
        shadow.Append(step);
        ExpectMatches(shadow, step, response);
        int seen = max_batch.load();
        while (response.timing().batch_requests() > seen &&
               !max_batch.compare_exchange_weak(seen, response.timing().batch_requests())) {
        }
      }
      ASSERT_TRUE(testing::CloseSession(stub_, id).ok());
    });
  }
  for (auto& t : threads) t.join();
  std::cout << "largest launch: " << max_batch.load() << " steps\n";
  EXPECT_EQ(FreePages(), total_pages_);
}

// BatchStep: one launch for items that share a shape; items of one (session, layer) apply in
// their order; a bad item gets its own status and the others are computed.
TEST_F(SessionTest, BatchStepItemsHaveTheirOwnStatusAndOrder) {
  Start();
  const SessionSpec spec{2, 4, 2, 64, v1::DTYPE_BFLOAT16};
  SessionShadow a(spec), b(spec);
  const std::string ida = Create(spec), idb = Create(spec);
  StepAndCheck(a, testing::RandomStep(ida, 0, 11, spec, rng_));
  v1::BatchStepRequest req;
  *req.add_steps() = testing::RandomStep(ida, 0, 3, spec, rng_);
  *req.add_steps() = testing::RandomStep(idb, 1, 1, spec, rng_);
  *req.add_steps() = testing::RandomStep(ida, 0, 1, spec, rng_);   // after item 0
  *req.add_steps() = testing::RandomStep(ida, 7, 1, spec, rng_);   // layer out of range
  *req.add_steps() = testing::RandomStep("replica-a.nope", 0, 1, spec, rng_);
  *req.add_steps() = testing::RandomStep(idb, 0, 1, spec, rng_);
  *req.add_steps() = testing::RandomStep(ida, 0, 2, spec, rng_);   // after item 2
  grpc::ClientContext ctx;
  v1::BatchStepResponse resp;
  ASSERT_TRUE(stub_->BatchStep(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.results_size(), 7);
  EXPECT_EQ(resp.results(3).status_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(resp.results(3).status_message().find("layer 7 is out of range"), std::string::npos);
  EXPECT_FALSE(resp.results(3).has_response());
  EXPECT_EQ(resp.results(4).status_code(), grpc::StatusCode::NOT_FOUND);
  const std::vector<std::pair<int, SessionShadow*>> good = {{0, &a}, {1, &b}, {2, &a}, {5, &b}, {6, &a}};
  for (const auto& [i, shadow] : good) {
    ASSERT_EQ(resp.results(i).status_code(), 0) << resp.results(i).status_message();
    shadow->Append(req.steps(i));
    ExpectMatches(*shadow, req.steps(i), resp.results(i).response());
  }
  EXPECT_EQ(resp.results(6).response().cached_tokens(), 11 + 3 + 1 + 2);
  // Items 0, 1 and 5 could start at once: they went into one launch.
  EXPECT_GE(resp.results(1).response().timing().batch_requests(), 3);
  // An empty BatchStep is answered with no results.
  grpc::ClientContext ctx2;
  v1::BatchStepResponse empty;
  ASSERT_TRUE(stub_->BatchStep(&ctx2, {}, &empty).ok());
  EXPECT_EQ(empty.results_size(), 0);
}

// Fork shares the pages; the first append into a shared partial page copies it (one page), and
// the two sessions then diverge, each matching its own history.
TEST_F(SessionTest, ForkSharesPagesAndCopiesOnWrite) {
  Start();
  const SessionSpec spec{1, 4, 2, 64, v1::DTYPE_BFLOAT16};  // 8 tokens per page
  SessionShadow parent(spec);
  const std::string pid = Create(spec);
  StepAndCheck(parent, testing::RandomStep(pid, 0, 13, spec, rng_));  // 2 pages, one partial
  const int64_t before_fork = FreePages();
  v1::ForkSessionResponse fr;
  ASSERT_TRUE(Fork(pid, &fr).ok());
  EXPECT_EQ(FreePages(), before_fork) << "a fork takes no pages";
  SessionShadow child = parent;
  StepAndCheck(child, testing::RandomStep(fr.session_id(), 0, 1, spec, rng_));
  EXPECT_EQ(FreePages(), before_fork - 1) << "the shared partial page is copied once";
  StepAndCheck(parent, testing::RandomStep(pid, 0, 2, spec, rng_));  // parent owns it alone now
  EXPECT_EQ(FreePages(), before_fork - 1);
  StepAndCheck(parent, testing::RandomStep(pid, 0, 5, spec, rng_));
  StepAndCheck(child, testing::RandomStep(fr.session_id(), 0, 9, spec, rng_));
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(testing::CloseSession(stub_, pid, &closed).ok());
  EXPECT_EQ(closed.freed_pages(), 2) << "the shared first page stays with the child";
  StepAndCheck(child, testing::RandomStep(fr.session_id(), 0, 1, spec, rng_));
  ASSERT_TRUE(testing::CloseSession(stub_, fr.session_id()).ok());
  EXPECT_EQ(FreePages(), total_pages_);
}

TEST_F(SessionTest, TruncateDropsTokensOrRefusesAndChangesNothing) {
  Start();
  const SessionSpec spec{2, 4, 2, 64, v1::DTYPE_FLOAT16};
  SessionShadow s(spec);
  const std::string id = Create(spec);
  StepAndCheck(s, testing::RandomStep(id, 0, 20, spec, rng_));
  StepAndCheck(s, testing::RandomStep(id, 1, 6, spec, rng_));
  v1::TruncateSessionResponse r;
  grpc::Status st = Truncate(id, 7, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("tokens (7) is more than layer 1"), std::string::npos)
      << st.error_message();
  st = Truncate(id, -1, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("tokens must be >= 0"), std::string::npos);
  StepAndCheck(s, testing::RandomStep(id, 0, 1, spec, rng_));  // nothing was dropped
  ASSERT_TRUE(Truncate(id, 5, &r).ok());
  s.Truncate(5);
  EXPECT_EQ(r.cached_tokens(0), 16);
  EXPECT_EQ(r.cached_tokens(1), 1);
  EXPECT_EQ(r.freed_pages(), 1);  // layer 1: 6 -> 1 token stays in its page; layer 0: 21 -> 16
  StepAndCheck(s, testing::RandomStep(id, 0, 3, spec, rng_));
  StepAndCheck(s, testing::RandomStep(id, 1, 1, spec, rng_));
  ASSERT_TRUE(Truncate(id, 0, &r).ok());
}

// A full cache refuses the step that needs more pages, naming the numbers, and leaves that
// session's cache as it was; other sessions go on.
TEST_F(SessionTest, CacheFullIsResourceExhaustedAndAFailedStepChangesNothing) {
  ServerOptions o = SmallPageOptions();
  o.kv_cache_bytes = 40 * 4096;  // 40 pages of 8 tokens
  Start(o);
  const SessionSpec spec{1, 4, 2, 64, v1::DTYPE_BFLOAT16};
  SessionShadow a(spec), b(spec);
  const std::string ida = Create(spec), idb = Create(spec);
  StepAndCheck(a, testing::RandomStep(ida, 0, 30 * 8 + 3, spec, rng_));  // 31 pages
  StepAndCheck(b, testing::RandomStep(idb, 0, 5, spec, rng_));           // 1 page
  v1::StepResponse response;
  const grpc::Status st = testing::Step(stub_, testing::RandomStep(idb, 0, 70, spec, rng_), &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("needs 9 more pages and 8 of 40 pages"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--kv_cache_bytes"), std::string::npos);
  EXPECT_EQ(FreePages(), 8);
  StepAndCheck(a, testing::RandomStep(ida, 0, 4, spec, rng_));  // fits a's partial page
  StepAndCheck(b, testing::RandomStep(idb, 0, 3, spec, rng_));  // b as if the failure never was
  ASSERT_TRUE(testing::CloseSession(stub_, ida).ok());
  StepAndCheck(b, testing::RandomStep(idb, 0, 70, spec, rng_));
  ASSERT_TRUE(testing::CloseSession(stub_, idb).ok());
  EXPECT_EQ(FreePages(), total_pages_);
}

TEST_F(SessionTest, SessionAndServerLimits) {
  ServerOptions o = SmallPageOptions();
  o.max_sessions = 2;
  o.max_session_tokens = 100;
  Start(o);
  const SessionSpec spec{1, 4, 2, 64, v1::DTYPE_BFLOAT16};
  SessionShadow s(spec);
  const std::string id = Create(spec, 10);
  v1::StepResponse response;
  grpc::Status st = testing::Step(stub_, testing::RandomStep(id, 0, 11, spec, rng_), &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  StepAndCheck(s, testing::RandomStep(id, 0, 8, spec, rng_));
  st = testing::Step(stub_, testing::RandomStep(id, 0, 3, spec, rng_), &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("holds 8 tokens; 3 more would make 11, over the session's "
                                    "limit of 10"), std::string::npos) << st.error_message();
  StepAndCheck(s, testing::RandomStep(id, 0, 2, spec, rng_));
  v1::CreateSessionResponse cr;
  st = testing::CreateSession(stub_, spec, &cr, 101);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("max_tokens must be in [0, 100]"), std::string::npos);
  ASSERT_TRUE(testing::CreateSession(stub_, spec, &cr).ok());
  EXPECT_EQ(cr.max_tokens(), 100);
  EXPECT_EQ(cr.page_tokens(), 8);
  EXPECT_EQ(cr.replica_id(), "replica-a");
  st = testing::CreateSession(stub_, spec, &cr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("--max_sessions 2"), std::string::npos) << st.error_message();
  v1::ForkSessionResponse fr;
  EXPECT_EQ(Fork(id, &fr).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(testing::CloseSession(stub_, id).ok());
  ASSERT_TRUE(testing::CreateSession(stub_, spec, &cr).ok());
}

// Unknown, closed, expired and other-replica ids each get their own answer; expiry frees the
// pages and counts an eviction.
TEST_F(SessionTest, ClosedExpiredUnknownAndForeignIds) {
  ServerOptions o = SmallPageOptions();
  o.session_ttl_s = 1.0;  // long enough that a sanitizer build closes `closed` before it expires
  Start(o);
  const SessionSpec spec{2, 4, 2, 64, v1::DTYPE_BFLOAT16};
  const std::string closed = Create(spec), idle = Create(spec);
  ASSERT_TRUE(testing::CloseSession(stub_, closed).ok());
  v1::StepResponse r;
  testing::Step(stub_, testing::RandomStep(idle, 1, 20, spec, rng_), &r);
  EXPECT_LT(FreePages(), total_pages_);
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  EXPECT_EQ(FreePages(), total_pages_) << "the idle session's pages were not freed";
  auto expect = [&](const std::string& id, grpc::StatusCode code, const std::string& part) {
    const grpc::Status st = testing::Step(stub_, testing::RandomStep(id, 0, 1, spec, rng_), &r);
    EXPECT_EQ(st.error_code(), code) << id << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(part), std::string::npos) << st.error_message();
    const grpc::Status cst = testing::CloseSession(stub_, id);
    EXPECT_EQ(cst.error_code(), code) << cst.error_message();
  };
  expect(closed, grpc::StatusCode::NOT_FOUND, "session " + closed + " was closed");
  expect(idle, grpc::StatusCode::NOT_FOUND, "session " + idle + " expired");
  expect("replica-a.0123", grpc::StatusCode::NOT_FOUND, "no session replica-a.0123 on replica");
  expect("no-dot", grpc::StatusCode::NOT_FOUND, "no session no-dot");
  expect("replica-b.77", grpc::StatusCode::FAILED_PRECONDITION,
         "session replica-b.77 belongs to replica replica-b, but this is replica replica-a");
  const double evictions = testing::ScrapeMetric(server_.server->metrics_port(),
                                                 "attn_session_evictions_total",
                                                 {"reason=\"ttl\""});
  EXPECT_EQ(evictions, 1);
}

// With bearer tokens, a session belongs to the identity that created it.
TEST_F(SessionTest, WithTokensASessionBelongsToItsCreator) {
  const std::string path = ::testing::TempDir() + "/session_tokens";
  std::ofstream(path) << "alpha-token-1234567890\nbeta-token-0987654321\n";
  ServerOptions o = SmallPageOptions();
  o.auth_token_file = path;
  Start(o);
  const SessionSpec spec{1, 4, 2, 64, v1::DTYPE_BFLOAT16};
  const std::string alpha = "alpha-token-1234567890", beta = "beta-token-0987654321";
  v1::CreateSessionResponse cr;
  ASSERT_TRUE(testing::CreateSession(stub_, spec, &cr, 0, alpha).ok());
  EXPECT_EQ(testing::CreateSession(stub_, spec, &cr, 0).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  const auto step = testing::RandomStep(cr.session_id(), 0, 4, spec, rng_);
  v1::StepResponse r;
  grpc::Status st = testing::Step(stub_, step, &r, beta);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_EQ(testing::CloseSession(stub_, cr.session_id(), nullptr, beta).error_code(),
            grpc::StatusCode::NOT_FOUND);
  SessionShadow s(spec);
  st = testing::Step(stub_, step, &r, alpha);
  ASSERT_TRUE(st.ok()) << st.error_message();
  s.Append(step);
  ExpectMatches(s, step, r);
  EXPECT_TRUE(testing::CloseSession(stub_, cr.session_id(), nullptr, alpha).ok());
}

TEST_F(SessionTest, ServerInfoAndMetricsDescribeTheCache) {
  Start();
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, {}, &info).ok());
  EXPECT_EQ(info.replica_id(), "replica-a");
  EXPECT_EQ(info.kv_cache().capacity_bytes(), int64_t{8} << 20);
  EXPECT_EQ(info.kv_cache().page_tokens(), 1);
  EXPECT_EQ(info.kv_cache().total_pages(), 2048);
  EXPECT_EQ(info.kv_cache().session_ttl_seconds(), 600);
  EXPECT_EQ(info.limits().max_sessions(), 1024);
  EXPECT_EQ(info.limits().max_session_tokens(), 131072);
  const SessionSpec spec{1, 4, 2, 64, v1::DTYPE_BFLOAT16};
  const std::string id = Create(spec);
  v1::StepResponse r;
  ASSERT_TRUE(testing::Step(stub_, testing::RandomStep(id, 0, 17, spec, rng_), &r).ok());
  ASSERT_TRUE(testing::Step(stub_, testing::RandomStep(id, 0, 1, spec, rng_), &r).ok());
  ASSERT_TRUE(Truncate(id, 1).ok());
  const std::string text = testing::HttpGet(server_.server->metrics_port(), "/metrics");
  for (const char* name : {"attn_kv_cache_usage_ratio", "attn_session_evictions_total",
                           "attn_step_tokens_per_launch_bucket",
                           "attn_decode_bandwidth_bytes_per_second_bucket", "attn_sessions"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
  EXPECT_EQ(testing::MetricValue(text, "attn_sessions", {}), 1);
  EXPECT_EQ(testing::MetricValue(text, "attn_kv_cache_pages", {"state=\"used\""}), 3);
  // Two Step calls, two launches: each phase counted once per call or launch.
  for (const char* phase : {"decode", "stage", "enqueue", "wait", "finish", "answer"}) {
    const std::string label = std::string("phase=\"") + phase + "\"";
    EXPECT_EQ(testing::MetricValue(text, "attn_step_phase_duration_seconds_count", {label}), 2)
        << phase;
  }
  // send is observed once reactor->Finish has returned, which may be after the caller heard.
  double sends = 0;
  for (int i = 0; i < 200 && sends < 2; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    sends = testing::MetricValue(testing::HttpGet(server_.server->metrics_port(), "/metrics"),
                                 "attn_step_phase_duration_seconds_count", {"phase=\"send\""});
  }
  EXPECT_EQ(sends, 2);
  for (const char* phase : {"decode", "stage"}) {
    const std::string label = std::string("phase=\"") + phase + "\"";
    EXPECT_GT(testing::MetricValue(text, "attn_step_phase_duration_seconds_sum", {label}), 0)
        << phase;
  }
  EXPECT_NEAR(testing::MetricValue(text, "attn_kv_cache_usage_ratio", {}), 3.0 / 2048, 1e-9);
  EXPECT_EQ(testing::MetricValue(text, "attn_step_tokens_per_launch_count", {}), 2);
  EXPECT_EQ(testing::MetricValue(text, "attn_decode_bandwidth_bytes_per_second_count", {}), 1);
  EXPECT_EQ(testing::MetricValue(text, "attn_requests_total",
                                 {"rpc=\"TruncateSession\"", "code=\"OK\""}), 1);
}

// Per-KV-head scales for an FP8 cache: values in [-1, 1] over scales in [lo/448, hi/448], so that
// heads with a scale below 1/448 saturate some of their elements.
std::vector<float> RandomScales(int heads, double lo, double hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<float> s(static_cast<size_t>(heads));
  for (float& x : s) x = static_cast<float>(u(rng) / 448.0);
  return s;
}

SessionSpec Fp8Spec(SessionSpec spec, std::mt19937_64& rng, bool codes = false) {
  spec.fp8_cache = true;
  spec.k_scales = RandomScales(spec.kv_heads, 0.7, 3.0, rng);
  spec.v_scales = RandomScales(spec.kv_heads, 0.7, 3.0, rng);
  spec.fp8_k_new = codes;
  return spec;
}

// Sessions with an FP8 cache through the same random interleavings (decode and chunks, BatchStep,
// truncate, fork with copy on write, close) as 16-bit ones: each answer matches the float64
// reference over the cache's dequantized values (the shadow quantizes k_new/v_new itself, with
// some heads' scales small enough to saturate), with k_new/v_new sent in 16 bits or as codes.
TEST_F(SessionTest, Fp8CacheRandomInterleavingsMatchTheReference) {
  Start();
  const std::vector<SessionSpec> specs = {
      Fp8Spec({3, 4, 2, 64, v1::DTYPE_BFLOAT16}, rng_),
      Fp8Spec({2, 8, 1, 64, v1::DTYPE_FLOAT16}, rng_, /*codes=*/true),
      Fp8Spec({2, 4, 4, 32, v1::DTYPE_BFLOAT16}, rng_),
      {2, 4, 2, 64, v1::DTYPE_BFLOAT16},  // a 16-bit session alongside
  };
  // One byte per element: twice the tokens of a 16-bit row per page.
  v1::CreateSessionResponse fp8, bf16;
  ASSERT_TRUE(testing::CreateSession(stub_, specs[0], &fp8).ok());
  ASSERT_TRUE(testing::CreateSession(stub_, specs[3], &bf16).ok());
  EXPECT_EQ(fp8.page_tokens(), 2 * bf16.page_tokens());
  EXPECT_EQ(fp8.cache_dtype(), v1::DTYPE_FLOAT8_E4M3);
  EXPECT_EQ(bf16.cache_dtype(), v1::DTYPE_BFLOAT16);
  ASSERT_TRUE(testing::CloseSession(stub_, fp8.session_id()).ok());
  ASSERT_TRUE(testing::CloseSession(stub_, bf16.session_id()).ok());
  testing::WorkloadOptions o;
  o.ops = 220;
  std::cout << testing::RunRandomSessionWorkload(stub_, specs, o, rng_) << "\n";
  EXPECT_EQ(FreePages(), total_pages_) << "pages leaked";
}

// Quantize on append: outlier channels (x20) saturate against the session's scales; the counter
// counts exactly the elements the test finds beyond +-448, and the answer matches the reference
// over the saturated cache. Also the cache's error against the unquantized inputs (printed).
TEST_F(SessionTest, Fp8CacheSaturatesOutliersAndCountsThem) {
  Start();
  SessionSpec spec{1, 8, 2, 64, v1::DTYPE_BFLOAT16};
  spec.fp8_cache = true;
  spec.k_scales = {1.0f / 448, 2.0f / 448};  // |x| beyond 1 (head 0) or 2 (head 1) saturates
  spec.v_scales = {2.0f / 448, 1.0f / 448};
  SessionSpec plain = spec;  // the same inputs, unquantized
  plain.fp8_cache = false;
  const std::string id = Create(spec);
  SessionShadow shadow(spec), exact(plain);
  const int metrics = server_.server->metrics_port();
  const double before = testing::ScrapeMetric(metrics, "attn_kv_fp8_saturations_total");
  ASSERT_EQ(before, 0);
  int64_t expected = 0;
  double err2 = 0, ref2 = 0;
  for (int n : {13, 1, 1, 5, 1}) {
    v1::StepRequest step = testing::RandomStep(id, 0, n, spec, rng_);
    for (v1::Tensor* t : {step.mutable_k_new(), step.mutable_v_new()}) {
      std::string& data = *t->mutable_data();
      uint16_t* x = reinterpret_cast<uint16_t*>(data.data());
      for (size_t i = 0; i < data.size() / 2; ++i) {
        if (i % 64 % 16 == 3) {
          x[i] = kernels::cpu::FloatToBf16Bits(20.0f * kernels::cpu::Bf16BitsToFloat(x[i]));
        }
      }
    }
    expected += testing::CountSaturations(step.k_new(), spec.k_scales) +
                testing::CountSaturations(step.v_new(), spec.v_scales);
    StepAndCheck(shadow, step);
    // The FP8 answer against the reference over the unquantized inputs.
    v1::StepResponse again;
    ASSERT_TRUE(Truncate(id, n).ok());
    ASSERT_TRUE(testing::Step(stub_, step, &again).ok());
    exact.Append(step);
    const auto e = exact.Check(step, again);
    err2 += e.o * e.o;
    ref2 += 1;
  }
  EXPECT_GT(expected, 0);
  double counted = 0;
  for (int i = 0; i < 200; ++i) {  // the batch's report lands just after the answers
    counted = testing::ScrapeMetric(metrics, "attn_kv_fp8_saturations_total");
    if (counted >= 2 * expected) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(counted, 2 * expected) << "each step ran twice (again after a truncate)";
  std::cout << "FP8 cache with x20 outlier channels: relative L2 error of o against the "
               "unquantized reference, RMS over steps: "
            << std::sqrt(err2 / ref2) << "\n";
  EXPECT_TRUE(std::isfinite(err2));
  // Without outliers, scales at the inputs' amax (1/448: nothing saturates): the cache's error.
  SessionSpec fitted = spec;
  fitted.k_scales = fitted.v_scales = {1.0f / 448, 1.0f / 448};
  SessionSpec fitted_plain = fitted;
  fitted_plain.fp8_cache = false;
  const std::string id2 = Create(fitted);
  SessionShadow quantized(fitted), unquantized(fitted_plain);
  double fit2 = 0;
  int fit_steps = 0;
  for (int n : {32, 1, 1, 1, 1}) {
    const v1::StepRequest step = testing::RandomStep(id2, 0, n, fitted, rng_);
    StepAndCheck(quantized, step);
    EXPECT_EQ(testing::CountSaturations(step.k_new(), fitted.k_scales), 0);
    // The same step again (after dropping it) against the unquantized reference.
    v1::StepResponse again;
    ASSERT_TRUE(Truncate(id2, n).ok());
    ASSERT_TRUE(testing::Step(stub_, step, &again).ok());
    unquantized.Append(step);
    const double e = unquantized.Check(step, again).o;
    fit2 += e * e;
    ++fit_steps;
  }
  std::cout << "FP8 cache, scales at amax: relative L2 error of o against the unquantized "
               "reference, RMS over steps: "
            << std::sqrt(fit2 / fit_steps) << "\n";
  EXPECT_LT(std::sqrt(fit2 / fit_steps), 0.1);
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, {}, &info).ok());
  EXPECT_TRUE(info.fp8().session_fp8_cache());
  EXPECT_EQ(info.fp8().session_fp8_max_step_tokens(), 0);
}

// Fork shares an FP8 cache's pages and copies the partial last one on write; truncate drops
// tokens of every layer; each branch keeps its own tokens.
TEST_F(SessionTest, Fp8CacheForkAndTruncate) {
  Start();
  const SessionSpec spec = Fp8Spec({2, 4, 2, 64, v1::DTYPE_FLOAT16}, rng_);
  v1::CreateSessionResponse created;
  ASSERT_TRUE(testing::CreateSession(stub_, spec, &created).ok());
  const std::string a = created.session_id();
  SessionShadow sa(spec);
  for (int layer : {0, 1}) StepAndCheck(sa, testing::RandomStep(a, layer, 21, spec, rng_));
  v1::ForkSessionResponse forked;
  ASSERT_TRUE(Fork(a, &forked).ok());
  const std::string b = forked.session_id();
  SessionShadow sb = sa;
  const int64_t shared = FreePages();
  for (int layer : {0, 1}) {
    StepAndCheck(sb, testing::RandomStep(b, layer, 1, spec, rng_));
    StepAndCheck(sa, testing::RandomStep(a, layer, 3, spec, rng_));
  }
  EXPECT_LT(FreePages(), shared) << "the shared partial pages were copied on write";
  v1::TruncateSessionResponse t;
  ASSERT_TRUE(Truncate(a, 10, &t).ok());
  sa.Truncate(10);
  EXPECT_EQ(t.cached_tokens(0), 14);
  for (int layer : {0, 1}) {
    StepAndCheck(sa, testing::RandomStep(a, layer, 2, spec, rng_));
    StepAndCheck(sb, testing::RandomStep(b, layer, 1, spec, rng_));
  }
  ASSERT_TRUE(testing::CloseSession(stub_, a).ok());
  ASSERT_TRUE(testing::CloseSession(stub_, b).ok());
  EXPECT_EQ(FreePages(), total_pages_);
}

}  // namespace
}  // namespace attn
