// attnctl: talk to attnd from the command line.
//   attnctl [--target HOST:PORT] [--lb round_robin] info
//   attnctl [--target HOST:PORT] health [--service NAME]
//   attnctl [--target HOST:PORT] attend [--seq S] [--kv-seq SK] [--batch B] [--heads H]
//           [--kv-heads HKV] [--head-dim D] [--dtype bf16|fp16|fp32|fp8] [--kv_dtype fp8]
//           [--o_dtype bf16|fp16] [--fp8_per_head] [--causal] [--lse] [--count N] [--check]
//   attnctl [--target T] session demo [--layers L] [--kv-heads HKV] [--heads H] [--head-dim D]
//           [--dtype bf16|fp16] [--prefill N] [--chunk C] [--decode N] [--truncate N] [--lse]
//           [--check]
// --target may name many replicas (ipv4:H1:P1,H2:P2, or a DNS name with many addresses such as
// a Kubernetes headless Service): `session` creates its session on the one with the most free
// KV pages and sends every call on it there.
#include <algorithm>
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/client/client.h"
#include "attn/client/session.h"
#include "attn/kernels/cpu_attention.h"
#include "attn/util/flag_names.h"
#include "attn/util/usage.h"
#include "session_demo.h"

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
ABSL_FLAG(int, heads, 8, "attend, session: query heads");
ABSL_FLAG(int, kv_heads, 0, "attend, session: KV heads (0: same as --heads)");
ABSL_FLAG(int, head_dim, 64, "attend, session: head dimension");
ABSL_FLAG(std::string, dtype, "bf16",
          "attend: bf16, fp16, fp32 or fp8 (q, k and v as E4M3 codes with descales, o in "
          "--o_dtype); session: bf16 or fp16");
ABSL_FLAG(std::string, o_dtype, "bf16", "attend --dtype=fp8: the output's type, bf16 or fp16");
ABSL_FLAG(bool, fp8_per_head, false,
          "attend with FP8 tensors: descales per (sequence, KV head) instead of one per tensor");
ABSL_FLAG(bool, causal, false, "attend: causal mask");
ABSL_FLAG(int, window_left, -1, "attend, session: sliding window, keys to the left (-1: none)");
ABSL_FLAG(int, window_right, -1, "attend: sliding window, keys to the right (-1: none)");
ABSL_FLAG(bool, lse, false, "attend, session: ask for the log-sum-exp too");
ABSL_FLAG(int, count, 1, "attend: requests to send, one after another");
ABSL_FLAG(bool, check, false,
          "attend: compare each answer with the CPU backend run locally and print PASS or FAIL "
          "(exit 3) against the dtype's tolerance; session: compare each step with a float64 "
          "reference over the cache, and check the contract (token counts, NOT_FOUND after close)");
ABSL_FLAG(double, check_tolerance, 0,
          "attend --check: largest relative error that passes; 0: the dtype's (fp32 1e-4, fp16 "
          "3e-3, bf16 1.5e-2, of o's type with FP8 q; 4e-2 where the server runs all-FP8 attention "
          "on FP8 tensor cores)");
ABSL_FLAG(uint64_t, seed, 0, "attend, session: random seed (0: from the clock)");
ABSL_FLAG(int, timeout_ms, 60000, "Deadline of each call, milliseconds");
ABSL_FLAG(int, connections, 1,
          "HTTP/2 connections to --target (ClientOptions::connections; 0: min(4, hardware "
          "threads)); attnctl sends one call at a time, so one is enough");
ABSL_FLAG(int, layers, 2, "session: layers of the session");
ABSL_FLAG(std::string, kv_dtype, "",
          "attend: fp8 sends k and v as E4M3 codes with descales (q in --dtype); "
          "session: the cache's dtype: fp8 (E4M3, scale 2/448 per KV head; the server quantizes "
          "k_new/v_new) or empty (--dtype)");
ABSL_FLAG(int, prefill, 100, "session: prefill tokens per layer");
ABSL_FLAG(int, chunk, 0, "session: prefill chunk, tokens per step (0: the whole prefill in one step)");
ABSL_FLAG(int, decode, 20, "session: decode tokens (one step per layer each)");
ABSL_FLAG(int, truncate, 4, "session: tokens dropped from every layer after the decode (0: none)");
ABSL_FLAG(int, fork_decode, 2,
          "session: after forking, decode tokens on the fork and on the parent each (0: no fork)");

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
            << "replica:        " << info->replica_id() << "\n"
            << "kv cache:       " << info->kv_cache().capacity_bytes() << " bytes, "
            << info->kv_cache().total_pages() << " pages of " << info->kv_cache().page_tokens()
            << " tokens, " << info->kv_cache().free_pages() << " free\n"
            << "sessions:       " << info->kv_cache().sessions() << " open, at most "
            << info->limits().max_sessions() << ", " << info->limits().max_session_tokens()
            << " tokens each, TTL " << info->kv_cache().session_ttl_seconds() << " s\n"
            << "fp8:            attend k/v " << (info->fp8().attend_fp8_kv() ? "yes" : "no")
            << ", attend q/k/v " << (info->fp8().attend_fp8_q() ? "yes" : "no")
            << ", session cache " << (info->fp8().session_fp8_cache() ? "yes" : "no")
            << (info->fp8().session_fp8_max_step_tokens() > 0
                    ? absl::StrCat(" (at most ", info->fp8().session_fp8_max_step_tokens(),
                                   " new tokens per step)")
                    : std::string())
            << (info->fp8().attend_tensor_core_head_dims_size() > 0
                    ? absl::StrCat(", attend on FP8 tensor cores at head dims ",
                                   absl::StrJoin(info->fp8().attend_tensor_core_head_dims(), ","))
                    : std::string())
            << "\n"
            << "build:          " << info->build_info() << std::endl;
  return 0;
}

int Health(Client& client) {
  auto serving = client.Health(absl::GetFlag(FLAGS_service));
  if (!serving.ok()) return Fail(serving.status());
  std::cout << (*serving ? "SERVING" : "NOT_SERVING") << std::endl;
  return *serving ? 0 : 1;
}

// A random request tensor [batch * rows, heads, d] of values in [-1, 1): in `dtype`, or, for
// kFloat8E4M3, the E4M3 codes of the values over their descale (amax / 448 of the values it
// covers: the whole tensor, or with per_head each (sequence, KV head), a KV head covering
// heads / kv_heads adjacent heads). `values` are what the request stands for (FP8: code value
// times descale), as the check computes with them.
struct RandomInput {
  Tensor tensor;
  std::vector<float> descale;
  std::vector<float> values;
};

RandomInput MakeInput(DType dtype, int batch, int rows, int heads, int kv_heads, int d, bool per_head,
                      std::mt19937_64& rng) {
  const int64_t n = int64_t(batch) * rows * heads * d;
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  const std::vector<int64_t> shape = {int64_t(batch) * rows, heads, d};
  RandomInput in;
  if (dtype != DType::kFloat8E4M3) {
    in.tensor = Tensor::FromFloats(dtype, shape, v);
    in.values = in.tensor.ToFloats();
    return in;
  }
  const int per_kv = heads / kv_heads * d;  // values of one KV head's group in a row
  const int entries = per_head ? batch * kv_heads : 1;
  auto entry_of = [&](int64_t i) {
    const int64_t row = i / (int64_t(heads) * d);
    return per_head ? int(row / rows) * kv_heads + int(i % (int64_t(heads) * d) / per_kv) : 0;
  };
  std::vector<float> amax(entries, 0.0f);
  for (int64_t i = 0; i < n; ++i) amax[entry_of(i)] = std::max(amax[entry_of(i)], std::fabs(v[i]));
  for (float a : amax) in.descale.push_back(a > 0 ? a / 448.0f : 1.0f);
  std::vector<float> scaled(n);
  for (int64_t i = 0; i < n; ++i) scaled[i] = v[i] / in.descale[entry_of(i)];
  in.tensor = Tensor::FromFloats(dtype, shape, scaled);
  in.values = in.tensor.ToFloats();
  for (int64_t i = 0; i < n; ++i) in.values[i] *= in.descale[entry_of(i)];
  return in;
}

// Relative L2 error of the server's O against the CPU backend computed here, in float32, on the
// values the request stands for.
absl::StatusOr<double> CheckAgainstCpu(const RandomInput& q, const RandomInput& k,
                                       const RandomInput& v, const attn::client::AttendOptions& o,
                                       const Tensor& got) {
  const std::vector<float>& qf = q.values;
  const std::vector<float>& kf = k.values;
  const std::vector<float>& vf = v.values;
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
  a.total_q = static_cast<int32_t>(q.tensor.shape[0]);
  a.total_k = static_cast<int32_t>(k.tensor.shape[0]);
  a.max_seqlen_q = a.total_q;
  a.max_seqlen_k = a.total_k;
  a.num_heads = static_cast<int32_t>(q.tensor.shape[1]);
  a.num_kv_heads = static_cast<int32_t>(k.tensor.shape[1]);
  a.head_dim = static_cast<int32_t>(q.tensor.shape[2]);
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
  const std::string kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  if (!kv_dtype.empty() && kv_dtype != "fp8") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--kv_dtype must be fp8 or empty, got '", kv_dtype, "'")));
  }
  const bool fp8_q = *dtype == DType::kFloat8E4M3;
  const DType kv_type = fp8_q || kv_dtype == "fp8" ? DType::kFloat8E4M3 : *dtype;
  auto o_dtype = attn::client::ParseDType(absl::GetFlag(FLAGS_o_dtype));
  if (fp8_q && (!o_dtype.ok() || (*o_dtype != DType::kBFloat16 && *o_dtype != DType::kFloat16))) {
    return Fail(absl::InvalidArgumentError("--o_dtype must be bf16 or fp16 with --dtype=fp8"));
  }
  const bool per_head = absl::GetFlag(FLAGS_fp8_per_head);
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
  if (fp8_q) options.o_dtype = *o_dtype;
  // The server computes on exactly the values the codes and descales stand for: what is left is
  // its 16-bit arithmetic (FP8 k and v with float32 q compute in fp16 on a GPU), or, where the
  // server runs all-FP8 attention of this head dim on its FP8 tensor cores (GetServerInfo), their
  // rounding of P.
  bool tensor_cores = false;
  if (fp8_q && s_q > 16 && absl::GetFlag(FLAGS_check)) {
    auto info = client.GetServerInfo();
    if (!info.ok()) return Fail(info.status());
    const auto& dims = info->fp8().attend_tensor_core_head_dims();
    tensor_cores = std::find(dims.begin(), dims.end(), d) != dims.end();
  }
  const DType computed = fp8_q ? *o_dtype
                         : kv_type == DType::kFloat8E4M3 && *dtype == DType::kFloat32 ? DType::kFloat16
                                                                                      : *dtype;
  const double tolerance =
      absl::GetFlag(FLAGS_check_tolerance) > 0 ? absl::GetFlag(FLAGS_check_tolerance)
      : tensor_cores                           ? 4e-2
      : computed == DType::kFloat32            ? 1e-4
      : computed == DType::kFloat16            ? 3e-3
                                               : 1.5e-2;

  const int count = absl::GetFlag(FLAGS_count);
  double worst = 0;  // largest relative error seen with --check
  std::printf("%-6s %12s %12s %12s %12s %12s %s\n", "req", "client_us", "total_us", "queue_us",
              "transfer_us", "compute_us", absl::GetFlag(FLAGS_check) ? "rel_err" : "");
  for (int i = 0; i < count; ++i) {
    const RandomInput q = MakeInput(*dtype, batch, s_q, h, h_kv, d, per_head, rng);
    const RandomInput k = MakeInput(kv_type, batch, s_k, h_kv, h_kv, d, per_head, rng);
    const RandomInput v = MakeInput(kv_type, batch, s_k, h_kv, h_kv, d, per_head, rng);
    options.q_descale = q.descale;
    options.k_descale = k.descale;
    options.v_descale = v.descale;
    const auto start = std::chrono::steady_clock::now();
    auto result = client.Attend(q.tensor, k.tensor, v.tensor, options);
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
        std::printf("\ncheck: FAIL: request %d differs from the CPU backend: relative error %.2e "
                    "> tolerance %.1e (%s)\n",
                    i, *err, tolerance, absl::GetFlag(FLAGS_dtype).c_str());
        return 3;
      }
      worst = std::max(worst, *err);
    }
    std::printf("\n");
  }
  if (absl::GetFlag(FLAGS_check)) {
    std::printf("check: PASS: %d answers agree with the CPU backend: largest relative error %.2e "
                "<= tolerance %.1e (%s)\n",
                count, worst, tolerance, absl::GetFlag(FLAGS_dtype).c_str());
  }
  return 0;
}

// attnctl session demo: see session_demo.h.
int Session(const std::vector<std::string>& args, const attn::client::ClientOptions& client_options) {
  if (args.size() != 1 || args[0] != "demo") {
    std::cerr << "usage: attnctl [--target T] session demo [flags]" << std::endl;
    return 64;
  }
  attn::client::SessionDemoOptions o;
  auto dtype = attn::client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(dtype.status());
  o.dtype = *dtype;
  const std::string kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  if (!kv_dtype.empty() && kv_dtype != "fp8") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--kv_dtype must be fp8 or empty, got '", kv_dtype, "'")));
  }
  o.kv_fp8 = kv_dtype == "fp8";
  o.layers = absl::GetFlag(FLAGS_layers);
  o.heads = absl::GetFlag(FLAGS_heads);
  o.kv_heads = absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads) : o.heads;
  o.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.prefill = absl::GetFlag(FLAGS_prefill);
  o.chunk = absl::GetFlag(FLAGS_chunk);
  o.decode = absl::GetFlag(FLAGS_decode);
  o.truncate = absl::GetFlag(FLAGS_truncate);
  o.fork_decode = absl::GetFlag(FLAGS_fork_decode);
  o.lse = absl::GetFlag(FLAGS_lse);
  o.check = absl::GetFlag(FLAGS_check);
  o.window_left = absl::GetFlag(FLAGS_window_left);
  o.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  o.seed = absl::GetFlag(FLAGS_seed);
  if (o.seed == 0) o.seed = std::chrono::steady_clock::now().time_since_epoch().count();
  // The server checks what it is sent; these are what the local mirror of the cache relies on.
  if (o.layers < 1 || o.heads < 1 || o.kv_heads < 1 || o.head_dim < 1 || o.prefill < 0 || o.chunk < 0 ||
      o.decode < 0 || o.truncate < 0 || o.fork_decode < 0 || o.heads % o.kv_heads != 0) {
    std::cerr << "attnctl: session: --layers, --heads, --kv-heads and --head-dim must be positive, "
                 "--heads a multiple of --kv-heads, the token counts >= 0" << std::endl;
    return 64;
  }
  if (o.prefill + o.decode == 0) {
    std::cerr << "attnctl: session: --prefill and --decode are both 0: nothing to do" << std::endl;
    return 64;
  }
  attn::client::SessionClientOptions so;
  so.client = client_options;
  auto sessions = attn::client::SessionClient::Create(so);
  if (!sessions.ok()) return Fail(sessions.status());
  return attn::client::RunSessionDemo(**sessions, o);
}

}  // namespace

int main(int argc, char** argv) {
  attn::util::SetUsageConfigForMain("client/attnctl.cc", "attnctl (attnd tools)");
  absl::SetProgramUsageMessage(
      "attnctl [--target HOST:PORT] info | health | attend [shape flags] [--check] | "
      "session demo [shape flags] [--check]");
  std::vector<std::string> args = attn::util::NormalizeFlagNames(argc, argv);
  std::vector<char*> argp = attn::util::ArgvOf(args);
  std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  if (positional.size() < 2) {
    std::cerr << "usage: attnctl [--target HOST:PORT] info | health | attend [flags] | session demo [flags]\n"
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
  if (command == "session") {
    return Session(std::vector<std::string>(positional.begin() + 2, positional.end()), options);
  }
  if (positional.size() != 2) {
    std::cerr << "attnctl: '" << command << "' takes no arguments" << std::endl;
    return 64;
  }
  if (command == "info") return Info(**client);
  if (command == "health") return Health(**client);
  if (command == "attend") return Attend(**client);
  std::cerr << "attnctl: unknown command '" << command << "' (info, health, attend, session)" << std::endl;
  return 64;
}
