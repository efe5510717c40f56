// Helpers for server tests: an in-process attnd on loopback, random requests, a subprocess
// attnd for end-to-end tests.
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attn/client/client.h"
#include "rpc/attn_server.h"
#include "common/reference.h"

namespace attn::testing {

// An AttnServer on 127.0.0.1 with an OS-chosen port and a client for it; the backend is the
// CPU one unless options name another.
struct LoopbackServer {
  std::unique_ptr<AttnServer> server;
  std::unique_ptr<client::Client> client;
  std::string target;
};
LoopbackServer StartLoopbackServer(ServerOptions options = {});
// The same, with its client made from client_options (target is filled in): for TLS and tokens.
LoopbackServer StartLoopbackServerWithClient(ServerOptions options,
                                             client::ClientOptions client_options);

// GET http://127.0.0.1:port<path> over a plain socket: the response body, or "" on failure.
std::string HttpGet(int port, const std::string& path);
// Sum of the samples of a Prometheus counter/gauge whose line has every one of the labels
// (e.g. {"code=\"UNAUTHENTICATED\"", "rpc=\"Attend\""}) in the text exposition format.
double MetricValue(const std::string& exposition, const std::string& name,
                   const std::vector<std::string>& labels);

struct RequestShape {
  int batch = 1;
  int seq_q = 32;
  int seq_k = 32;
  int heads = 4;
  int kv_heads = 2;
  int head_dim = 64;
  client::DType dtype = client::DType::kBFloat16;
  bool causal = false;
};

struct RandomRequest {
  client::Tensor q, k, v;
  client::AttendOptions options;
};
RandomRequest MakeRandomRequest(const RequestShape& shape, std::mt19937_64& rng);
// A request of random shape (dtype, GQA heads, head dim 32/64/128, batch up to 3, lengths up to
// max_len, causal or not) and random options: LSE asked or not, a window on one in four.
RandomRequest MakeRandomShapedRequest(std::mt19937_64& rng, int max_len);

// The float64 reference (o and lse) of a request, with its mask, window and scale.
ReferenceResult ReferenceFor(const RandomRequest& r);

// Relative L2 error of o against the float64 reference of the request, or +inf when o has the
// wrong size or non-finite values.
double ErrorAgainstReference(const RandomRequest& r, const client::Tensor& o);
double ToleranceFor(client::DType dtype);

// attnd as a child process, started with extra flags on 127.0.0.1 and ports it picks itself:
// $ATTND_BIN where set, else the attnd of this build.
class AttndProcess {
 public:
  static std::unique_ptr<AttndProcess> Start(const std::vector<std::string>& flags);
  ~AttndProcess();
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  // Sends sig and waits for the exit status (-1 on a timeout).
  int SignalAndWait(int sig, int timeout_ms);
  std::string Log() const;
  // The attnd process id (-1 once it has exited and been waited for).
  int pid() const { return pid_; }

 private:
  int pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string log_path_;
};

// Resident memory (VmRSS) of process pid from /proc/<pid>/status, in KiB; -1 when unreadable.
int64_t VmRssKiB(int pid);
// GETs /metrics from port and returns the value of one sample (summed over lines with all the
// labels, see MetricValue); NaN when the scrape fails.
double ScrapeMetric(int metrics_port, const std::string& name,
                    const std::vector<std::string>& labels = {});

}  // namespace attn::testing
