#include "endpoints.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attn::client::internal {
namespace {

// Schemes whose target is one address already, or that gRPC resolves in ways of its own.
bool PassThroughScheme(const std::string& target) {
  for (const char* s : {"unix:", "unix-abstract:", "vsock:", "xds:", "google-c2p:"}) {
    if (absl::StartsWith(target, s)) return true;
  }
  return false;
}

// "host:port" or "[v6]:port" -> host and port.
absl::Status SplitHostPort(const std::string& target, const std::string& hostport, std::string* host,
                           std::string* port) {
  size_t colon;
  if (!hostport.empty() && hostport[0] == '[') {
    const size_t close = hostport.find(']');
    if (close == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("target '", target, "': unclosed '['"));
    }
    *host = hostport.substr(1, close - 1);
    colon = close + 1;
    if (colon >= hostport.size() || hostport[colon] != ':') colon = std::string::npos;
  } else {
    colon = hostport.rfind(':');
    *host = hostport.substr(0, colon);
  }
  if (colon == std::string::npos || colon + 1 >= hostport.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("target '", target, "' has no port (expected host:port, e.g. ",
                     "attnd-headless.attnd.svc.cluster.local:50051)"));
  }
  *port = hostport.substr(colon + 1);
  if (host->empty()) return absl::InvalidArgumentError(absl::StrCat("target '", target, "' has no host"));
  return absl::OkStatus();
}

// Every address `host` resolves to now, as channel targets, in the resolver's order.
absl::StatusOr<std::vector<Endpoint>> ResolveName(const std::string& target, const std::string& host,
                                                  const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &list);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("target '", target, "': cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  // A literal address stands for itself: no name to check a certificate against.
  in6_addr probe;
  const bool literal = inet_pton(AF_INET, host.c_str(), &probe) == 1 || inet_pton(AF_INET6, host.c_str(), &probe) == 1;
  std::vector<Endpoint> out;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    std::string address;
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof(text));
      address = absl::StrCat("ipv4:", text, ":", port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text, sizeof(text));
      address = absl::StrCat("ipv6:[", text, "]:", port);
    } else {
      continue;
    }
    const bool seen = std::any_of(out.begin(), out.end(), [&](const Endpoint& e) { return e.address == address; });
    if (!seen) out.push_back({address, literal ? "" : host});
  }
  freeaddrinfo(list);
  if (out.empty()) {
    return absl::UnavailableError(absl::StrCat("target '", target, "': '", host, "' has no address"));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<Endpoint>> ResolveEndpoints(const std::string& target) {
  if (target.empty()) return absl::InvalidArgumentError("empty target");
  if (PassThroughScheme(target)) return std::vector<Endpoint>{{target, ""}};
  for (const char* scheme : {"ipv4:", "ipv6:"}) {
    if (!absl::StartsWith(target, scheme)) continue;
    std::vector<Endpoint> out;
    for (absl::string_view a : absl::StrSplit(target.substr(std::string(scheme).size()), ',')) {
      std::string host, port;
      const absl::Status st = SplitHostPort(target, std::string(a), &host, &port);
      if (!st.ok()) return st;
      out.push_back({absl::StrCat(scheme, a), ""});
    }
    return out;
  }
  std::string hostport = target;
  if (absl::StartsWith(hostport, "dns:")) {
    hostport = hostport.substr(4);
    // dns://authority/host:port: the authority (a DNS server) is not honoured here; the
    // system resolver answers.
    if (absl::StartsWith(hostport, "//")) {
      const size_t slash = hostport.find('/', 2);
      if (slash == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("target '", target, "': expected dns:///host:port"));
      }
      hostport = hostport.substr(slash + 1);
    }
  }
  std::string host, port;
  const absl::Status st = SplitHostPort(target, hostport, &host, &port);
  if (!st.ok()) return st;
  return ResolveName(target, host, port);
}

}  // namespace attn::client::internal
