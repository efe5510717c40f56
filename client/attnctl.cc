// attnctl: talk to attnd from the command line.
//   attnctl [--target HOST:PORT] [--lb round_robin] info
//   attnctl [--target HOST:PORT] health [--service NAME]
//   attnctl [--target HOST:PORT] attend [--seq S] [--kv-seq SK] [--batch B] [--heads H]
//           [--kv-heads HKV] [--head-dim D] [--dtype bf16|fp16|fp32] [--causal] [--lse]
//           [--count N] [--check]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "attn/client/client.h"
#include "attn/kernels/cpu_attention.h"
#include "attn/util/flag_names.h"
#include "attn/util/usage.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attnd address, host:port");
ABSL_FLAG(std::string, lb, "",
          "gRPC load-balancing policy: round_robin spreads calls over every address of --target "
          "(e.g. dns:///attnd-headless.NS.svc.cluster.local:50051 or ipv4:HOST1:P1,HOST2:P2); "
          "'' = gRPC's default (pick_first)");
ABSL_FLAG(std::string, token_file, "", "File holding a bearer token to send");
ABSL_FLAG(std::string, tls_ca, "", "PEM file of the CA that signed the server's certificate");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mTLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mTLS)");
ABSL_FLAG(std::string, tls_server_name, "", "Name to check in the server's certificate");
ABSL_FLAG(std::string, service, "", "health: the service to ask about ('' = whole server)");
ABSL_FLAG(int, seq, 128, "attend: query tokens per sequence");
ABSL_FLAG(int, kv_seq, 0, "attend: key tokens per sequence (0: same as --seq)");
ABSL_FLAG(int, batch, 1, "attend: sequences per request");
ABSL_FLAG(int, heads, 8, "attend: query heads");
ABSL_FLAG(int, kv_heads, 0, "attend: KV heads (0: same as --heads)");
ABSL_FLAG(int, head_dim, 64, "attend: head dimension");
ABSL_FLAG(std::string, dtype, "bf16", "attend: bf16, fp16 or fp32");
ABSL_FLAG(bool, causal, false, "attend: causal mask");
ABSL_FLAG(int, window_left, -1, "attend: sliding window, keys to the left (-1: none)");
ABSL_FLAG(int, window_right, -1, "attend: sliding window, keys to the right (-1: none)");
ABSL_FLAG(bool, lse, false, "attend: ask for the log-sum-exp too");
ABSL_FLAG(int, count, 1, "attend: requests to send, one after another");
ABSL_FLAG(bool, check, false, "attend: compare each answer with the CPU backend run locally");
ABSL_FLAG(uint64_t, seed, 0, "attend: random seed (0: from the clock)");
ABSL_FLAG(int, timeout_ms, 60000, "Deadline of each call, milliseconds");
ABSL_FLAG(int, connections, 1,
          "HTTP/2 connections to --target (ClientOptions::connections; 0: min(4, hardware "
          "threads)); attnctl sends one call at a time, so one is enough");

namespace {

using attn::client::Client;
using attn::client::DType;
using attn::client::Tensor;

int Fail(const absl::Status& st) {
  std::cerr << "attnctl: " << absl::StatusCodeToString(st.code()) << ": " << st.message()
            << std::endl;
  return 2;
}

// The file's contents ("" when path is empty); exits 2 with a message when it cannot be read,
// rather than silently going without TLS or a token.
std::string ReadFile(const std::string& flag, const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path);
  if (!in) {
    std::cerr << "attnctl: --" << flag << ": cannot read '" << path << "'" << std::endl;
    std::exit(2);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The first token of a token file: its first line that is neither blank nor a '#' comment.
std::string ReadToken(const std::string& path) {
  std::stringstream ss(ReadFile("token_file", path));
  std::string line;
  while (std::getline(ss, line)) {
    const size_t b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos || line[b] == '#') continue;
    const size_t e = line.find_last_not_of(" \t\r");
    return line.substr(b, e - b + 1);
  }
  if (!path.empty()) {
    std::cerr << "attnctl: --token_file: '" << path << "' holds no token" << std::endl;
    std::exit(2);
  }
  return "";
}

int Info(Client& client) {
  auto info = client.GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  std::cout << "version:        " << info->version() << "\n"
            << "backend:        " << info->backend() << "\n"
            << "device:         " << info->device_name() << "\n"
            << "compute units:  " << info->compute_units() << "\n"
            << "device memory:  " << info->device_memory_bytes() << " bytes\n"
            << "capability:     " << info->compute_capability() << "\n"
            << "head dims:      " << absl::StrJoin(info->head_dims(), ", ") << "\n"
            << "max message:    " << info->limits().max_message_bytes() << " bytes\n"
            << "max batch:      " << info->limits().max_batch_tokens() << " tokens\n"
            << "max queue:      " << info->limits().max_queue_size() << " requests\n"
            << "build:          " << info->build_info() << std::endl;
  return 0;
}

int Health(Client& client) {
  auto serving = client.Health(absl::GetFlag(FLAGS_service));
  if (!serving.ok()) return Fail(serving.status());
  std::cout << (*serving ? "SERVING" : "NOT_SERVING") << std::endl;
  return *serving ? 0 : 1;
}

Tensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return Tensor::FromFloats(dtype, std::move(shape), v);
}

attn::kernels::DType KernelDType(DType t) {
  switch (t) {
    case DType::kFloat32: return attn::kernels::DType::kFloat32;
    case DType::kFloat16: return attn::kernels::DType::kFloat16;
    case DType::kBFloat16: return attn::kernels::DType::kBFloat16;
  }
  return attn::kernels::DType::kFloat32;
}

// Relative L2 error of the server's O against the CPU backend computed here, in float32.
absl::StatusOr<double> CheckAgainstCpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const attn::client::AttendOptions& o, const Tensor& got) {
  const std::vector<float> qf = q.ToFloats(), kf = k.ToFloats(), vf = v.ToFloats();
  std::vector<float> want(qf.size());
  attn::kernels::AttentionArgs a;
  a.dtype = attn::kernels::DType::kFloat32;
  a.q = qf.data();
  a.k = kf.data();
  a.v = vf.data();
  a.o = want.data();
  a.cu_seqlens_q = o.cu_seqlens_q.data();
  a.cu_seqlens_k = o.cu_seqlens_k.data();
  a.batch = static_cast<int32_t>(o.cu_seqlens_q.size()) - 1;
  a.total_q = static_cast<int32_t>(q.shape[0]);
  a.total_k = static_cast<int32_t>(k.shape[0]);
  a.max_seqlen_q = a.total_q;
  a.max_seqlen_k = a.total_k;
  a.num_heads = static_cast<int32_t>(q.shape[1]);
  a.num_kv_heads = static_cast<int32_t>(k.shape[1]);
  a.head_dim = static_cast<int32_t>(q.shape[2]);
  a.softmax_scale = o.softmax_scale;
  a.causal = o.causal;
  a.window_left = o.window_left;
  a.window_right = o.window_right;
  auto pool = attn::kernels::cpu::CpuThreadPool::Create(0);
  std::vector<char> ws(attn::kernels::cpu::WorkspaceBytes(a, pool->NumWorkers()) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~63ull);
  attn::kernels::Status st = attn::kernels::cpu::Run(a, aligned, pool.get());
  if (!st.ok()) return absl::InternalError("local CPU backend: " + st.message());
  const std::vector<float> g = got.ToFloats();
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::infinity();
    num += double(g[i] - want[i]) * (g[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

int Attend(Client& client) {
  auto dtype = attn::client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(dtype.status());
  const int s_q = absl::GetFlag(FLAGS_seq), batch = absl::GetFlag(FLAGS_batch);
  const int s_k = absl::GetFlag(FLAGS_kv_seq) > 0 ? absl::GetFlag(FLAGS_kv_seq) : s_q;
  const int h = absl::GetFlag(FLAGS_heads);
  const int h_kv = absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads) : h;
  const int d = absl::GetFlag(FLAGS_head_dim);
  uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed == 0) seed = std::chrono::steady_clock::now().time_since_epoch().count();
  std::mt19937_64 rng(seed);

  attn::client::AttendOptions options;
  for (int b = 0; b <= batch; ++b) {
    options.cu_seqlens_q.push_back(b * s_q);
    options.cu_seqlens_k.push_back(b * s_k);
  }
  options.causal = absl::GetFlag(FLAGS_causal);
  options.window_left = absl::GetFlag(FLAGS_window_left);
  options.window_right = absl::GetFlag(FLAGS_window_right);
  options.return_lse = absl::GetFlag(FLAGS_lse);
  options.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  const double tolerance = *dtype == DType::kFloat32 ? 1e-4 : (*dtype == DType::kFloat16 ? 3e-3 : 1.5e-2);

  const int count = absl::GetFlag(FLAGS_count);
  std::printf("%-6s %12s %12s %12s %12s %12s %s\n", "req", "client_us", "total_us", "queue_us",
              "transfer_us", "compute_us", absl::GetFlag(FLAGS_check) ? "rel_err" : "");
  for (int i = 0; i < count; ++i) {
    const Tensor q = RandomTensor(*dtype, {int64_t(batch) * s_q, h, d}, rng);
    const Tensor k = RandomTensor(*dtype, {int64_t(batch) * s_k, h_kv, d}, rng);
    const Tensor v = RandomTensor(*dtype, {int64_t(batch) * s_k, h_kv, d}, rng);
    const auto start = std::chrono::steady_clock::now();
    auto result = client.Attend(q, k, v, options);
    const double client_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    if (!result.ok()) return Fail(result.status());
    const auto& t = result->timing;
    std::printf("%-6d %12.1f %12.1f %12.1f %12.1f %12.1f", i, client_us, t.total_us(), t.queue_us(),
                t.transfer_us(), t.compute_us());
    if (absl::GetFlag(FLAGS_check)) {
      auto err = CheckAgainstCpu(q, k, v, options, result->o);
      if (!err.ok()) return Fail(err.status());
      std::printf(" %.2e", *err);
      if (!(*err <= tolerance)) {
        std::printf("\n");
        std::cerr << "attnctl: answer differs from the CPU backend: relative error " << *err
                  << " > " << tolerance << std::endl;
        return 3;
      }
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  attn::util::SetUsageConfigForMain("client/attnctl.cc", "attnctl (attnd tools)");
  absl::SetProgramUsageMessage(
      "attnctl [--target HOST:PORT] info | health | attend [shape flags] [--check]");
  std::vector<std::string> args = attn::util::NormalizeFlagNames(argc, argv);
  std::vector<char*> argp = attn::util::ArgvOf(args);
  std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  if (positional.size() != 2) {
    std::cerr << "usage: attnctl [--target HOST:PORT] info | health | attend [flags]\n"
              << "       attnctl --help for all flags" << std::endl;
    return 64;
  }
  attn::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.lb_policy = absl::GetFlag(FLAGS_lb);
  options.connections = absl::GetFlag(FLAGS_connections);
  options.bearer_token = ReadToken(absl::GetFlag(FLAGS_token_file));
  options.tls_ca_pem = ReadFile("tls_ca", absl::GetFlag(FLAGS_tls_ca));
  options.tls_cert_pem = ReadFile("tls_cert", absl::GetFlag(FLAGS_tls_cert));
  options.tls_key_pem = ReadFile("tls_key", absl::GetFlag(FLAGS_tls_key));
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  auto client = Client::Create(options);
  if (!client.ok()) return Fail(client.status());
  const std::string command = positional[1];
  if (command == "info") return Info(**client);
  if (command == "health") return Health(**client);
  if (command == "attend") return Attend(**client);
  std::cerr << "attnctl: unknown command '" << command << "' (info, health, attend)" << std::endl;
  return 64;
}
