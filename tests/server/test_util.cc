#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "common/reference.h"
#include <gtest/gtest.h>

namespace attn::testing {

LoopbackServer StartLoopbackServer(ServerOptions options) {
  options.listen = "127.0.0.1:0";
  if (options.metrics_listen == ServerOptions().metrics_listen) options.metrics_listen = "127.0.0.1:0";
  if (options.backend == "auto") options.backend = "cpu";
  if (options.threads == 0) options.threads = 2;
  LoopbackServer s;
  auto server = AttnServer::Create(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = std::move(*server);
  s.target = "127.0.0.1:" + std::to_string(s.server->port());
  client::ClientOptions co;
  co.target = s.target;
  co.max_message_bytes = 1ll << 30;  // let oversize requests reach the server's own check
  s.client = std::move(*client::Client::Create(co));
  return s;
}

LoopbackServer StartLoopbackServerWithClient(ServerOptions options,
                                             client::ClientOptions client_options) {
  LoopbackServer s = StartLoopbackServer(std::move(options));
  if (!s.server) return s;
  client_options.target = s.target;
  auto c = client::Client::Create(client_options);
  EXPECT_TRUE(c.ok()) << c.status();
  s.client = c.ok() ? std::move(*c) : nullptr;
  return s;
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request =
      "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  size_t off = 0;
  while (off < request.size()) {
    const ssize_t n = send(fd, request.data() + off, request.size() - off, 0);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  std::string response;
  char buf[8192];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, size_t(n));
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

double MetricValue(const std::string& exposition, const std::string& name,
                   const std::vector<std::string>& labels) {
  double sum = 0;
  std::istringstream in(exposition);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    if (line[name.size()] != '{' && line[name.size()] != ' ') continue;
    bool all = true;
    for (const std::string& l : labels) all = all && line.find(l) != std::string::npos;
    if (!all) continue;
    const size_t space = line.rfind(' ');
    if (space != std::string::npos) sum += std::strtod(line.c_str() + space + 1, nullptr);
  }
  return sum;
}

RandomRequest MakeRandomRequest(const RequestShape& s, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto random = [&](int64_t tokens, int heads) {
    std::vector<float> v(size_t(tokens) * heads * s.head_dim);
    for (float& x : v) x = dist(rng);
    return client::Tensor::FromFloats(s.dtype, {tokens, heads, s.head_dim}, v);
  };
  RandomRequest r;
  r.q = random(int64_t(s.batch) * s.seq_q, s.heads);
  r.k = random(int64_t(s.batch) * s.seq_k, s.kv_heads);
  r.v = random(int64_t(s.batch) * s.seq_k, s.kv_heads);
  for (int b = 0; b <= s.batch; ++b) {
    r.options.cu_seqlens_q.push_back(b * s.seq_q);
    r.options.cu_seqlens_k.push_back(b * s.seq_k);
  }
  r.options.causal = s.causal;
  return r;
}

RandomRequest MakeRandomShapedRequest(std::mt19937_64& rng, int max_len) {
  RequestShape s;
  const client::DType dtypes[] = {client::DType::kBFloat16, client::DType::kFloat16, client::DType::kFloat32};
  s.dtype = dtypes[rng() % 3];
  s.kv_heads = 1 + static_cast<int>(rng() % 3);
  s.heads = s.kv_heads * (1 + static_cast<int>(rng() % 3));
  const int dims[] = {32, 64, 128};
  s.head_dim = dims[rng() % 3];
  s.batch = 1 + static_cast<int>(rng() % 3);
  s.seq_q = 1 + static_cast<int>(rng() % max_len);
  s.seq_k = 1 + static_cast<int>(rng() % max_len);
  s.causal = rng() % 2;
  RandomRequest r = MakeRandomRequest(s, rng);
  r.options.return_lse = rng() % 2;
  if (rng() % 4 == 0) {
    r.options.window_left = static_cast<int32_t>(rng() % 16);
    r.options.window_right = static_cast<int32_t>(rng() % 16) - 1;
  }
  return r;
}

double ToleranceFor(client::DType dtype) {
  switch (dtype) {
    case client::DType::kFloat32: return 1e-5;
    case client::DType::kFloat16: return 1e-3;
    case client::DType::kBFloat16: return 6e-3;
    case client::DType::kFloat8E4M3: return 0;  // never an output type
  }
  return 0;
}

ReferenceResult ReferenceFor(const RandomRequest& r) {
  kernels::AttentionArgs a;
  a.num_heads = static_cast<int32_t>(r.q.shape[1]);
  a.num_kv_heads = static_cast<int32_t>(r.k.shape[1]);
  a.head_dim = static_cast<int32_t>(r.q.shape[2]);
  a.causal = r.options.causal;
  a.window_left = r.options.window_left;
  a.window_right = r.options.window_right;
  a.softmax_scale = r.options.softmax_scale;
  auto to_double = [](const client::Tensor& t) {
    std::vector<float> f = t.ToFloats();
    return std::vector<double>(f.begin(), f.end());
  };
  return ReferenceAttention(a, to_double(r.q), to_double(r.k), to_double(r.v),
                            r.options.cu_seqlens_q, r.options.cu_seqlens_k);
}

double ErrorAgainstReference(const RandomRequest& r, const client::Tensor& o) {
  if (o.shape != r.q.shape || o.dtype != r.q.dtype) return INFINITY;
  const ReferenceResult ref = ReferenceFor(r);
  const std::vector<float> got = o.ToFloats();
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref.o[i]) * (got[i] - ref.o[i]);
    den += ref.o[i] * ref.o[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::unique_ptr<AttndProcess> AttndProcess::Start(const std::vector<std::string>& flags) {
  auto p = std::unique_ptr<AttndProcess>(new AttndProcess());
  char tmpl[] = "/tmp/attnd-test-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return nullptr;
  p->log_path_ = tmpl;
  // $ATTND_BIN, where set, names the attnd to run (a bundle copied to another machine);
  // else the one built next to the tests.
  const char* bin = std::getenv("ATTND_BIN");
  std::vector<std::string> args = {bin != nullptr && *bin != '\0' ? bin : ATTND_PATH,
                                   "--listen=127.0.0.1:0",
                                   "--metrics_listen=127.0.0.1:0", "--backend=cpu",
                                   "--threads=2"};
  args.insert(args.end(), flags.begin(), flags.end());
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fd);
  p->pid_ = pid;
  // attnd logs its ports once it serves.
  const std::regex serving("serving attn.v1 on port ([0-9]+)(, metrics on port ([0-9]+))?");
  for (int i = 0; i < 300; ++i) {
    std::smatch m;
    const std::string log = p->Log();
    if (std::regex_search(log, m, serving)) {
      p->port_ = std::stoi(m[1]);
      if (m[3].matched) p->metrics_port_ = std::stoi(m[3]);
      return p;
    }
    if (waitpid(pid, nullptr, WNOHANG) == pid) {
      p->pid_ = -1;
      ADD_FAILURE() << "attnd exited at start:\n" << log;
      return nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "attnd did not start serving within 15 s:\n" << p->Log();
  return nullptr;
}

AttndProcess::~AttndProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (!log_path_.empty()) unlink(log_path_.c_str());
}

int AttndProcess::SignalAndWait(int sig, int timeout_ms) {
  if (pid_ <= 0) return -1;
  kill(pid_, sig);
  for (int waited = 0; waited < timeout_ms; waited += 10) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

std::string AttndProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int64_t VmRssKiB(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

double ScrapeMetric(int metrics_port, const std::string& name,
                    const std::vector<std::string>& labels) {
  const std::string body = HttpGet(metrics_port, "/metrics");
  if (body.empty()) return std::nan("");
  return MetricValue(body, name, labels);
}

}  // namespace attn::testing
