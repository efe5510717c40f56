// attn-tcp-ceiling: raw TCP on loopback with Echo-like calls (request out, response back), the
// ceiling that attn-bench compares gRPC with.
//   attn-tcp-ceiling --request_mb 1,8,64 --response_mb 0 --concurrency 1,16 --duration_s 3
// --response_mb 0: the response is as large as the request. Prints GB/s (request plus response
// bytes) and calls/s per (size, concurrency).
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "attn/client/tcp_ceiling.h"
#include "attn/util/flag_names.h"
#include "attn/util/usage.h"

ABSL_FLAG(std::string, request_mb, "1,8,64", "Comma-separated request sizes, MB (1e6 bytes)");
ABSL_FLAG(double, response_mb, 0, "Response size, MB; 0: the same as the request");
ABSL_FLAG(std::string, concurrency, "1,16", "Comma-separated connection counts");
ABSL_FLAG(double, duration_s, 3, "Measured seconds per point");

int main(int argc, char** argv) {
  attn::util::SetUsageConfigForMain("client/tcp_ceiling_main.cc", "attn-tcp-ceiling (attnd tools)");
  absl::SetProgramUsageMessage("attn-tcp-ceiling: raw TCP loopback ceiling (see the file's header)");
  std::vector<std::string> args = attn::util::NormalizeFlagNames(argc, argv);
  std::vector<char*> argp = attn::util::ArgvOf(args);
  absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  std::vector<double> sizes;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_request_mb), ',')) {
    double mb = 0;
    if (!absl::SimpleAtod(part, &mb) || mb <= 0) {
      std::cerr << "attn-tcp-ceiling: bad --request_mb entry '" << part << "'" << std::endl;
      return 64;
    }
    sizes.push_back(mb);
  }
  std::vector<int> levels;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',')) {
    int c = 0;
    if (!absl::SimpleAtoi(part, &c) || c < 1) {
      std::cerr << "attn-tcp-ceiling: bad --concurrency entry '" << part << "'" << std::endl;
      return 64;
    }
    levels.push_back(c);
  }
  std::printf("%12s %12s %5s %10s %9s\n", "request_MB", "response_MB", "conc", "calls/s", "GB/s");
  for (double mb : sizes) {
    for (int c : levels) {
      attn::client::TcpCeilingOptions o;
      o.request_bytes = static_cast<size_t>(mb * 1e6);
      const double resp_mb = absl::GetFlag(FLAGS_response_mb);
      o.response_bytes = resp_mb > 0 ? static_cast<size_t>(resp_mb * 1e6) : o.request_bytes;
      o.connections = c;
      o.seconds = absl::GetFlag(FLAGS_duration_s);
      auto r = attn::client::MeasureTcpCeiling(o);
      if (!r.ok()) {
        std::cerr << "attn-tcp-ceiling: " << r.status() << std::endl;
        return 1;
      }
      std::printf("%12.2f %12.2f %5d %10.1f %9.3f\n", o.request_bytes / 1e6,
                  o.response_bytes / 1e6, c, r->CallsPerSecond(), r->GigabytesPerSecond(o));
      std::fflush(stdout);
    }
  }
  return 0;
}
