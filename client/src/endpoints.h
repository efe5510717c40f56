// Resolving a gRPC target into the addresses behind it (inside the client library).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attn::client::internal {

struct Endpoint {
  std::string address;  // a channel target for this one address: "ipv4:10.0.0.5:50051"
  std::string host;     // the DNS name it came from ("" for literal addresses): for TLS names
};

// See ResolveTarget in attn/client/session.h.
absl::StatusOr<std::vector<Endpoint>> ResolveEndpoints(const std::string& target);

}  // namespace attn::client::internal
