// Sessions over two replicas: two attnd processes (CPU backend) on loopback, one SessionClient
// over both addresses. New sessions go to the replica with the most free KV pages, every call on a
// session reaches the replica that holds it, and a call sent by hand to the other replica gets
// that replica's FAILED_PRECONDITION. (The client's logic alone, against fake replicas:
// tests/client/session_client_test.cc.)
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/server_builder.h>
#include <signal.h>

#include <atomic>
#include <thread>

#include "attn/client/session.h"
#include "sessions/crc32c.h"
#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using client::SessionClient;
using client::SessionInfo;
using client::StepInput;
using testing::AttndProcess;
using testing::ScrapeMetric;

constexpr int kKvHeads = 2, kHeads = 4, kHeadDim = 64;

client::SessionSpec Spec(int layers = 2) {
  client::SessionSpec s;
  s.num_layers = layers;
  s.num_kv_heads = kKvHeads;
  s.head_dim = kHeadDim;
  s.dtype = client::DType::kBFloat16;
  return s;
}

client::Tensor Random(int64_t tokens, int heads, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> v(size_t(tokens) * heads * kHeadDim);
  for (float& x : v) x = dist(rng);
  return client::Tensor::FromFloats(client::DType::kBFloat16, {tokens, heads, kHeadDim}, v);
}

StepInput RandomStep(const std::string& id, int layer, int64_t tokens, std::mt19937_64& rng) {
  StepInput in;
  in.session_id = id;
  in.layer = layer;
  in.q = Random(tokens, kHeads, rng);
  in.k_new = Random(tokens, kKvHeads, rng);
  in.v_new = Random(tokens, kKvHeads, rng);
  return in;
}

double StepCount(const AttndProcess& p) {
  const double v = ScrapeMetric(p.metrics_port(), "attn_requests_total", {"rpc=\"Step\"", "code=\"OK\""});
  return std::isnan(v) ? 0 : v;
}

class SessionReplicasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Equal caches, so that the pages a session takes decide where the next one goes.
    const std::vector<std::string> common = {"--threads=1", "--kv_cache_bytes=16777216"};
    auto flags = [&](const std::string& id) {
      std::vector<std::string> f = common;
      f.push_back("--replica_id=" + id);
      return f;
    };
    a_ = AttndProcess::Start(flags("replica-a"));
    b_ = AttndProcess::Start(flags("replica-b"));
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    client::SessionClientOptions o;
    o.client.target = "ipv4:127.0.0.1:" + std::to_string(a_->port()) + ",127.0.0.1:" + std::to_string(b_->port());
    auto c = SessionClient::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    sessions_ = std::move(*c);
    ASSERT_EQ(sessions_->Replicas().size(), 2u);
    // Each process by itself, for what is done by hand (not through the routing client).
    for (auto* p : {a_.get(), b_.get()}) {
      auto direct = client::Client::Create({.target = p->target()});
      ASSERT_TRUE(direct.ok()) << direct.status();
      direct_[p == a_.get() ? "replica-a" : "replica-b"] = std::move(*direct);
    }
  }

  client::Client& Direct(const std::string& replica) { return *direct_.at(replica); }
  int64_t FreePages(const std::string& replica) {
    auto info = Direct(replica).GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->kv_cache().free_pages() : -1;
  }
  // Prefills every layer of a session with `tokens` tokens, through the SessionClient.
  void Fill(const std::string& id, int layers, int64_t tokens) {
    for (int layer = 0; layer < layers; ++layer) {
      auto r = sessions_->Step(RandomStep(id, layer, tokens, rng_));
      ASSERT_TRUE(r.ok()) << id << " layer " << layer << ": " << r.status();
      ASSERT_EQ(r->cached_tokens, tokens);
    }
  }

  std::unique_ptr<AttndProcess> a_, b_;
  std::unique_ptr<SessionClient> sessions_;
  std::map<std::string, std::unique_ptr<client::Client>> direct_;
  std::mt19937_64 rng_{17};
};

TEST_F(SessionReplicasTest, TheClientKnowsBothReplicasByTheirIds) {
  auto replicas = sessions_->Replicas();
  EXPECT_EQ(replicas[0].replica_id, "replica-a");
  EXPECT_EQ(replicas[1].replica_id, "replica-b");
  EXPECT_EQ(replicas[0].endpoint, "ipv4:127.0.0.1:" + std::to_string(a_->port()));
  EXPECT_GT(replicas[0].total_pages, 0);
  EXPECT_EQ(replicas[0].free_pages, replicas[0].total_pages);
}

TEST_F(SessionReplicasTest, NewSessionsGoWhereMostPagesAreFree) {
  // A session on A (created there by hand) takes pages: A has fewer free pages than B.
  auto on_a = client::CreateSession(Direct("replica-a"), Spec());
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  ASSERT_EQ(on_a->replica_id, "replica-a");
  Fill(on_a->session_id, 2, 200);
  const int64_t free_a = FreePages("replica-a"), free_b = FreePages("replica-b");
  ASSERT_LT(free_a, free_b) << "filling a session on A took no pages";

  // Empty sessions take no pages: all three go to B.
  std::vector<SessionInfo> on_b;
  for (int i = 0; i < 3; ++i) {
    auto s = sessions_->CreateSession(Spec());
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->replica_id, "replica-b") << "session " << i << " with " << free_a << " pages free on A and "
                                          << free_b << " on B";
    EXPECT_EQ(s->session_id.rfind("replica-b.", 0), 0u) << s->session_id;
    on_b.push_back(*s);
  }
  // Once B's sessions hold more than A's, the next one goes to A.
  for (const auto& s : on_b) Fill(s.session_id, 2, 200);
  ASSERT_GT(FreePages("replica-a"), FreePages("replica-b"));
  auto next = sessions_->CreateSession(Spec());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->replica_id, "replica-a");
}

TEST_F(SessionReplicasTest, EveryStepReachesTheReplicaThatHoldsTheSession) {
  auto sa = client::CreateSession(Direct("replica-a"), Spec());
  auto sb = client::CreateSession(Direct("replica-b"), Spec());
  ASSERT_TRUE(sa.ok() && sb.ok());
  const double a0 = StepCount(*a_), b0 = StepCount(*b_);
  // Interleaved, through the routing client: each session's cache grows on its own replica only.
  for (int t = 1; t <= 3; ++t) {
    for (const auto* s : {&*sa, &*sb}) {
      auto r = sessions_->Step(RandomStep(s->session_id, 1, 4, rng_));
      ASSERT_TRUE(r.ok()) << s->session_id << ": " << r.status();
      EXPECT_EQ(r->cached_tokens, 4 * t);
    }
  }
  EXPECT_EQ(StepCount(*a_) - a0, 3);
  EXPECT_EQ(StepCount(*b_) - b0, 3);

  // BatchStep with items of both replicas: one call to each, results in order.
  std::vector<StepInput> items = {RandomStep(sb->session_id, 0, 1, rng_), RandomStep(sa->session_id, 0, 2, rng_),
                                  RandomStep(sb->session_id, 1, 1, rng_)};
  auto batch = sessions_->BatchStep(items);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->size(), 3u);
  for (const auto& r : *batch) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*batch)[0]->cached_tokens, 1);
  EXPECT_EQ((*batch)[1]->cached_tokens, 2);
  EXPECT_EQ((*batch)[2]->cached_tokens, 13);

  auto t = sessions_->TruncateSession(sb->session_id, 1);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->cached_tokens, (std::vector<int64_t>{0, 12}));
  auto fork = sessions_->ForkSession(sa->session_id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->replica_id, "replica-a");
  auto fr = sessions_->Step(RandomStep(fork->session_id, 1, 1, rng_));
  ASSERT_TRUE(fr.ok()) << fr.status();
  EXPECT_EQ(fr->cached_tokens, 13);
  for (const auto& id : {fork->session_id, sa->session_id, sb->session_id}) {
    EXPECT_TRUE(sessions_->CloseSession(id).ok()) << id;
  }
}

TEST_F(SessionReplicasTest, AStepSentToTheWrongReplicaGetsItsClearStatus) {
  auto sb = sessions_->CreateSession(Spec());
  ASSERT_TRUE(sb.ok()) << sb.status();
  client::Client& wrong = Direct(sb->replica_id == "replica-a" ? "replica-b" : "replica-a");
  auto r = client::Step(wrong, RandomStep(sb->session_id, 0, 1, rng_));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // The message names the replica that holds the session, so the caller can tell where to go.
  EXPECT_NE(r.status().message().find(sb->replica_id), std::string::npos) << r.status();
  for (auto close : {client::CloseSession(wrong, sb->session_id).status(),
                     client::TruncateSession(wrong, sb->session_id, 0).status(),
                     client::ForkSession(wrong, sb->session_id).status()}) {
    EXPECT_EQ(close.code(), absl::StatusCode::kFailedPrecondition) << close;
  }
  // Nothing changed on the right replica: the session is still there, empty.
  auto right = sessions_->Step(RandomStep(sb->session_id, 0, 1, rng_));
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_EQ(right->cached_tokens, 1);

  // An id of a replica that neither process is: the client says so without a call.
  auto unknown = sessions_->Step(RandomStep("replica-c.0123", 0, 1, rng_));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_NE(unknown.status().message().find("replica-c"), std::string::npos) << unknown.status();
}

TEST_F(SessionReplicasTest, ClosingEverySessionGivesEveryPageBack) {
  const int64_t start_a = FreePages("replica-a"), start_b = FreePages("replica-b");
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    auto s = sessions_->CreateSession(Spec(3));
    ASSERT_TRUE(s.ok()) << s.status();
    Fill(s->session_id, 3, 50 + 30 * i);
    ids.push_back(s->session_id);
  }
  EXPECT_LT(FreePages("replica-a") + FreePages("replica-b"), start_a + start_b);
  for (const auto& id : ids) ASSERT_TRUE(sessions_->CloseSession(id).ok()) << id;
  EXPECT_EQ(FreePages("replica-a"), start_a);
  EXPECT_EQ(FreePages("replica-b"), start_b);
}

TEST(SessionReplicasByName, ADnsNameIsResolvedToItsAddresses) {
  auto a = AttndProcess::Start({"--threads=1", "--replica_id=by-name"});
  ASSERT_NE(a, nullptr);
  // localhost may also resolve to ::1, where attnd does not listen: that address is passed over.
  client::SessionClientOptions o;
  o.client.target = "dns:///localhost:" + std::to_string(a->port());
  o.info_timeout = std::chrono::milliseconds(2000);
  auto c = SessionClient::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ((*c)->Replicas().size(), 1u);
  EXPECT_EQ((*c)->Replicas()[0].replica_id, "by-name");
  auto s = (*c)->CreateSession(Spec(1));
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937_64 rng(1);
  auto r = (*c)->Step(RandomStep(s->session_id, 0, 3, rng));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->o.shape, (std::vector<int64_t>{3, kHeads, kHeadDim}));
  EXPECT_TRUE((*c)->CloseSession(s->session_id).ok());
}

// A CA and a server certificate it signed for DNS:localhost only (no IP address), as a Service's
// certificate names the Service and not each pod's address.
class LocalhostPki {
 public:
  // usage: the certificate's extendedKeyUsage (serverAuth; serverAuth,clientAuth for replicas
  // that call each other over mTLS).
  explicit LocalhostPki(const std::string& usage = "serverAuth") {
    char tmpl[] = "/tmp/attn-session-tls-XXXXXX";
    dir_ = mkdtemp(tmpl) ? tmpl : "";
    const std::string script = R"sh(set -e
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca.key -out ca.pem -days 2 -subj /CN=attn-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
openssl req $ec -keyout server.key -out server.csr -subj /CN=localhost
printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=%s\n' "$1" > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext
)sh";
    std::ofstream(path("make.sh")) << script;
    FILE* p = popen(("cd '" + dir_ + "' && sh make.sh " + usage + " 2>&1").c_str(), "r");
    char buf[4096];
    for (size_t n; p && (n = fread(buf, 1, sizeof(buf), p)) > 0;) log_.append(buf, n);
    ok_ = p != nullptr && pclose(p) == 0;
  }
  ~LocalhostPki() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  bool ok() const { return ok_; }
  const std::string& log() const { return log_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string pem(const std::string& name) const {
    std::ifstream in(path(name));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string dir_, log_;
  bool ok_ = false;
};

TEST(SessionReplicasTls, TheCertificateIsCheckedAgainstTheNameNotThePodAddress) {
  LocalhostPki pki;
  ASSERT_TRUE(pki.ok()) << "openssl failed:\n" << pki.log();
  auto a = AttndProcess::Start({"--threads=1", "--replica_id=tls-a", "--tls_cert=" + pki.path("server.pem"),
                                "--tls_key=" + pki.path("server.key")});
  ASSERT_NE(a, nullptr);
  const std::string port = std::to_string(a->port());
  client::ClientOptions tls;
  tls.tls_ca_pem = pki.pem("ca.pem");

  // The control: the address alone does not match a certificate that names localhost.
  tls.target = "ipv4:127.0.0.1:" + port;
  auto by_address = client::Client::Create(tls);
  ASSERT_TRUE(by_address.ok());
  EXPECT_FALSE((*by_address)->GetServerInfo().ok()) << "the certificate should not match 127.0.0.1";

  // Through the name: resolved to 127.0.0.1 (and maybe ::1), each address checked as localhost.
  client::SessionClientOptions o;
  o.client = tls;
  o.client.target = "localhost:" + port;
  auto c = SessionClient::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ((*c)->Replicas().size(), 1u);
  EXPECT_EQ((*c)->Replicas()[0].endpoint, "ipv4:127.0.0.1:" + port);
  auto s = (*c)->CreateSession(Spec(1));
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937_64 rng(4);
  auto r = (*c)->Step(RandomStep(s->session_id, 0, 2, rng));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cached_tokens, 2);
  EXPECT_TRUE((*c)->CloseSession(s->session_id).ok());
}


// --- Hand-off on drain: a SIGTERM'd replica moves its sessions to its --handoff_peers ----------

// Sessions of 3 layers whose every answer is checked against the float64 reference over what the
// session must hold (SessionShadow): a step lost, applied twice or applied to a wrong cache shows
// as a wrong cached_tokens or a wrong o.
class HandoffLoad {
 public:
  explicit HandoffLoad(SessionClient* client) : client_(client) {}
  static testing::SessionSpec Shape() {
    testing::SessionSpec s;
    s.layers = 3;
    s.heads = kHeads;
    s.kv_heads = kKvHeads;
    s.head_dim = kHeadDim;
    return s;
  }
  // A new session, every layer prefilled with `tokens` tokens.
  void Create(int64_t tokens) {
    auto info = client_->CreateSession(Spec(3));
    ASSERT_TRUE(info.ok()) << info.status();
    sessions_.push_back({info->session_id, testing::SessionShadow(Shape())});
    for (int l = 0; l < 3; ++l) ASSERT_TRUE(StepOnce(sessions_.size() - 1, l, tokens).ok());
  }
  // A fork of session i (its pages shared on the replica), which then goes its own way.
  void Fork(size_t i) {
    auto info = client_->ForkSession(sessions_[i].id);
    ASSERT_TRUE(info.ok()) << info.status();
    sessions_.push_back({info->session_id, sessions_[i].shadow});
  }
  // One step of session i, layer `layer`, checked; the status of the call.
  absl::Status StepOnce(size_t i, int layer, int tokens) {
    Tracked& t = sessions_[i];
    const v1::StepRequest req = testing::RandomStep(t.id, layer, tokens, Shape(), rng_);
    StepInput in;
    in.session_id = t.id;  // the id it was created with, whatever replica holds it now
    in.layer = layer;
    for (auto [from, to] : {std::pair{&req.q(), &in.q}, {&req.k_new(), &in.k_new}, {&req.v_new(), &in.v_new}}) {
      auto tensor = client::FromWireTensor(*from);
      if (!tensor.ok()) return tensor.status();
      *to = std::move(*tensor);
    }
    const auto start = std::chrono::steady_clock::now();
    auto r = client_->Step(in);
    latencies_.push_back({start, std::chrono::steady_clock::now() - start});
    if (!r.ok()) return r.status();
    t.shadow.Append(req);
    ++steps_;
    EXPECT_EQ(r->cached_tokens, t.shadow.Tokens(layer)) << t.id << " layer " << layer;
    v1::StepResponse response;
    client::ToWireTensor(r->o, response.mutable_o());
    const auto err = t.shadow.Check(req, response);
    EXPECT_LT(err.o, testing::StepTolerance(v1::DTYPE_BFLOAT16)) << t.id << " layer " << layer;
    EXPECT_EQ(err.non_finite, 0);
    return absl::OkStatus();
  }
  // `rounds` decode steps of every layer of every session.
  void Decode(int rounds) {
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < sessions_.size(); ++i) {
        for (int l = 0; l < 3; ++l) {
          absl::Status st = StepOnce(i, l, 1 + (r + l) % 2);
          ASSERT_TRUE(st.ok()) << sessions_[i].id << " round " << r << " layer " << l << ": " << st;
        }
      }
    }
  }
  void CloseAll() {
    for (const Tracked& t : sessions_) {
      auto closed = client_->CloseSession(t.id);
      EXPECT_TRUE(closed.ok()) << t.id << ": " << closed.status();
    }
  }
  size_t size() const { return sessions_.size(); }
  const std::string& id(size_t i) const { return sessions_[i].id; }
  int64_t steps() const { return steps_; }
  // Each Step call's start and latency (the client's, moves followed included). Read only once
  // the thread that steps is done.
  struct Latency {
    std::chrono::steady_clock::time_point start;
    std::chrono::steady_clock::duration took;
  };
  const std::vector<Latency>& latencies() const { return latencies_; }

 private:
  struct Tracked {
    std::string id;
    testing::SessionShadow shadow;
  };
  SessionClient* const client_;
  std::vector<Tracked> sessions_;
  std::mt19937_64 rng_{29};
  std::atomic<int64_t> steps_{0};  // read by the test while its load thread steps
  std::vector<Latency> latencies_;
};

// "p50 X ms, p99 Y ms, max Z ms (N steps)" of the steps whose start lies inside (or, with
// inside false, outside) any of the windows.
std::string LatencyOf(const std::vector<HandoffLoad::Latency>& all,
                      const std::vector<std::pair<std::chrono::steady_clock::time_point,
                                                  std::chrono::steady_clock::time_point>>& windows,
                      bool inside) {
  std::vector<double> ms;
  for (const auto& l : all) {
    bool in = false;
    for (const auto& [from, to] : windows) in |= l.start >= from && l.start < to;
    if (in == inside) ms.push_back(std::chrono::duration<double, std::milli>(l.took).count());
  }
  if (ms.empty()) return "no steps";
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) { return ms[std::min(ms.size() - 1, size_t(q * double(ms.size())))]; };
  char line[128];
  std::snprintf(line, sizeof line, "p50 %.2f ms, p99 %.2f ms, max %.2f ms (%zu steps)", at(0.5),
                at(0.99), ms.back(), ms.size());
  return line;
}

// The backend of the hand-off tests' replicas: the CPU one, or CUDA's where
// $ATTND_TEST_BACKEND=cuda (the GPU host's run; the last --backend given wins).
std::vector<std::string> BackendFlags() {
  const char* b = std::getenv("ATTND_TEST_BACKEND");
  if (b == nullptr || std::string(b) != "cuda") return {};
  return {"--backend=cuda", "--device_pool_bytes=1073741824", "--pinned_pool_bytes=268435456"};
}

std::vector<std::string> ReplicaFlags(const std::string& id, std::vector<std::string> more = {}) {
  std::vector<std::string> f = {"--threads=1", "--kv_cache_bytes=8388608", "--replica_id=" + id,
                                "--drain_grace_s=10", "--drain_quiet_ms=1500", "--drain_timeout_s=3"};
  f.insert(f.end(), more.begin(), more.end());
  for (std::string& b : BackendFlags()) f.push_back(std::move(b));
  return f;
}

std::unique_ptr<SessionClient> ClientOf(const std::vector<const AttndProcess*>& targets,
                                        const std::string& token = "") {
  client::SessionClientOptions o;
  for (const AttndProcess* p : targets) o.more_targets.push_back("ipv4:" + p->target());
  o.client.bearer_token = token;
  auto c = SessionClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

v1::KvCacheInfo KvCache(const AttndProcess& p, const std::string& token = "") {
  auto c = client::Client::Create({.target = p.target(), .bearer_token = token});
  EXPECT_TRUE(c.ok());
  auto info = (*c)->GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->kv_cache() : v1::KvCacheInfo();
}

// Waits for a line of the process's log.
bool LogSays(const AttndProcess& p, const std::string& text, int timeout_ms = 20000) {
  for (int waited = 0; waited < timeout_ms; waited += 20) {
    if (p.Log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

int CountOf(const std::string& log, const std::string& text) {
  int n = 0;
  for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
  return n;
}

TEST(SessionHandoff, ASigtermedReplicaMovesEverySessionAndDecodingGoesOn) {
  auto b = AttndProcess::Start(ReplicaFlags("hand-b"));
  ASSERT_NE(b, nullptr);
  auto a = AttndProcess::Start(ReplicaFlags("hand-a", {"--handoff_peers=" + b->target()}));
  ASSERT_NE(a, nullptr);
  // The client knows A only: it learns B from A's answers.
  auto client = ClientOf({a.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 4; ++i) load.Create(17 + 13 * i);
  load.Fork(1);
  load.Decode(2);
  const int64_t b_free = KvCache(*b).free_pages();

  // SIGTERM A while a thread keeps decoding every session: no call may fail.
  std::atomic<bool> stop{false};
  std::thread decoder([&] {
    while (!stop.load()) {
      load.Decode(1);
      if (::testing::Test::HasFatalFailure()) return;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int64_t steps_before = load.steps();
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 5 sessions moved")) << a->Log();
  // Decoding goes on past the hand-off, on B (waited for, not timed: sanitized builds step slowly).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (load.steps() <= steps_before + 15 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stop = true;
  decoder.join();
  EXPECT_GT(load.steps(), steps_before + 15);
  load.Decode(2);
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  const std::string log = a->Log();
  EXPECT_NE(log.find(", 0 not moved"), std::string::npos) << log;
  EXPECT_NE(log.find("KV pages in use after hand-off: 0"), std::string::npos) << log;

  // Every session is on B now, once each, under an id of B.
  const v1::KvCacheInfo on_b = KvCache(*b);
  EXPECT_EQ(on_b.sessions(), 5);
  EXPECT_LT(on_b.free_pages(), b_free);
  for (size_t i = 0; i < load.size(); ++i) {
    EXPECT_EQ(client->CurrentSessionId(load.id(i)).rfind("hand-b.", 0), 0u) << load.id(i);
  }
  // Five streams: the fork's one page per layer was copied on its first decode, so it shares
  // nothing with its parent any more and moves alone.
  EXPECT_EQ(ScrapeMetric(b->metrics_port(), "attn_requests_total",
                         {"rpc=\"ImportSession\"", "code=\"OK\""}), 5);
  // Closing through the old ids gives every page back on B.
  load.CloseAll();
  EXPECT_EQ(KvCache(*b).sessions(), 0);
  EXPECT_EQ(KvCache(*b).free_pages(), KvCache(*b).total_pages());
}

// A session and two forks move as one family: each page they share crosses once and is shared
// again on the peer, which then holds exactly as many pages as the source did; both forks and
// their parent then decode on the peer (copy on write of the shared pages there) and every
// answer equals the float64 reference; closing them frees every page on both sides.
TEST(SessionHandoff, AForkFamilyMovesInOneStreamAndKeepsSharingItsPages) {
  auto b = AttndProcess::Start(ReplicaFlags("fam-b"));
  ASSERT_NE(b, nullptr);
  auto a = AttndProcess::Start(ReplicaFlags("fam-a", {"--handoff_peers=" + b->target()}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  // 300 tokens a layer: 128 a page (rows of 256 bytes), so 2 full pages and a partial one.
  load.Create(300);
  load.Fork(0);
  load.Fork(0);
  // Each decodes: the partial last pages are copied on write; the full ones stay shared.
  load.Decode(1);
  const v1::KvCacheInfo a_before = KvCache(*a), b_before = KvCache(*b);
  const int64_t a_used = a_before.total_pages() - a_before.free_pages();
  ASSERT_EQ(b_before.free_pages(), b_before.total_pages());
  // 2 shared pages and 3 of each session's own per layer: a third of 3 x 3 copies.
  EXPECT_EQ(a_used, 3 * (2 + 3));
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 3 sessions moved")) << a->Log();
  const v1::KvCacheInfo b_after = KvCache(*b);
  EXPECT_EQ(b_after.sessions(), 3);
  EXPECT_EQ(b_after.total_pages() - b_after.free_pages(), a_used)
      << "the peer holds other pages than the source did";
  EXPECT_EQ(ScrapeMetric(b->metrics_port(), "attn_requests_total",
                         {"rpc=\"ImportSession\"", "code=\"OK\""}), 1);
  // The bytes moved: the family's pages once (keys and values of 32 KiB each).
  EXPECT_EQ(ScrapeMetric(a->metrics_port(), "attn_session_handoff_bytes_total", {}),
            a_used * 2 * 32768);
  load.Decode(3);
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  EXPECT_NE(a->Log().find("KV pages in use after hand-off: 0"), std::string::npos) << a->Log();
  for (size_t i = 0; i < load.size(); ++i) {
    EXPECT_EQ(client->CurrentSessionId(load.id(i)).rfind("fam-b.", 0), 0u) << load.id(i);
  }
  load.CloseAll();
  EXPECT_EQ(KvCache(*b).sessions(), 0);
  EXPECT_EQ(KvCache(*b).free_pages(), KvCache(*b).total_pages());
}

// A caller idle while its replica drains: the lame-duck phase ends and A exits before the caller's
// next call, which meets a closed port. The client asks the other replicas, B (which took the
// sessions) answers their old ids with their new ones, and decoding goes on there, every answer
// equal to the float64 reference; single steps and BatchSteps alike.
TEST(SessionHandoff, ACallerIdleThroughTheDrainFindsItsSessionsOnThePeer) {
  // B's cache is the smaller, so that the sessions are created on A.
  auto b = AttndProcess::Start(ReplicaFlags("idle-b", {"--kv_cache_bytes=4194304"}));
  ASSERT_NE(b, nullptr);
  auto a = AttndProcess::Start(ReplicaFlags(
      "idle-a", {"--drain_quiet_ms=200", "--handoff_peers=" + b->target()}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get(), b.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 2; ++i) load.Create(40 + 30 * i);
  load.Fork(1);
  for (size_t i = 0; i < load.size(); ++i) {
    ASSERT_EQ(load.id(i).rfind("idle-a.", 0), 0u) << load.id(i);
  }
  load.Decode(1);
  // Idle from here until A has gone.
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  ASSERT_NE(a->Log().find("hand-off: 3 sessions moved"), std::string::npos) << a->Log();
  load.Decode(2);
  for (size_t i = 0; i < load.size(); ++i) {
    EXPECT_EQ(client->CurrentSessionId(load.id(i)).rfind("idle-b.", 0), 0u) << load.id(i);
  }
  // Another client, which never saw A answer, finds them too, through a BatchStep.
  auto other = ClientOf({b.get()});
  ASSERT_NE(other, nullptr);
  std::mt19937_64 rng(5);
  std::vector<StepInput> items;
  for (size_t i = 0; i < load.size(); ++i) items.push_back(RandomStep(load.id(i), 0, 1, rng));
  auto batch = other->BatchStep(items);
  ASSERT_TRUE(batch.ok()) << batch.status();
  for (const auto& r : *batch) EXPECT_TRUE(r.ok()) << r.status();
  // The old id asked by hand: B names the new one, with no address (B itself).
  auto direct = client::Client::Create({.target = b->target()});
  ASSERT_TRUE(direct.ok());
  auto asked = client::TruncateSession(**direct, load.id(0), 0);
  EXPECT_EQ(asked.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(asked.status().message().find("attnd-moved-to: ;idle-b."), std::string::npos)
      << asked.status();
  load.CloseAll();
  EXPECT_EQ(KvCache(*b).sessions(), 0);
  EXPECT_EQ(KvCache(*b).free_pages(), KvCache(*b).total_pages());
}

// A free TCP port on 127.0.0.1 for a replica that must come back at the same address. It is drawn
// below the kernel's ephemeral range: a port bound as 0 by a test running beside this one (or a
// connection's local port) is drawn from that range, and could take this one between the
// replica's exit and its restart.
int FreePort() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  constexpr int kLowest = 10000;
  if (ephemeral_low <= kLowest + 100) return 0;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(kLowest, ephemeral_low - 1);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(rng);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return 0;
}

// A rolling restart of two replicas under 64 decoding sessions: A drains (its sessions move to
// B) and comes back as A2 at the same address, then B drains (every session moves to A2). The
// decode loop sees no error, and every answer equals the float64 reference.
TEST(SessionHandoff, ARollingRestartOfTwoReplicasUnder64DecodingSessionsLosesNothing) {
  const int pa = FreePort(), pb = FreePort();
  ASSERT_GT(pa, 0);
  ASSERT_GT(pb, 0);
  auto replica = [&](const std::string& id, int port, int peer) {
    return AttndProcess::Start(ReplicaFlags(
        id, {"--listen=127.0.0.1:" + std::to_string(port), "--kv_cache_bytes=33554432",
             "--handoff_peers=127.0.0.1:" + std::to_string(peer)}));
  };
  auto a = replica("roll-a", pa, pb);
  auto b = replica("roll-b", pb, pa);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto client = ClientOf({a.get(), b.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 64; ++i) load.Create(8 + i % 5);
  std::atomic<bool> stop{false};
  std::thread decoder([&] {
    while (!stop.load() && !::testing::Test::HasFatalFailure()) load.Decode(1);
  });
  // The hand-offs' windows, from each SIGTERM to its replica's exit, for the step latencies.
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>>
      windows;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // steps before any hand-off
  windows.push_back({std::chrono::steady_clock::now(), {}});
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "sessions moved")) << a->Log();
  EXPECT_NE(a->Log().find(", 0 not moved"), std::string::npos) << a->Log();
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  windows.back().second = std::chrono::steady_clock::now();
  auto a2 = replica("roll-a2", pa, pb);
  ASSERT_NE(a2, nullptr);
  windows.push_back({std::chrono::steady_clock::now(), {}});
  ASSERT_EQ(kill(b->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*b, "hand-off: 64 sessions moved")) << b->Log();
  EXPECT_EQ(b->SignalAndWait(0, 30000), 0) << b->Log();
  windows.back().second = std::chrono::steady_clock::now();
  const int64_t steps_after = load.steps();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (load.steps() <= steps_after && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stop = true;
  decoder.join();
  EXPECT_GT(load.steps(), steps_after);
  // What the callers saw (not a check: speed depends on the machine).
  std::printf("rolling restart, step latency: during the two hand-offs %s; otherwise %s\n",
              LatencyOf(load.latencies(), windows, true).c_str(),
              LatencyOf(load.latencies(), windows, false).c_str());
  EXPECT_EQ(KvCache(*a2).sessions(), 64);
  for (size_t i = 0; i < load.size(); ++i) {
    EXPECT_EQ(client->CurrentSessionId(load.id(i)).rfind("roll-a2.", 0), 0u) << load.id(i);
  }
  load.CloseAll();
  EXPECT_EQ(KvCache(*a2).free_pages(), KvCache(*a2).total_pages());
}

TEST(SessionHandoff, AFullPeerIsPassedOverAndOwnersStayTheOwners) {
  // Three replicas sharing a token file: B is full (its one session slot taken), C takes the
  // sessions. The moved sessions still belong to the token that created them.
  char tmpl[] = "/tmp/attn-handoff-tokens-XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  const std::string tokens = "alpha-token\nbeta-token\n";
  ASSERT_EQ(write(fd, tokens.data(), tokens.size()), static_cast<ssize_t>(tokens.size()));
  close(fd);
  const std::string auth = std::string("--auth_token_file=") + tmpl;
  auto b = AttndProcess::Start(ReplicaFlags("full-b", {auth, "--max_sessions=1"}));
  auto c = AttndProcess::Start(ReplicaFlags("room-c", {auth}));
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  auto a = AttndProcess::Start(
      ReplicaFlags("src-a", {auth, "--handoff_peers=" + b->target() + "," + c->target()}));
  ASSERT_NE(a, nullptr);
  auto on_b = client::CreateSession(
      **client::Client::Create({.target = b->target(), .bearer_token = "beta-token"}), Spec(1));
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  const v1::KvCacheInfo b_before = KvCache(*b, "beta-token");

  // The client knows A and B (where no session fits, so that all go to A), not C.
  auto client = ClientOf({a.get(), b.get()}, "alpha-token");
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 3; ++i) load.Create(9 + 11 * i);
  load.Fork(0);
  load.Decode(1);
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 4 sessions moved")) << a->Log();
  // Decoding goes on at C (the client learns where from A, which answers until it is quiet).
  load.Decode(2);
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  const std::string log = a->Log();
  EXPECT_NE(log.find("KV pages in use after hand-off: 0"), std::string::npos) << log;

  // C, learned from A's answers, stays known when the targets are resolved again (A is gone).
  ASSERT_TRUE(client->Refresh().ok());
  load.Decode(1);
  // B is as it was.
  const v1::KvCacheInfo b_after = KvCache(*b, "beta-token");
  EXPECT_EQ(b_after.sessions(), 1);
  EXPECT_EQ(b_after.free_pages(), b_before.free_pages());
  EXPECT_EQ(KvCache(*c, "alpha-token").sessions(), 4);
  EXPECT_GE(ScrapeMetric(b->metrics_port(), "attn_requests_total",
                         {"rpc=\"ImportSession\"", "code=\"RESOURCE_EXHAUSTED\""}), 1);
  // Another token does not see them on C.
  auto other = client::Client::Create({.target = c->target(), .bearer_token = "beta-token"});
  ASSERT_TRUE(other.ok());
  auto stolen = client::TruncateSession(**other, client->CurrentSessionId(load.id(0)), 0);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound) << stolen.status();
  load.CloseAll();
  EXPECT_EQ(KvCache(*c, "alpha-token").free_pages(), KvCache(*c, "alpha-token").total_pages());
  unlink(tmpl);
}

// A peer that refuses (another token file), and one that is full: the sessions stay whole on the
// source, which goes on serving them until it exits, and says why it kept each.
TEST(SessionHandoff, APeerThatRefusesLeavesEverySessionWholeOnTheSource) {
  char t1[] = "/tmp/attn-handoff-a-XXXXXX", t2[] = "/tmp/attn-handoff-b-XXXXXX";
  for (auto [path, token] : {std::pair{t1, "source-token"}, {t2, "other-deploy-token"}}) {
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    ASSERT_GT(write(fd, token, strlen(token)), 0);
    close(fd);
  }
  auto b = AttndProcess::Start(ReplicaFlags("refuse-b", {std::string("--auth_token_file=") + t2}));
  auto c = AttndProcess::Start(ReplicaFlags("tiny-c", {"--kv_cache_bytes=262144"}));
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  auto a = AttndProcess::Start(ReplicaFlags(
      "keep-a", {std::string("--auth_token_file=") + t1, "--drain_grace_s=30", "--drain_quiet_ms=30000",
                 "--handoff_peers=" + b->target() + "," + c->target()}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get()}, "source-token");
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 2; ++i) load.Create(300);
  load.Fork(1);
  load.Decode(1);
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 0 sessions moved")) << a->Log();
  const std::string log = a->Log();
  // Each session: the last peer tried was C, which has too few pages.
  EXPECT_EQ(CountOf(log, "not moved (peer_full)"), 3) << log;
  // One refused stream per family: session 0 alone, session 1 with its fork (they still share
  // their full pages).
  EXPECT_EQ(ScrapeMetric(b->metrics_port(), "attn_requests_total",
                         {"rpc=\"ImportSession\"", "code=\"UNAUTHENTICATED\""}), 2);
  // Nothing stayed behind on the peers.
  EXPECT_EQ(KvCache(*c).sessions(), 0);
  EXPECT_EQ(KvCache(*c).free_pages(), KvCache(*c).total_pages());
  EXPECT_EQ(KvCache(*b, "other-deploy-token").sessions(), 0);
  // The sessions are whole on A, which still serves them during its drain.
  load.Decode(2);
  load.CloseAll();
  EXPECT_EQ(a->SignalAndWait(SIGTERM, 30000) , 128 + SIGTERM);
  unlink(t1);
  unlink(t2);
}

// ImportSession by hand: what a peer accepts and refuses, and that a refused or broken transfer
// leaves nothing behind.
class ImportSessionTest : public ::testing::Test {
 protected:
  // One layer of 130 tokens of rows of 2 KV heads x 64 x bf16 (256 bytes): with 16-token pages of
  // the 2 KiB row (32 KiB of keys), 128 tokens a page, so 2 pages.
  static constexpr int64_t kPageBytes = 32768, kTokens = 130;
  void SetUp() override {
    std::vector<std::string> flags = {"--threads=1", "--kv_cache_bytes=4194304", "--replica_id=imp"};
    for (std::string& b : BackendFlags()) flags.push_back(std::move(b));
    peer_ = AttndProcess::Start(flags);
    ASSERT_NE(peer_, nullptr);
    stub_ = v1::Attention::NewStub(
        grpc::CreateChannel(peer_->target(), grpc::InsecureChannelCredentials()));
    spec_.layers = 1;
    spec_.heads = kHeads;
    spec_.kv_heads = kKvHeads;
    spec_.head_dim = kHeadDim;
    contents_ = testing::RandomStep("", 0, kTokens, spec_, rng_);
    total_pages_ = KvCache(*peer_).total_pages();
  }
  v1::SessionTransferChunk Header() const {
    v1::SessionTransferChunk c;
    v1::SessionTransferHeader* h = c.mutable_header();
    h->set_num_layers(1);
    h->set_num_kv_heads(kKvHeads);
    h->set_head_dim(kHeadDim);
    h->set_dtype(v1::DTYPE_BFLOAT16);
    h->set_max_tokens(4096);
    h->set_page_tokens(128);
    h->set_page_span(1);
    h->set_page_bytes(kPageBytes);
    h->add_layer_tokens(kTokens);
    h->add_layer_pages(2);
    h->set_source_session_id("elsewhere.0123");
    return c;
  }
  // Page i of the contents: its keys, then its values, each padded to a page.
  v1::SessionTransferChunk Page(int64_t i) const {
    v1::SessionTransferChunk c;
    std::string kv(2 * kPageBytes, '\0');
    for (int half = 0; half < 2; ++half) {
      const std::string& rows = half == 0 ? contents_.k_new().data() : contents_.v_new().data();
      const size_t from = static_cast<size_t>(i * kPageBytes);
      const size_t n = std::min<size_t>(kPageBytes, rows.size() - from);
      rows.copy(kv.data() + half * kPageBytes, n, from);
    }
    c.mutable_page()->set_index(i);
    c.mutable_page()->set_crc32c(Crc32c(kv));
    c.mutable_page()->set_kv(std::move(kv));
    return c;
  }
  grpc::Status Import(const std::vector<v1::SessionTransferChunk>& chunks,
                      v1::ImportSessionResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = stub_->ImportSession(&ctx, response);
    for (const auto& c : chunks) {
      if (!stream->Write(c)) break;
    }
    stream->WritesDone();
    return stream->Finish();
  }
  // The peer holds no session and every page is free.
  void ExpectNothingLeft() {
    const v1::KvCacheInfo info = KvCache(*peer_);
    EXPECT_EQ(info.sessions(), 0);
    EXPECT_EQ(info.free_pages(), total_pages_);
  }

  std::unique_ptr<AttndProcess> peer_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  testing::SessionSpec spec_;
  v1::StepRequest contents_;
  int64_t total_pages_ = 0;
  std::mt19937_64 rng_{41};
};

TEST_F(ImportSessionTest, AnImportedSessionHoldsExactlyTheBytesSent) {
  v1::ImportSessionResponse response;
  const grpc::Status st = Import({Header(), Page(0), Page(1)}, &response);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(response.session_id().rfind("imp.", 0), 0u) << response.session_id();
  EXPECT_EQ(response.pages(), 2);
  EXPECT_EQ(KvCache(*peer_).sessions(), 1);
  // A step over the imported cache equals the reference over the keys and values sent.
  testing::SessionShadow shadow(spec_);
  shadow.Append(contents_);
  const v1::StepRequest step = testing::RandomStep(response.session_id(), 0, 3, spec_, rng_);
  v1::StepResponse out;
  const grpc::Status stepped = testing::Step(stub_.get(), step, &out);
  ASSERT_TRUE(stepped.ok()) << stepped.error_message();
  shadow.Append(step);
  EXPECT_EQ(out.cached_tokens(), kTokens + 3);
  EXPECT_LT(shadow.Check(step, out).o, testing::StepTolerance(v1::DTYPE_BFLOAT16));
  ASSERT_TRUE(testing::CloseSession(stub_.get(), response.session_id()).ok());
  ExpectNothingLeft();
}

TEST_F(ImportSessionTest, ABadTransferIsRefusedAndLeavesNothing) {
  struct Case {
    const char* what;
    std::vector<v1::SessionTransferChunk> chunks;
    grpc::StatusCode code;
    const char* says;
  };
  v1::SessionTransferChunk corrupt = Page(1);
  corrupt.mutable_page()->mutable_kv()->at(100) ^= 0x40;  // one bit flipped on the way
  v1::SessionTransferChunk other_layout = Header();
  other_layout.mutable_header()->set_page_tokens(64);
  v1::SessionTransferChunk bad_dim = Header();
  bad_dim.mutable_header()->set_head_dim(65);
  v1::SessionTransferChunk bad_count = Header();
  bad_count.mutable_header()->set_layer_pages(0, 3);
  v1::SessionTransferChunk no_limit = Header();
  no_limit.mutable_header()->set_max_tokens(0);
  v1::SessionTransferChunk short_page = Page(0);
  short_page.mutable_page()->mutable_kv()->resize(100);
  const std::vector<Case> cases = {
      {"a page first", {Page(0)}, grpc::StatusCode::INVALID_ARGUMENT, "header"},
      {"a checksum that does not match", {Header(), Page(0), corrupt}, grpc::StatusCode::DATA_LOSS,
       "CRC32C"},
      {"pages out of order", {Header(), Page(1)}, grpc::StatusCode::INVALID_ARGUMENT, "index 1"},
      {"a page of the wrong size", {Header(), short_page}, grpc::StatusCode::INVALID_ARGUMENT,
       "bytes"},
      {"a page missing", {Header(), Page(0)}, grpc::StatusCode::INVALID_ARGUMENT,
       "1 of the 2 pages"},
      {"a page too many", {Header(), Page(0), Page(1), Page(1)},
       grpc::StatusCode::INVALID_ARGUMENT, "index 1"},
      {"another page layout", {other_layout}, grpc::StatusCode::INVALID_ARGUMENT, "page_tokens"},
      {"an unsupported head_dim", {bad_dim}, grpc::StatusCode::INVALID_ARGUMENT, "head_dim"},
      {"a page count that does not match the tokens", {bad_count},
       grpc::StatusCode::INVALID_ARGUMENT, "130 tokens in 3 pages"},
      {"no token limit", {no_limit}, grpc::StatusCode::INVALID_ARGUMENT, "max_tokens"},
  };
  for (const Case& c : cases) {
    v1::ImportSessionResponse response;
    const grpc::Status st = Import(c.chunks, &response);
    EXPECT_EQ(st.error_code(), c.code) << c.what << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(c.says), std::string::npos) << c.what << ": " << st.error_message();
    EXPECT_TRUE(response.session_id().empty()) << c.what;
    ExpectNothingLeft();
  }
}

TEST_F(ImportSessionTest, AFullPeerRefusesBeforeAnyPage) {
  v1::SessionTransferChunk huge = Header();
  huge.mutable_header()->set_max_tokens(131072);
  huge.mutable_header()->set_layer_tokens(0, 128 * (total_pages_ + 1));
  huge.mutable_header()->set_layer_pages(0, total_pages_ + 1);
  v1::ImportSessionResponse response;
  const grpc::Status st = Import({huge}, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  ExpectNothingLeft();
}

// A peer that fails mid-transfer (after some pages) and one whose process is gone: the move
// goes to the next peer, or the session stays whole.
class FailingImport final : public v1::Attention::Service {
 public:
  explicit FailingImport(std::chrono::milliseconds stall = {}) : stall_(stall) {}
  grpc::Status ImportSession(grpc::ServerContext* ctx,
                             grpc::ServerReader<v1::SessionTransferChunk>* reader,
                             v1::ImportSessionResponse*) override {
    v1::SessionTransferChunk chunk;
    for (int i = 0; i < 3 && reader->Read(&chunk); ++i) ++chunks;
    // A transfer in flight for that long (or until the sender gives up).
    const auto until = std::chrono::steady_clock::now() + stall_;
    while (std::chrono::steady_clock::now() < until && !ctx->IsCancelled()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the peer went away mid-transfer");
  }
  std::atomic<int> chunks{0};

 private:
  const std::chrono::milliseconds stall_;
};

struct FakePeer {
  explicit FakePeer(FailingImport* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    server = builder.BuildAndStart();
  }
  ~FakePeer() {
    if (server) server->Shutdown(std::chrono::system_clock::now());
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(port); }
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// A second SIGTERM while a session is in flight: that move ends (here: the stalled peer fails,
// the next peer takes it), the rest stay on the source, which exits at once after.
TEST(SessionHandoff, ASecondSigtermEndsTheHandOffAfterTheSessionInFlight) {
  FailingImport stalling(std::chrono::milliseconds(1500));
  FakePeer fake(&stalling);
  ASSERT_NE(fake.server, nullptr);
  auto c = AttndProcess::Start(ReplicaFlags("after-c"));
  ASSERT_NE(c, nullptr);
  auto a = AttndProcess::Start(
      ReplicaFlags("twice-a", {"--drain_timeout_s=20", "--handoff_peers=" + fake.target() + "," + c->target()}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 3; ++i) load.Create(150);
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  for (int waited = 0; stalling.chunks.load() < 3 && waited < 20000; waited += 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GE(stalling.chunks.load(), 3) << a->Log();
  EXPECT_EQ(a->SignalAndWait(SIGTERM, 30000), 128 + SIGTERM) << a->Log();
  const std::string log = a->Log();
  EXPECT_EQ(CountOf(log, "not moved (stopped)"), 2) << log;
  // The session in flight went to C, whole (its import completed), and nothing else did.
  EXPECT_EQ(KvCache(*c).sessions(), 1);
  EXPECT_EQ(ScrapeMetric(c->metrics_port(), "attn_requests_total",
                         {"rpc=\"ImportSession\"", "code=\"OK\""}), 1);
}

// A peer that stops reading mid-transfer (hung, not gone) holds one attempt, not the drain.
TEST(SessionHandoff, AHungPeerCostsOneBoundedAttempt) {
  FailingImport hung(std::chrono::minutes(2));
  FakePeer fake(&hung);
  ASSERT_NE(fake.server, nullptr);
  auto c = AttndProcess::Start(ReplicaFlags("past-c"));
  ASSERT_NE(c, nullptr);
  auto a = AttndProcess::Start(ReplicaFlags(
      "hung-a", {"--drain_timeout_s=60", "--handoff_peers=" + fake.target() + "," + c->target()}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  load.Create(100);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 1 sessions moved", 30000)) << a->Log();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 4.5);  // the attempt on the hung peer: 5 s and a little for 100 tokens
  EXPECT_LT(seconds, 20);   // not the drain's 60 s
  load.Decode(1);
  EXPECT_EQ(KvCache(*c).sessions(), 1);
  load.CloseAll();
}

TEST(SessionHandoff, APeerThatFailsMidTransferLeavesTheSessionForTheNextPeer) {
  FailingImport failing;
  FakePeer fake(&failing);
  ASSERT_NE(fake.server, nullptr);
  auto gone = AttndProcess::Start(ReplicaFlags("gone-g"));
  ASSERT_NE(gone, nullptr);
  const std::string gone_target = gone->target();
  EXPECT_EQ(gone->SignalAndWait(SIGKILL, 5000), 128 + SIGKILL);
  auto c = AttndProcess::Start(ReplicaFlags("next-c"));
  ASSERT_NE(c, nullptr);
  auto a = AttndProcess::Start(ReplicaFlags(
      "mid-a", {"--handoff_peers=" + fake.target() + "," + gone_target + "," + c->target()}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  for (int i = 0; i < 2; ++i) load.Create(200 + 100 * i);
  load.Decode(1);
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 2 sessions moved")) << a->Log();
  load.Decode(2);
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  EXPECT_GE(failing.chunks.load(), 3);
  EXPECT_EQ(KvCache(*c).sessions(), 2);
  load.CloseAll();
  EXPECT_EQ(KvCache(*c).free_pages(), KvCache(*c).total_pages());
}

// A peer that predates fork families: it refuses a stream with a second header as such a peer
// does (INVALID_ARGUMENT), and takes streams of one session, naming it in session_id only.
class PeerWithoutFamilies final : public v1::Attention::Service {
 public:
  grpc::Status ImportSession(grpc::ServerContext*, grpc::ServerReader<v1::SessionTransferChunk>* reader,
                             v1::ImportSessionResponse* response) override {
    v1::SessionTransferChunk chunk;
    int headers = 0;
    while (reader->Read(&chunk)) {
      headers += chunk.has_header();
      if (chunk.has_header() && chunk.header().shared_pages_size() > 0) ++shared_named;
    }
    if (headers > 1) {
      ++refused;
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "ImportSession: every chunk after the header is a page");
    }
    response->set_session_id("old-p." + std::to_string(++taken));
    return grpc::Status::OK;
  }
  std::atomic<int> refused{0}, taken{0}, shared_named{0};
};

TEST(SessionHandoff, AForkFamilyGoesOneSessionPerStreamToAPeerWithoutFamilies) {
  PeerWithoutFamilies old;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&old);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto a = AttndProcess::Start(
      ReplicaFlags("fam-old-a", {"--handoff_peers=127.0.0.1:" + std::to_string(port)}));
  ASSERT_NE(a, nullptr);
  auto client = ClientOf({a.get()});
  ASSERT_NE(client, nullptr);
  HandoffLoad load(client.get());
  load.Create(300);
  load.Fork(0);
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 2 sessions moved")) << a->Log();
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  EXPECT_EQ(old.refused.load(), 1);      // the family's stream
  EXPECT_EQ(old.taken.load(), 2);        // then each session alone, every page its own
  EXPECT_EQ(old.shared_named.load(), 1); // only in the refused stream
  EXPECT_NE(a->Log().find("KV pages in use after hand-off: 0"), std::string::npos) << a->Log();
  server->Shutdown(std::chrono::system_clock::now());
}

// Replicas that require client certificates (mTLS) move sessions to each other with their own
// certificates, checked against the deploy's CA under the Service's name.
TEST(SessionHandoff, ReplicasHandSessionsOffOverMutualTls) {
  LocalhostPki pki("serverAuth,clientAuth");
  ASSERT_TRUE(pki.ok()) << "openssl failed:\n" << pki.log();
  const std::vector<std::string> tls = {"--tls_cert=" + pki.path("server.pem"),
                                        "--tls_key=" + pki.path("server.key"),
                                        "--tls_client_ca=" + pki.path("ca.pem")};
  auto b = AttndProcess::Start(ReplicaFlags("mtls-b", tls));
  ASSERT_NE(b, nullptr);
  // A replica of another deploy (another CA): the TLS handshake fails both ways, nothing moves
  // there, and the next peer is tried.
  LocalhostPki other("serverAuth,clientAuth");
  ASSERT_TRUE(other.ok()) << other.log();
  auto stranger = AttndProcess::Start(ReplicaFlags(
      "mtls-x", {"--tls_cert=" + other.path("server.pem"), "--tls_key=" + other.path("server.key"),
                 "--tls_client_ca=" + other.path("ca.pem")}));
  ASSERT_NE(stranger, nullptr);
  std::vector<std::string> a_flags = tls;
  a_flags.push_back("--handoff_peers=localhost:" + std::to_string(stranger->port()) +
                    ",localhost:" + std::to_string(b->port()));
  auto a = AttndProcess::Start(ReplicaFlags("mtls-a", a_flags));
  ASSERT_NE(a, nullptr);
  client::SessionClientOptions o;
  o.client.target = "localhost:" + std::to_string(a->port());
  o.client.tls_ca_pem = pki.pem("ca.pem");
  o.client.tls_cert_pem = pki.pem("server.pem");
  o.client.tls_key_pem = pki.pem("server.key");
  auto c = SessionClient::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  HandoffLoad load(c->get());
  for (int i = 0; i < 2; ++i) load.Create(40);
  ASSERT_EQ(kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(LogSays(*a, "hand-off: 2 sessions moved")) << a->Log();
  load.Decode(2);
  EXPECT_EQ(a->SignalAndWait(0, 30000), 0) << a->Log();
  for (size_t i = 0; i < load.size(); ++i) {
    EXPECT_EQ((*c)->CurrentSessionId(load.id(i)).rfind("mtls-b.", 0), 0u) << load.id(i);
  }
  const double imported = ScrapeMetric(stranger->metrics_port(), "attn_requests_total",
                                      {"rpc=\"ImportSession\""});
  EXPECT_TRUE(std::isnan(imported) || imported == 0) << imported;
  load.CloseAll();
}

}  // namespace
}  // namespace attn
