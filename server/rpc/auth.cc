#include "rpc/auth.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attn {
namespace {

// Equality whose time depends on the lengths only, not on where the strings differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> ReadSecretFile(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": error reading '", path, "'"));
  }
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerOptions& options) {
  const bool has_cert = !options.tls_cert.empty();
  const bool has_key = !options.tls_key.empty();
  if (has_cert != has_key) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (!has_cert) {
    if (!options.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca (mTLS) needs TLS: give --tls_cert and --tls_key too");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadSecretFile("--tls_cert", options.tls_cert);
  if (!cert.ok()) return cert.status();
  auto key = ReadSecretFile("--tls_key", options.tls_key);
  if (!key.ok()) return key.status();
  if (cert->find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert: '", options.tls_cert, "' holds no PEM certificate"));
  }
  if (key->find("PRIVATE KEY-----") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: '", options.tls_key, "' holds no PEM private key"));
  }
  pair.cert_chain = std::move(*cert);
  pair.private_key = std::move(*key);
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!options.tls_client_ca.empty()) {
    auto ca = ReadSecretFile("--tls_client_ca", options.tls_client_ca);
    if (!ca.ok()) return ca.status();
    if (ca->find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca: '", options.tls_client_ca, "' holds no PEM certificate"));
    }
    ssl.pem_root_certs = std::move(*ca);
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(const std::string& path) {
  auto text = ReadSecretFile("--auth_token_file", path);
  if (!text.ok()) return text.status();
  std::vector<std::string> tokens;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_token_file: '", path, "' holds no token (one per line)"));
  }
  return FromTokens(std::move(tokens));
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromTokens(
    std::vector<std::string> tokens) {
  if (tokens.empty()) return absl::InvalidArgumentError("no bearer token given");
  for (const std::string& t : tokens) {
    if (t.empty()) return absl::InvalidArgumentError("empty bearer token");
    for (char c : t) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c)) ||
          !absl::ascii_isprint(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(
            "bearer tokens must be printable ASCII without spaces");
      }
    }
  }
  return std::unique_ptr<Authenticator>(new Authenticator(std::move(tokens)));
}

absl::StatusOr<std::string> Authenticator::Check(std::string_view authorization) const {
  absl::string_view value(authorization.data(), authorization.size());
  value = absl::StripAsciiWhitespace(value);
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "the authorization metadata must be 'Bearer <token>'");
  }
  value = absl::StripLeadingAsciiWhitespace(value.substr(kScheme.size()));
  // Every token is compared, so that the time does not tell which one (or whether one) matched.
  int match = -1;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (ConstantTimeEquals(std::string_view(value.data(), value.size()), tokens_[i]) &&
        match < 0) {
      match = static_cast<int>(i);
    }
  }
  if (match < 0) return absl::UnauthenticatedError("invalid bearer token");
  return absl::StrCat("token:", match);
}

absl::StatusOr<std::string> Authenticator::TokenOf(const std::string& identity) const {
  constexpr absl::string_view kPrefix = "token:";
  size_t i = 0;
  if (!absl::StartsWith(identity, kPrefix) ||
      !absl::SimpleAtoi(absl::string_view(identity).substr(kPrefix.size()), &i) ||
      i >= tokens_.size()) {
    return absl::NotFoundError(absl::StrCat("no bearer token for identity '", identity, "'"));
  }
  return tokens_[i];
}

absl::StatusOr<std::string> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return absl::UnauthenticatedError(
        "missing bearer token: send 'authorization: Bearer <token>' metadata");
  }
  return Check(std::string_view(it->second.data(), it->second.size()));
}

std::string PeerHost(const std::string& peer) {
  if (peer.rfind("ipv4:", 0) != 0 && peer.rfind("ipv6:", 0) != 0) return peer;
  const size_t colon = peer.rfind(':');
  if (colon == std::string::npos || colon < 5) return peer;
  // ipv6 literals end with ']' before the port; a last ':' inside brackets is not a port.
  if (peer.rfind("ipv6:", 0) == 0 && peer.find(']') != std::string::npos &&
      colon < peer.rfind(']')) {
    return peer;
  }
  return peer.substr(0, colon);
}

absl::StatusOr<std::shared_ptr<PendingLimiter::Slot>> PendingLimiter::Acquire(
    const std::string& key) {
  if (max_ <= 0) return std::make_shared<Slot>(nullptr, std::string());
  {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t& n = pending_[key];
    if (n >= max_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this client already has ", n, " pending requests (--max_pending_per_client ", max_,
          "); wait for some to finish"));
    }
    ++n;
    ++total_;
  }
  return std::make_shared<Slot>(this, key);
}

void PendingLimiter::Release(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(key);
  if (it == pending_.end()) return;
  --total_;
  if (--it->second <= 0) pending_.erase(it);
}

int64_t PendingLimiter::Pending(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(key);
  return it == pending_.end() ? 0 : it->second;
}

int64_t PendingLimiter::TotalPending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

}  // namespace attn
