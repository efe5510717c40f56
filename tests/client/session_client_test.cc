// SessionClient's placement and routing against small fake attn.v1 servers on loopback: each fake
// is one "replica" that reports the free KV pages the test sets, makes session ids
// "<replica_id>.<n>", and refuses (FAILED_PRECONDITION) a call on a session of another replica, so
// a call routed to the wrong replica fails the test. The same behaviour against two real attnd
// processes: tests/server/session_replicas_test.cc.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "attn/client/session.h"

namespace attn::client {
namespace {

using ::grpc::ServerContext;
using ::grpc::Status;
using ::grpc::StatusCode;

// One fake replica. o = q, so a result shows which request it answers.
class FakeReplica final : public v1::Attention::Service {
 public:
  explicit FakeReplica(std::string id) : id_(std::move(id)) {}

  void set_free_pages(int64_t n) { free_pages_ = n; }
  void set_max_sessions(int64_t n) { max_sessions_ = n; }
  // GetServerInfo without the replica id (as a server that does not fill it in).
  void set_hide_id(bool hide) { hide_id_ = hide; }
  void set_replica_id(std::string id) {
    std::lock_guard<std::mutex> lock(mu_);
    id_ = std::move(id);
  }
  std::string replica_id() const {
    std::lock_guard<std::mutex> lock(mu_);
    return id_;
  }
  int calls(const std::string& rpc) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(rpc);
    return it == calls_.end() ? 0 : it->second;
  }

  Status GetServerInfo(ServerContext*, const v1::GetServerInfoRequest*,
                       v1::GetServerInfoResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["GetServerInfo"];
    if (!hide_id_) r->set_replica_id(id_);
    r->mutable_kv_cache()->set_free_pages(free_pages_);
    r->mutable_kv_cache()->set_total_pages(1000);
    r->mutable_kv_cache()->set_sessions(static_cast<int64_t>(tokens_.size()));
    return Status::OK;
  }
  Status CreateSession(ServerContext*, const v1::CreateSessionRequest* req,
                       v1::CreateSessionResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["CreateSession"];
    if (max_sessions_ >= 0 && static_cast<int64_t>(tokens_.size()) >= max_sessions_) {
      return Status(StatusCode::RESOURCE_EXHAUSTED, "max_sessions reached on " + id_);
    }
    const std::string sid = id_ + "." + std::to_string(next_++);
    tokens_[sid] = std::vector<int64_t>(req->num_layers(), 0);
    r->set_session_id(sid);
    r->set_replica_id(id_);
    r->set_page_tokens(16);
    r->set_ttl_seconds(600);
    r->set_max_tokens(4096);
    return Status::OK;
  }
  Status Step(ServerContext*, const v1::StepRequest* req, v1::StepResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["Step"];
    return StepLocked(*req, r);
  }
  Status BatchStep(ServerContext*, const v1::BatchStepRequest* req, v1::BatchStepResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["BatchStep"];
    for (const auto& s : req->steps()) {
      v1::StepResult* item = r->add_results();
      const Status st = StepLocked(s, item->mutable_response());
      item->set_status_code(st.error_code());
      item->set_status_message(st.error_message());
      if (!st.ok()) item->clear_response();
    }
    return Status::OK;
  }
  Status TruncateSession(ServerContext*, const v1::TruncateSessionRequest* req,
                         v1::TruncateSessionResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["TruncateSession"];
    if (Status st = Check(req->session_id()); !st.ok()) return st;
    for (int64_t& t : tokens_[req->session_id()]) {
      t -= req->tokens();
      r->add_cached_tokens(t);
    }
    return Status::OK;
  }
  Status ForkSession(ServerContext*, const v1::ForkSessionRequest* req, v1::ForkSessionResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["ForkSession"];
    if (Status st = Check(req->session_id()); !st.ok()) return st;
    const std::string sid = id_ + "." + std::to_string(next_++);
    tokens_[sid] = tokens_[req->session_id()];
    r->set_session_id(sid);
    r->set_replica_id(id_);
    return Status::OK;
  }
  Status CloseSession(ServerContext*, const v1::CloseSessionRequest* req, v1::CloseSessionResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_["CloseSession"];
    if (Status st = Check(req->session_id()); !st.ok()) return st;
    tokens_.erase(req->session_id());
    r->set_freed_pages(3);
    return Status::OK;
  }

 private:
  Status Check(const std::string& sid) const {
    if (sid.rfind(id_ + ".", 0) != 0) {
      return Status(StatusCode::FAILED_PRECONDITION, "session " + sid + " is not on replica " + id_);
    }
    if (!tokens_.count(sid)) return Status(StatusCode::NOT_FOUND, "unknown session " + sid);
    return Status::OK;
  }
  Status StepLocked(const v1::StepRequest& req, v1::StepResponse* r) {
    if (Status st = Check(req.session_id()); !st.ok()) return st;
    auto& layers = tokens_[req.session_id()];
    if (req.layer() < 0 || req.layer() >= static_cast<int>(layers.size())) {
      return Status(StatusCode::INVALID_ARGUMENT, "layer out of range");
    }
    layers[req.layer()] += req.k_new().shape(0);
    *r->mutable_o() = req.q();
    r->set_cached_tokens(layers[req.layer()]);
    r->mutable_timing()->set_batch_requests(1);
    return Status::OK;
  }

  mutable std::mutex mu_;
  std::string id_;
  std::atomic<int64_t> free_pages_{100};
  std::atomic<int64_t> max_sessions_{-1};
  std::atomic<bool> hide_id_{false};
  int next_ = 1;
  std::map<std::string, std::vector<int64_t>> tokens_;
  std::map<std::string, int> calls_;
};

// A loopback port held for the test: bound with SO_REUSEPORT and never listened on, so calls to it
// are refused (a replica that is down) and no other socket on the host can take it, while a gRPC
// server (which sets SO_REUSEPORT too) may still bind it later. A port bound and released instead
// could be taken in between by another test's outgoing connection on a busy host.
class ReservedPort {
 public:
  ReservedPort() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    const int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port_ = ntohs(a.sin_port);
    }
    EXPECT_GT(port_, 0) << "could not reserve a loopback port";
  }
  ~ReservedPort() { close(fd_); }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_;
  int port_ = 0;
};

struct RunningFake {
  std::unique_ptr<FakeReplica> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string target() const { return "127.0.0.1:" + std::to_string(port); }
};

RunningFake StartFake(const std::string& id, int port = 0) {
  RunningFake f;
  f.service = std::make_unique<FakeReplica>(id);
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &f.port);
  b.RegisterService(f.service.get());
  f.server = b.BuildAndStart();
  EXPECT_NE(f.server, nullptr);
  EXPECT_GT(f.port, 0);
  return f;
}

SessionClientOptions OptionsFor(std::vector<std::string> targets) {
  SessionClientOptions o;
  o.client.target = targets.front();
  o.more_targets.assign(targets.begin() + 1, targets.end());
  o.info_timeout = std::chrono::milliseconds(2000);
  return o;
}

std::unique_ptr<SessionClient> MustCreate(const SessionClientOptions& o) {
  auto c = SessionClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

SessionSpec SmallSpec() {
  SessionSpec s;
  s.num_layers = 2;
  s.num_kv_heads = 1;
  s.head_dim = 8;
  return s;
}

StepInput RandomStep(const std::string& sid, int layer, int tokens, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1, 1);
  auto t = [&](int heads) {
    std::vector<float> v(size_t(tokens) * heads * 8);
    for (float& x : v) x = dist(rng);
    return Tensor::FromFloats(DType::kBFloat16, {tokens, heads, 8}, v);
  };
  StepInput in;
  in.session_id = sid;
  in.layer = layer;
  in.q = t(2);
  in.k_new = t(1);
  in.v_new = t(1);
  return in;
}

// --- ResolveTarget -------------------------------------------------------------------------------

TEST(ResolveTarget, LiteralAddressesAndLists) {
  EXPECT_EQ(*ResolveTarget("127.0.0.1:5"), std::vector<std::string>{"ipv4:127.0.0.1:5"});
  EXPECT_EQ(*ResolveTarget("[::1]:7"), std::vector<std::string>{"ipv6:[::1]:7"});
  EXPECT_EQ(*ResolveTarget("ipv4:127.0.0.1:1,127.0.0.2:2"),
            (std::vector<std::string>{"ipv4:127.0.0.1:1", "ipv4:127.0.0.2:2"}));
  EXPECT_EQ(*ResolveTarget("unix:/tmp/attnd.sock"), std::vector<std::string>{"unix:/tmp/attnd.sock"});
}

TEST(ResolveTarget, NamesResolveToEveryAddress) {
  for (const std::string t : {"localhost:50051", "dns:///localhost:50051", "dns:localhost:50051"}) {
    auto r = ResolveTarget(t);
    ASSERT_TRUE(r.ok()) << t << ": " << r.status();
    EXPECT_NE(std::find(r->begin(), r->end(), "ipv4:127.0.0.1:50051"), r->end())
        << t << " did not resolve to 127.0.0.1";
    for (const auto& a : *r) EXPECT_TRUE(a.rfind("ipv4:", 0) == 0 || a.rfind("ipv6:[", 0) == 0) << a;
  }
}

TEST(ResolveTarget, BadTargetsSayWhy) {
  auto no_port = ResolveTarget("attnd-headless.attnd.svc.cluster.local");
  ASSERT_FALSE(no_port.ok());
  EXPECT_EQ(no_port.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_port.status().message().find("no port"), std::string::npos) << no_port.status();
  auto no_host = ResolveTarget(":50051");
  EXPECT_EQ(no_host.status().code(), absl::StatusCode::kInvalidArgument) << no_host.status();
  auto bad_list = ResolveTarget("ipv4:127.0.0.1:1,127.0.0.2");
  EXPECT_EQ(bad_list.status().code(), absl::StatusCode::kInvalidArgument) << bad_list.status();
  auto unknown = ResolveTarget("no-such-host.invalid:50051");  // .invalid never resolves (RFC 6761)
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(unknown.status().message().find("no-such-host.invalid"), std::string::npos);
  EXPECT_FALSE(ResolveTarget("").ok());
}

// --- placement -----------------------------------------------------------------------------------

class TwoReplicas : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = StartFake("rep-a");
    b_ = StartFake("rep-b");
    client_ = MustCreate(OptionsFor({a_.target(), b_.target()}));
    ASSERT_NE(client_, nullptr);
    // The tests here rank known replicas. The first resolution keeps whichever replicas answered
    // (one is enough), and on a loaded machine one can miss it: resolve until both are known.
    for (int i = 0; i < 20 && client_->Replicas().size() < 2; ++i) (void)client_->Refresh();
    ASSERT_EQ(client_->Replicas().size(), 2u);
  }
  FakeReplica& a() { return *a_.service; }
  FakeReplica& b() { return *b_.service; }

  RunningFake a_, b_;
  std::unique_ptr<SessionClient> client_;
  std::mt19937_64 rng_{11};
};

TEST_F(TwoReplicas, KnowsBothReplicas) {
  auto replicas = client_->Replicas();
  ASSERT_EQ(replicas.size(), 2u);
  EXPECT_EQ(replicas[0].replica_id, "rep-a");
  EXPECT_EQ(replicas[0].endpoint, "ipv4:" + a_.target());
  EXPECT_EQ(replicas[1].replica_id, "rep-b");
  EXPECT_NE(client_->ClientForReplica("rep-b"), nullptr);
  EXPECT_EQ(client_->ClientForReplica("rep-c"), nullptr);
}

TEST_F(TwoReplicas, CreatesOnTheReplicaWithMostFreePages) {
  a().set_free_pages(10);
  b().set_free_pages(500);
  for (int i = 0; i < 3; ++i) {
    auto s = client_->CreateSession(SmallSpec());
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->replica_id, "rep-b");
    EXPECT_EQ(s->endpoint, "ipv4:" + b_.target());
    EXPECT_EQ(s->session_id.rfind("rep-b.", 0), 0u) << s->session_id;
  }
  // Free pages are asked at each create: once B holds fewer, A gets the next one.
  b().set_free_pages(9);
  auto s = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->replica_id, "rep-a");
  EXPECT_EQ(a().calls("CreateSession"), 1);
  EXPECT_EQ(b().calls("CreateSession"), 3);
}

TEST_F(TwoReplicas, EqualReplicasTakeTurns) {
  a().set_free_pages(100);
  b().set_free_pages(100);
  // The fakes count open sessions (fewer sessions breaks a tie), so also keep those equal by
  // closing each session at once: what remains is the turn order.
  std::set<std::string> seen;
  for (int i = 0; i < 4; ++i) {
    auto s = client_->CreateSession(SmallSpec());
    ASSERT_TRUE(s.ok()) << s.status();
    seen.insert(s->replica_id);
    ASSERT_TRUE(client_->CloseSession(s->session_id).ok());
  }
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_EQ(a().calls("CreateSession"), 2);
  EXPECT_EQ(b().calls("CreateSession"), 2);
}

TEST_F(TwoReplicas, PassesOverAReplicaAtItsSessionLimit) {
  a().set_free_pages(10);
  b().set_free_pages(500);
  b().set_max_sessions(0);
  auto s = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->replica_id, "rep-a");
  EXPECT_EQ(b().calls("CreateSession"), 1);  // tried first, refused

  a().set_max_sessions(1);  // A has its one session now: nobody accepts
  auto none = client_->CreateSession(SmallSpec());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("rep-a"), std::string::npos) << none.status();
  EXPECT_NE(none.status().message().find("rep-b"), std::string::npos) << none.status();
}

// --- routing -------------------------------------------------------------------------------------

TEST_F(TwoReplicas, EveryCallOfASessionGoesToItsReplica) {
  std::vector<SessionInfo> sessions;
  for (int i = 0; i < 4; ++i) {
    (i % 2 ? a() : b()).set_free_pages(1000);
    (i % 2 ? b() : a()).set_free_pages(1);
    auto s = client_->CreateSession(SmallSpec());
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*s);
  }
  for (const auto& s : sessions) {
    for (int layer = 0; layer < 2; ++layer) {
      StepInput in = RandomStep(s.session_id, layer, 3, rng_);
      auto r = client_->Step(in);
      ASSERT_TRUE(r.ok()) << s.session_id << ": " << r.status();  // the fake refuses other replicas
      EXPECT_EQ(r->o.data, in.q.data);
      EXPECT_EQ(r->cached_tokens, 3);
    }
    auto t = client_->TruncateSession(s.session_id, 1);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->cached_tokens, (std::vector<int64_t>{2, 2}));
    auto f = client_->ForkSession(s.session_id);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->replica_id, s.replica_id);
    EXPECT_EQ(f->endpoint, s.endpoint);
    ASSERT_TRUE(client_->CloseSession(f->session_id).ok());
    auto freed = client_->CloseSession(s.session_id);
    ASSERT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(*freed, 3);
  }
  EXPECT_EQ(a().calls("Step"), 4);
  EXPECT_EQ(b().calls("Step"), 4);
}

TEST_F(TwoReplicas, ASessionIdFromAnotherClientRoutes) {
  b().set_free_pages(1000);
  a().set_free_pages(0);
  auto s = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(s.ok()) << s.status();
  // Another process (here: another client over the same targets, listed in the other order).
  auto other = MustCreate(OptionsFor({b_.target(), a_.target()}));
  ASSERT_NE(other, nullptr);
  auto r = other->Step(RandomStep(s->session_id, 1, 2, rng_));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(b().calls("Step"), 1);
  EXPECT_EQ(a().calls("Step"), 0);
}

TEST_F(TwoReplicas, ReplicaIdsWithDotsRouteByTheLongestMatch) {
  a().set_replica_id("node");
  b().set_replica_id("node.7");
  ASSERT_TRUE(client_->Refresh().ok());
  b().set_free_pages(1000);
  a().set_free_pages(0);
  auto on_b = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  EXPECT_EQ(on_b->session_id.rfind("node.7.", 0), 0u);
  ASSERT_TRUE(client_->Step(RandomStep(on_b->session_id, 0, 1, rng_)).ok());
  a().set_free_pages(2000);
  auto on_a = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  ASSERT_TRUE(client_->Step(RandomStep(on_a->session_id, 0, 1, rng_)).ok());
  EXPECT_EQ(a().calls("Step"), 1);
  EXPECT_EQ(b().calls("Step"), 1);
}

TEST_F(TwoReplicas, UnknownReplicaOrMalformedIdIsNotFoundSayingWhy) {
  auto r = client_->Step(RandomStep("rep-zz.123", 0, 1, rng_));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  const std::string m(r.status().message());
  EXPECT_NE(m.find("rep-zz"), std::string::npos) << m;
  EXPECT_NE(m.find("rep-a at ipv4:" + a_.target()), std::string::npos) << m;
  EXPECT_NE(m.find("rep-b"), std::string::npos) << m;
  auto bad = client_->CloseSession("no-dot-here");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(bad.status().message().find("not a session id"), std::string::npos) << bad.status();
  // "rep-a" alone, or "rep-ab.1", is not a session of rep-a.
  EXPECT_EQ(client_->Step(RandomStep("rep-a", 0, 1, rng_)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Step(RandomStep("rep-ab.1", 0, 1, rng_)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a().calls("Step") + b().calls("Step"), 0);
}

TEST_F(TwoReplicas, TheServersStatusComesBackAsItIs) {
  auto s = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(s.ok());
  auto r = client_->Step(RandomStep(s->session_id, 5, 1, rng_));  // layer out of range
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "layer out of range");
  // Sent by hand to the other replica: its refusal, unchanged.
  auto wrong = client_->ClientForReplica(s->replica_id == "rep-a" ? "rep-b" : "rep-a");
  ASSERT_NE(wrong, nullptr);
  auto misrouted = Step(*wrong, RandomStep(s->session_id, 0, 1, rng_));
  EXPECT_EQ(misrouted.status().code(), absl::StatusCode::kFailedPrecondition) << misrouted.status();
}

TEST_F(TwoReplicas, BatchStepSplitsByReplicaAndKeepsTheOrder) {
  a().set_free_pages(1000);
  b().set_free_pages(0);
  auto sa = client_->CreateSession(SmallSpec());
  b().set_free_pages(2000);
  auto sb = client_->CreateSession(SmallSpec());
  ASSERT_TRUE(sa.ok() && sb.ok());
  ASSERT_EQ(sa->replica_id, "rep-a");
  ASSERT_EQ(sb->replica_id, "rep-b");
  std::vector<StepInput> items = {RandomStep(sb->session_id, 0, 2, rng_), RandomStep(sa->session_id, 0, 1, rng_),
                                  RandomStep("rep-gone.4", 0, 1, rng_), RandomStep(sa->session_id, 0, 3, rng_),
                                  RandomStep(sb->session_id, 9, 1, rng_)};
  auto r = client_->BatchStep(items);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), items.size());
  ASSERT_TRUE((*r)[0].ok() && (*r)[1].ok() && (*r)[3].ok());
  EXPECT_EQ((*r)[0]->o.data, items[0].q.data);
  EXPECT_EQ((*r)[1]->o.data, items[1].q.data);
  EXPECT_EQ((*r)[3]->o.data, items[3].q.data);
  EXPECT_EQ((*r)[0]->cached_tokens, 2);
  EXPECT_EQ((*r)[3]->cached_tokens, 4);  // after item 1 of the same (session, layer)
  EXPECT_EQ((*r)[2].status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*r)[4].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a().calls("BatchStep"), 1);
  EXPECT_EQ(b().calls("BatchStep"), 1);

  // Nothing reaches a server: the outer status fails.
  auto none = client_->BatchStep({RandomStep("rep-gone.4", 0, 1, rng_)});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TwoReplicas, ConcurrentCallsFromManyThreads) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 5; ++i) {
        auto s = client_->CreateSession(SmallSpec());
        if (!s.ok()) { ++failures; continue; }
        for (int layer = 0; layer < 2; ++layer) {
          if (!client_->Step(RandomStep(s->session_id, layer, 1, rng)).ok()) ++failures;
        }
        if (!client_->CloseSession(s->session_id).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(a().calls("Step") + b().calls("Step"), 8 * 5 * 2);
  EXPECT_GT(a().calls("CreateSession"), 0);
  EXPECT_GT(b().calls("CreateSession"), 0);
}

// --- replicas that come, go and restart ---------------------------------------------------------

TEST(SessionClientReplicas, AReplicaThatComesUpLaterIsFoundBySessionId) {
  RunningFake a = StartFake("early");
  const ReservedPort later;
  const int later_port = later.port();
  SessionClientOptions o = OptionsFor({a.target(), later.target()});
  o.info_timeout = std::chrono::milliseconds(500);
  o.min_refresh_interval = std::chrono::milliseconds(0);
  auto client = MustCreate(o);  // one of two answers: enough
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(client->Replicas().size(), 1u);

  RunningFake late = StartFake("late", later_port);
  ASSERT_EQ(late.port, later_port);
  // A session made on it by someone else: the client resolves again and finds its replica.
  auto direct = Client::Create({.target = late.target()});
  ASSERT_TRUE(direct.ok());
  auto s = CreateSession(**direct, SmallSpec());
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937_64 rng(3);
  auto r = client->Step(RandomStep(s->session_id, 0, 1, rng));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(client->Replicas().size(), 2u);
  EXPECT_EQ(late.service->calls("Step"), 1);
}

TEST(SessionClientReplicas, ARestartedReplicasOldSessionsAreNotFound) {
  RunningFake a = StartFake("before");
  SessionClientOptions o = OptionsFor({a.target()});
  o.min_refresh_interval = std::chrono::milliseconds(0);
  auto client = MustCreate(o);
  ASSERT_NE(client, nullptr);
  auto s = client->CreateSession(SmallSpec());
  ASSERT_TRUE(s.ok());
  a.service->set_replica_id("after");  // same address, a new process
  std::mt19937_64 rng(5);
  auto r = client->Step(RandomStep(s->session_id, 0, 1, rng));
  // Routed by id the call still goes to the address known as "before" until a refresh; the fake,
  // now "after", refuses it. A refresh makes the client see the new id and answer NOT_FOUND itself.
  ASSERT_FALSE(r.ok());
  ASSERT_TRUE(client->Refresh().ok());
  auto again = client->Step(RandomStep(s->session_id, 0, 1, rng));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(again.status().message().find("'before'"), std::string::npos) << again.status();
  EXPECT_NE(again.status().message().find("after at"), std::string::npos) << again.status();
}

TEST(SessionClientReplicas, NoReplicaAnsweringIsUnavailableNamingTheTargets) {
  const ReservedPort down1, down2;
  const int dead1 = down1.port(), dead2 = down2.port();
  SessionClientOptions o = OptionsFor({down1.target(), down2.target()});
  o.info_timeout = std::chrono::milliseconds(500);
  auto c = SessionClient::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find(std::to_string(dead1)), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find(std::to_string(dead2)), std::string::npos) << c.status();
  SessionClientOptions none;
  none.client.target = "";
  EXPECT_EQ(SessionClient::Create(none).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SessionClientReplicas, OneAddressListedTwiceIsOneReplica) {
  RunningFake a = StartFake("solo");
  auto client = MustCreate(OptionsFor({a.target(), "ipv4:" + a.target(), "dns:///" + a.target()}));
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->Replicas().size(), 1u);
}

TEST(SessionClientReplicas, ReplicasThatDoNotSayTheirIdAreKnownByTheirSessions) {
  RunningFake a = StartFake("quiet-a"), b = StartFake("quiet-b");
  a.service->set_hide_id(true);
  b.service->set_hide_id(true);
  auto client = MustCreate(OptionsFor({a.target(), b.target()}));
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(client->Replicas().size(), 2u);  // two addresses, not one replica with no id
  std::mt19937_64 rng(2);
  for (auto* fake : {&a, &b}) {
    (fake == &a ? b : a).service->set_free_pages(0);
    fake->service->set_free_pages(100);
    auto s = client->CreateSession(SmallSpec());
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->replica_id, fake->service->replica_id());
    auto r = client->Step(RandomStep(s->session_id, 0, 1, rng));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(fake->service->calls("Step"), 1);
  }
  EXPECT_NE(client->ClientForReplica("quiet-a"), nullptr);
  EXPECT_NE(client->ClientForReplica("quiet-b"), nullptr);
  // What the sessions taught survives a refresh that learns nothing.
  ASSERT_TRUE(client->Refresh().ok());
  EXPECT_NE(client->ClientForReplica("quiet-a"), nullptr);
  EXPECT_NE(client->ClientForReplica("quiet-b"), nullptr);
}

TEST(SessionClientReplicas, ARefreshKeepsKnownReplicasWhenNoneAnswers) {
  RunningFake a = StartFake("kept");
  auto client = MustCreate(OptionsFor({a.target()}));
  ASSERT_NE(client, nullptr);
  auto s = client->CreateSession(SmallSpec());
  ASSERT_TRUE(s.ok());
  a.server->Shutdown();
  a.server->Wait();
  EXPECT_EQ(client->Refresh().code(), absl::StatusCode::kUnavailable);
  // The replica is still known (a blip must not strand sessions); the call itself fails with the
  // transport's status, not NOT_FOUND.
  ASSERT_EQ(client->Replicas().size(), 1u);
  std::mt19937_64 rng(9);
  auto r = client->Step(RandomStep(s->session_id, 0, 1, rng), std::chrono::milliseconds(2000));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
}

}  // namespace
}  // namespace attn::client
