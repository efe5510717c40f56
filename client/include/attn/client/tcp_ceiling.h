// The raw TCP ceiling on loopback: what the wire itself moves with the message sizes and
// concurrency of a gRPC benchmark, so that gRPC's share of it is measured in the same run on the
// same host. Each connection runs a closed loop of calls: the client writes a request of
// request_bytes (after an 8-byte length), the server reads it all and writes response_bytes back,
// like an Echo call; no framing, no copies beyond the socket's own.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace attn::client {

struct TcpCeilingOptions {
  size_t request_bytes = 1 << 20;
  size_t response_bytes = 1 << 20;
  int connections = 1;     // each with a client thread and a server thread
  double seconds = 2.0;    // measured time
  double warmup_s = 0.3;   // unmeasured time before it
};

struct TcpCeilingResult {
  int64_t calls = 0;
  double seconds = 0;
  double CallsPerSecond() const { return seconds > 0 ? calls / seconds : 0; }
  // Request plus response bytes per second, in GB/s (1e9), as attn-bench counts gRPC's.
  double GigabytesPerSecond(const TcpCeilingOptions& o) const {
    return CallsPerSecond() * double(o.request_bytes + o.response_bytes) / 1e9;
  }
};

// Runs the measurement in this process over 127.0.0.1 (an OS-chosen port).
absl::StatusOr<TcpCeilingResult> MeasureTcpCeiling(const TcpCeilingOptions& options);

}  // namespace attn::client
