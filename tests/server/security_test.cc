// Security of attnd: TLS, mTLS, bearer tokens, the per-client pending limit and start-up
// errors. Certificates are made for each test suite with Debian's openssl in a temp dir.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "rpc/auth.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::AttndProcess;
using testing::LoopbackServer;
using testing::MakeRandomRequest;
using testing::RequestShape;
using testing::StartLoopbackServerWithClient;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// Runs a shell command; its exit status and its stdout+stderr.
std::pair<int, std::string> Shell(const std::string& command) {
  std::string output;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) output.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), output};
}

// A CA; a server certificate it signed for IP:127.0.0.1 and DNS:localhost; a client
// certificate it signed; and a second CA with a client certificate of its own.
class Pki {
 public:
  Pki() {
    char tmpl[] = "/tmp/attn-security-test-XXXXXX";
    dir_ = mkdtemp(tmpl) ? tmpl : "";
    const std::string script = R"(set -e
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -keyout ca.key -out ca.pem -days 2 -subj /CN=attn-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
openssl req -x509 $ec -keyout other_ca.key -out other_ca.pem -days 2 -subj /CN=attn-other-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
openssl req $ec -keyout server.key -out server.csr -subj /CN=localhost
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext
printf 'basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n' > client.ext
openssl req $ec -keyout client.key -out client.csr -subj /CN=attn-client
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 -extfile client.ext
openssl req $ec -keyout other_client.key -out other_client.csr -subj /CN=attn-other-client
openssl x509 -req -in other_client.csr -CA other_ca.pem -CAkey other_ca.key -CAcreateserial -out other_client.pem -days 2 -extfile client.ext
)";
    WriteFile(dir_ + "/make.sh", script);
    auto [rc, out] = Shell("cd '" + dir_ + "' && sh make.sh");
    ok_ = rc == 0;
    log_ = out;
  }
  ~Pki() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  bool ok() const { return ok_; }
  const std::string& log() const { return log_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string pem(const std::string& name) const { return Slurp(path(name)); }

 private:
  std::string dir_;
  bool ok_ = false;
  std::string log_;
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { pki_ = new Pki(); }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(pki_->ok()) << "openssl failed:\n" << pki_->log(); }

  ServerOptions TlsOptions(bool mtls = false) const {
    ServerOptions o;
    o.tls_cert = pki_->path("server.pem");
    o.tls_key = pki_->path("server.key");
    if (mtls) o.tls_client_ca = pki_->path("ca.pem");
    return o;
  }
  static std::unique_ptr<client::Client> MakeClient(client::ClientOptions o) {
    auto c = client::Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // A token file with comments and blank lines around two tokens.
  std::string TokenFile() const {
    const std::string path = pki_->path("tokens.txt");
    WriteFile(path, "# attnd tokens\n\n  alpha-token-123  \n# comment\nbeta-token-456\n\n");
    return path;
  }

  static Pki* pki_;
};
Pki* SecurityTest::pki_ = nullptr;

// A small request whose answer is checked against the float64 reference.
void ExpectCorrectAttend(client::Client& c) {
  std::mt19937_64 rng(7);
  RequestShape shape;
  shape.batch = 2;
  shape.seq_q = 9;
  shape.seq_k = 21;
  auto r = MakeRandomRequest(shape, rng);
  r.options.timeout = std::chrono::milliseconds(30000);
  auto result = c.Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LE(testing::ErrorAgainstReference(r, result->o), testing::ToleranceFor(shape.dtype));
}

absl::StatusCode AttendCode(client::Client& c, std::chrono::milliseconds timeout =
                                                   std::chrono::milliseconds(10000)) {
  std::mt19937_64 rng(1);
  auto r = MakeRandomRequest(RequestShape{}, rng);
  r.options.timeout = timeout;
  return c.Attend(r.q, r.k, r.v, r.options).status().code();
}

TEST_F(SecurityTest, TlsWithTheRightCaServesCorrectAnswers) {
  client::ClientOptions co;
  co.tls_ca_pem = pki_->pem("ca.pem");
  LoopbackServer s = StartLoopbackServerWithClient(TlsOptions(), co);
  ASSERT_NE(s.server, nullptr);
  ExpectCorrectAttend(*s.client);
  auto health = s.client->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(*health);
  // The DNS name of the certificate, checked through the name override.
  co.target = s.target;
  co.tls_server_name = "localhost";
  auto by_name = MakeClient(co);
  EXPECT_TRUE(by_name->GetServerInfo().ok());
}

TEST_F(SecurityTest, PlaintextClientToTlsServerFails) {
  LoopbackServer s = StartLoopbackServerWithClient(TlsOptions(), {});
  ASSERT_NE(s.server, nullptr);
  EXPECT_EQ(AttendCode(*s.client), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.client->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(SecurityTest, TlsWithTheWrongCaFails) {
  client::ClientOptions co;
  co.tls_ca_pem = pki_->pem("other_ca.pem");
  LoopbackServer s = StartLoopbackServerWithClient(TlsOptions(), co);
  ASSERT_NE(s.server, nullptr);
  EXPECT_EQ(AttendCode(*s.client), absl::StatusCode::kUnavailable);
  // A certificate for another name fails too.
  co.target = s.target;
  co.tls_ca_pem = pki_->pem("ca.pem");
  co.tls_server_name = "attnd.example.com";
  EXPECT_EQ(MakeClient(co)->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateFromTheClientCa) {
  client::ClientOptions co;
  co.tls_ca_pem = pki_->pem("ca.pem");
  LoopbackServer s = StartLoopbackServerWithClient(TlsOptions(/*mtls=*/true), co);
  ASSERT_NE(s.server, nullptr);
  // No client certificate.
  EXPECT_NE(s.client->GetServerInfo().status().code(), absl::StatusCode::kOk);
  EXPECT_NE(AttendCode(*s.client), absl::StatusCode::kOk);
  // A client certificate from another CA.
  co.target = s.target;
  co.tls_cert_pem = pki_->pem("other_client.pem");
  co.tls_key_pem = pki_->pem("other_client.key");
  auto other = MakeClient(co);
  EXPECT_NE(other->GetServerInfo().status().code(), absl::StatusCode::kOk);
  EXPECT_NE(AttendCode(*other), absl::StatusCode::kOk);
  // The right one.
  co.tls_cert_pem = pki_->pem("client.pem");
  co.tls_key_pem = pki_->pem("client.key");
  auto right = MakeClient(co);
  ExpectCorrectAttend(*right);
  auto health = right->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(*health);
}

// True once cond holds, polled every 5 ms for up to timeout_ms.
bool WaitFor(const std::function<bool()>& cond, int timeout_ms = 10000) {
  for (int waited = 0; waited < timeout_ms; waited += 5) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return cond();
}

TEST_F(SecurityTest, BearerTokensGuardEveryAttentionRpcButNotHealth) {
  ServerOptions so;
  so.auth_token_file = TokenFile();
  LoopbackServer s = StartLoopbackServerWithClient(so, {});
  ASSERT_NE(s.server, nullptr);
  const int metrics_port = s.server->metrics_port();
  ASSERT_GT(metrics_port, 0);
  auto unauthenticated = [&](const char* rpc) {
    return testing::MetricValue(testing::HttpGet(metrics_port, "/metrics"), "attn_requests_total",
                                {"code=\"UNAUTHENTICATED\"", std::string("rpc=\"") + rpc + "\""});
  };
  const double attend_before = unauthenticated("Attend");

  client::Client& none = *s.client;
  EXPECT_EQ(AttendCode(none), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(none.GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(none.Echo("x").status().code(), absl::StatusCode::kUnauthenticated);
  auto health = none.Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(*health);
  auto service_health = none.Health("attn.v1.Attention");
  ASSERT_TRUE(service_health.ok()) << service_health.status();
  EXPECT_TRUE(*service_health);

  client::ClientOptions co;
  co.target = s.target;
  co.bearer_token = "alpha-token-12";  // a prefix of a valid one
  auto wrong = MakeClient(co);
  EXPECT_EQ(AttendCode(*wrong), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
  {  // not the Bearer scheme
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Basic alpha-token-123");
    v1::GetServerInfoResponse response;
    EXPECT_EQ(none.stub()->GetServerInfo(&ctx, {}, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  for (const char* token : {"alpha-token-123", "beta-token-456"}) {
    co.bearer_token = token;
    auto right = MakeClient(co);
    ExpectCorrectAttend(*right);
    EXPECT_TRUE(right->GetServerInfo().ok());
    EXPECT_TRUE(right->Echo("y").ok());
  }

  // AttendStream without a token is refused as a whole.
  {
    grpc::ClientContext ctx;
    auto stream = none.stub()->AttendStream(&ctx);
    std::mt19937_64 rng(3);
    auto r = MakeRandomRequest(RequestShape{}, rng);
    stream->Write(client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options));
    stream->WritesDone();
    v1::AttendResponse response;
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // ... and served with one.
  {
    co.bearer_token = "beta-token-456";
    auto right = MakeClient(co);
    grpc::ClientContext ctx;
    right->PrepareContext(&ctx, std::chrono::milliseconds(30000));
    auto stream = right->stub()->AttendStream(&ctx);
    std::mt19937_64 rng(3);
    auto r = MakeRandomRequest(RequestShape{}, rng);
    ASSERT_TRUE(stream->Write(client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options)));
    stream->WritesDone();
    v1::AttendResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.status_code(), 0) << response.status_message();
    EXPECT_TRUE(stream->Finish().ok());
  }

  EXPECT_GE(unauthenticated("Attend") - attend_before, 2);
  EXPECT_GE(unauthenticated("GetServerInfo"), 3);
  // A stream is counted when the server is done with it (its reactor's OnDone), which may come
  // after the client has read its status.
  EXPECT_TRUE(WaitFor([&] { return unauthenticated("AttendStream") >= 1; }))
      << unauthenticated("AttendStream");
}

// Sends `n` Attend calls at once through c; returns their futures.
std::vector<std::future<absl::StatusCode>> AttendAsync(client::Client& c, int n) {
  std::vector<std::future<absl::StatusCode>> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(std::async(std::launch::async, [&c] {
      return AttendCode(c, std::chrono::milliseconds(60000));
    }));
  }
  return out;
}

// Requests wait ~1.5 s in the batcher, so that they stay pending while the test looks.
ServerOptions SlowBatcher(int64_t max_pending_per_client) {
  ServerOptions so;
  so.max_pending_per_client = max_pending_per_client;
  so.max_queue_delay_us = 1'500'000;
  so.gather_when_idle = true;
  so.max_batch_tokens = 1 << 20;
  return so;
}

TEST_F(SecurityTest, PendingLimitIsPerTokenAndReleasedAfterwards) {
  ServerOptions so = SlowBatcher(2);
  so.auth_token_file = TokenFile();
  client::ClientOptions co;
  co.bearer_token = "alpha-token-123";
  LoopbackServer s = StartLoopbackServerWithClient(so, co);
  ASSERT_NE(s.server, nullptr);
  co.target = s.target;
  co.bearer_token = "beta-token-456";
  auto beta = MakeClient(co);
  AttnServer& server = *s.server;

  for (int round = 0; round < 2; ++round) {  // the second round shows every count came back
    auto first = AttendAsync(*s.client, 2);
    ASSERT_TRUE(WaitFor([&] { return server.PendingPerClientTotal() == 2; }));
    // The third call of the same client is refused at once, naming the flag.
    std::mt19937_64 rng(1);
    auto r = MakeRandomRequest(RequestShape{}, rng);
    auto third = s.client->Attend(r.q, r.k, r.v, r.options);
    EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(third.status().message().find("max_pending_per_client"), std::string::npos)
        << third.status();
    // Another client (token) is not affected.
    auto other = AttendAsync(*beta, 1);
    for (auto& f : first) EXPECT_EQ(f.get(), absl::StatusCode::kOk);
    EXPECT_EQ(other[0].get(), absl::StatusCode::kOk);
    EXPECT_TRUE(WaitFor([&] { return server.PendingPerClientTotal() == 0; }));
  }
}

TEST_F(SecurityTest, PendingLimitWithoutTokensIsPerPeerHost) {
  LoopbackServer s = StartLoopbackServerWithClient(SlowBatcher(2), {});
  ASSERT_NE(s.server, nullptr);
  auto first = AttendAsync(*s.client, 2);
  ASSERT_TRUE(WaitFor([&] { return s.server->PendingPerClientTotal() == 2; }));
  // A second channel from the same host counts as the same client.
  client::ClientOptions co;
  co.target = s.target;
  auto again = MakeClient(co);
  EXPECT_EQ(AttendCode(*again), absl::StatusCode::kResourceExhausted);
  for (auto& f : first) EXPECT_EQ(f.get(), absl::StatusCode::kOk);
  EXPECT_TRUE(WaitFor([&] { return s.server->PendingPerClientTotal() == 0; }));
  EXPECT_EQ(AttendCode(*again, std::chrono::milliseconds(30000)), absl::StatusCode::kOk);
}

TEST_F(SecurityTest, PendingLimitCountsStreamItemsAndIsReleasedOnDeadlineAndCancel) {
  ServerOptions so = SlowBatcher(2);
  so.auth_token_file = TokenFile();
  client::ClientOptions co;
  co.bearer_token = "alpha-token-123";
  LoopbackServer s = StartLoopbackServerWithClient(so, co);
  ASSERT_NE(s.server, nullptr);
  AttnServer& server = *s.server;
  std::mt19937_64 rng(5);
  auto r = MakeRandomRequest(RequestShape{}, rng);
  const v1::AttendRequest request = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);

  {  // Three stream items at once: the third gets its own RESOURCE_EXHAUSTED, the stream goes on.
    grpc::ClientContext ctx;
    s.client->PrepareContext(&ctx, std::chrono::milliseconds(60000));
    auto stream = s.client->stub()->AttendStream(&ctx);
    for (int i = 0; i < 3; ++i) {
      v1::AttendRequest item = request;
      item.set_request_id(i + 1);
      ASSERT_TRUE(stream->Write(item));
    }
    stream->WritesDone();
    std::map<uint64_t, int> codes;
    v1::AttendResponse response;
    while (stream->Read(&response)) codes[response.request_id()] = response.status_code();
    EXPECT_TRUE(stream->Finish().ok());
    ASSERT_EQ(codes.size(), 3u);
    int exhausted = 0, ok = 0;
    for (auto [id, code] : codes) {
      exhausted += code == static_cast<int>(absl::StatusCode::kResourceExhausted);
      ok += code == 0;
    }
    EXPECT_EQ(exhausted, 1);
    EXPECT_EQ(ok, 2);
    EXPECT_TRUE(WaitFor([&] { return server.PendingPerClientTotal() == 0; }));
  }
  {  // Calls that expire while queued give their slots back.
    std::vector<std::future<absl::StatusCode>> expiring;
    for (int i = 0; i < 2; ++i) {
      expiring.push_back(std::async(std::launch::async, [&] {
        return AttendCode(*s.client, std::chrono::milliseconds(300));
      }));
    }
    for (auto& f : expiring) EXPECT_EQ(f.get(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(WaitFor([&] { return server.PendingPerClientTotal() == 0; }));
  }
  {  // A stream cancelled by its client with items queued gives their slots back.
    grpc::ClientContext ctx;
    s.client->PrepareContext(&ctx, std::chrono::milliseconds(60000));
    auto stream = s.client->stub()->AttendStream(&ctx);
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(WaitFor([&] { return server.PendingPerClientTotal() == 2; }));
    ctx.TryCancel();
    stream->Finish();
    EXPECT_TRUE(WaitFor([&] { return server.PendingPerClientTotal() == 0; }));
  }
  // Two calls at once are served again: nothing leaked.
  auto after = AttendAsync(*s.client, 2);
  for (auto& f : after) EXPECT_EQ(f.get(), absl::StatusCode::kOk);
  EXPECT_EQ(server.PendingPerClientTotal(), 0);
}

TEST_F(SecurityTest, BadSecurityOptionsFailStartUpWithAMessage) {
  auto create_error = [](const ServerOptions& o) {
    ServerOptions options = o;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "";
    options.backend = "cpu";
    auto server = AttnServer::Create(options);
    return server.ok() ? std::string("OK") : server.status().ToString();
  };
  ServerOptions o = TlsOptions();
  o.tls_cert = pki_->path("missing.pem");
  EXPECT_NE(create_error(o).find("--tls_cert"), std::string::npos) << create_error(o);
  o = TlsOptions();
  o.tls_key = "";
  EXPECT_NE(create_error(o).find("together"), std::string::npos) << create_error(o);
  o = TlsOptions(true);
  o.tls_client_ca = pki_->path("missing-ca.pem");
  EXPECT_NE(create_error(o).find("--tls_client_ca"), std::string::npos) << create_error(o);
  o = ServerOptions();
  o.tls_client_ca = pki_->path("ca.pem");
  EXPECT_NE(create_error(o).find("--tls_cert"), std::string::npos) << create_error(o);
  o = ServerOptions();
  o.auth_token_file = pki_->path("missing-tokens.txt");
  EXPECT_NE(create_error(o).find("--auth_token_file"), std::string::npos) << create_error(o);
  WriteFile(pki_->path("empty-tokens.txt"), "# nothing here\n\n");
  o.auth_token_file = pki_->path("empty-tokens.txt");
  EXPECT_NE(create_error(o).find("no token"), std::string::npos) << create_error(o);
  o = ServerOptions();
  o.max_pending_per_client = -1;
  EXPECT_NE(create_error(o).find("max_pending_per_client"), std::string::npos);

  // The binary: exit status 1 and a message, not a crash.
  const std::string attnd = std::string(ATTND_PATH) +
                            " --listen=127.0.0.1:0 --metrics_listen= --backend=cpu --threads=1";
  auto [rc, out] = Shell(attnd + " --tls_cert=" + pki_->path("missing.pem") +
                         " --tls_key=" + pki_->path("server.key"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("--tls_cert"), std::string::npos) << out;
  EXPECT_NE(out.find("missing.pem"), std::string::npos) << out;
  std::tie(rc, out) = Shell(attnd + " --auth_token_file=" + pki_->path("empty-tokens.txt"));
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("--auth_token_file"), std::string::npos) << out;
}

TEST(AuthUnitTest, TokensPeerHostsAndSlots) {
  auto auth = Authenticator::FromTokens({"abc", "xyz"});
  ASSERT_TRUE(auth.ok());
  EXPECT_EQ((*auth)->Check("Bearer abc").value(), "token:0");
  EXPECT_EQ((*auth)->Check("bearer   xyz").value(), "token:1");
  for (const char* bad :
       {"", "Bearer", "Bearer ", "Bearer ab", "Bearer abcd", "abc", "Basic abc"}) {
    EXPECT_EQ((*auth)->Check(bad).status().code(), absl::StatusCode::kUnauthenticated) << bad;
  }
  EXPECT_FALSE(Authenticator::FromTokens({}).ok());
  EXPECT_FALSE(Authenticator::FromTokens({"has space"}).ok());

  EXPECT_EQ(PeerHost("ipv4:127.0.0.1:5555"), "ipv4:127.0.0.1");
  EXPECT_EQ(PeerHost("ipv6:[::1]:5555"), "ipv6:[::1]");
  EXPECT_EQ(PeerHost("ipv6:%5B::1%5D:5555"), "ipv6:%5B::1%5D");
  EXPECT_EQ(PeerHost("unix:/tmp/attnd.sock"), "unix:/tmp/attnd.sock");

  PendingLimiter limiter(2);
  auto a = limiter.Acquire("a");
  auto b = limiter.Acquire("a");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(limiter.Acquire("a").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(limiter.Acquire("b").ok());  // released at once: the slot is dropped
  EXPECT_EQ(limiter.TotalPending(), 2);
  (*a)->Release();
  (*a)->Release();  // a second release does nothing
  EXPECT_EQ(limiter.Pending("a"), 1);
  a->reset();       // nor does destruction after a release
  EXPECT_EQ(limiter.Pending("a"), 1);
  b->reset();       // destruction releases an unreleased slot
  EXPECT_EQ(limiter.TotalPending(), 0);
  PendingLimiter unlimited(0);
  std::vector<std::shared_ptr<PendingLimiter::Slot>> many;
  for (int i = 0; i < 1000; ++i) many.push_back(*unlimited.Acquire("a"));
  EXPECT_EQ(unlimited.TotalPending(), 0);
}

// attnd and attnctl as processes: TLS, mTLS and a token from files, end to end.
TEST_F(SecurityTest, AttnctlTalksToAttndWithTlsClientCertificateAndToken) {
  auto attnd = AttndProcess::Start({"--tls_cert=" + pki_->path("server.pem"),
                                    "--tls_key=" + pki_->path("server.key"),
                                    "--tls_client_ca=" + pki_->path("ca.pem"),
                                    "--auth_token_file=" + TokenFile()});
  ASSERT_NE(attnd, nullptr);
  WriteFile(pki_->path("client-token.txt"), "# mine\nbeta-token-456\n");
  const std::string base = std::string(ATTNCTL_PATH) + " --target=" + attnd->target() +
                           " --tls_ca=" + pki_->path("ca.pem") +
                           " --tls_cert=" + pki_->path("client.pem") +
                           " --tls_key=" + pki_->path("client.key") + " --timeout_ms=20000";
  const std::string token = " --token_file=" + pki_->path("client-token.txt");
  auto [rc, out] = Shell(base + token + " info");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("cpu"), std::string::npos) << out;
  std::tie(rc, out) = Shell(base + token + " attend --seq 16 --heads 4 --head-dim 64 --check");
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = Shell(base + " health");  // no token needed
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = Shell(base + " info");
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("UNAUTHENTICATED"), std::string::npos) << out;
  std::tie(rc, out) = Shell(base + " --token_file=" + pki_->path("nope.txt") + " info");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("token_file"), std::string::npos) << out;
  EXPECT_EQ(attnd->SignalAndWait(SIGTERM, 20000), 0) << attnd->Log();
}

}  // namespace
}  // namespace attn
