#include "rpc/session_handoff.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/support/channel_arguments.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <iostream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_util.h"
#include "observability/metrics.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "sessions/session_manager.h"
#include "sessions/session_transfer.h"

namespace attn {
namespace {

void Log(const std::string& msg) { std::cerr << "attnd: " << msg << std::endl; }

v1::DType WireDType(kernels::DType d) {
  switch (d) {
    case kernels::DType::kFloat16: return v1::DTYPE_FLOAT16;
    case kernels::DType::kBFloat16: return v1::DTYPE_BFLOAT16;
    case kernels::DType::kFloat8E4M3: return v1::DTYPE_FLOAT8_E4M3;
    default: return v1::DTYPE_UNSPECIFIED;
  }
}

void HeaderToWire(const SessionTransferHeader& h, const std::string& id,
                  v1::SessionTransferHeader* out) {
  out->set_num_layers(h.shape.num_layers);
  out->set_num_kv_heads(h.shape.num_kv_heads);
  out->set_head_dim(h.shape.head_dim);
  out->set_dtype(WireDType(h.shape.dtype));
  out->set_max_tokens(h.shape.max_tokens);
  out->set_page_tokens(h.shape.page_tokens);
  out->set_page_span(h.shape.page_span);
  if (h.shape.cache_dtype) {
    out->set_cache_dtype(WireDType(*h.shape.cache_dtype));
    out->mutable_k_scales()->Assign(h.shape.k_scales.begin(), h.shape.k_scales.end());
    out->mutable_v_scales()->Assign(h.shape.v_scales.begin(), h.shape.v_scales.end());
  }
  out->set_page_bytes(h.page_bytes);
  out->mutable_layer_tokens()->Assign(h.layer_tokens.begin(), h.layer_tokens.end());
  out->mutable_layer_pages()->Assign(h.layer_pages.begin(), h.layer_pages.end());
  out->set_source_session_id(id);
}

}  // namespace

const char* HandoffResultOf(const absl::Status& st) {
  switch (st.code()) {
    case absl::StatusCode::kOk: return "moved";
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied: return "refused";
    case absl::StatusCode::kResourceExhausted: return "peer_full";
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled: return "peer_unavailable";
    case absl::StatusCode::kDataLoss: return "checksum";
    case absl::StatusCode::kDeadlineExceeded: return "timeout";
    case absl::StatusCode::kUnimplemented: return "unsupported";
    default: return "error";
  }
}

absl::StatusOr<std::unique_ptr<SessionHandoff>> SessionHandoff::Create(
    Options options, SessionManager* sessions, const Authenticator* authenticator,
    Metrics* metrics) {
  if (sessions == nullptr) return absl::InvalidArgumentError("--handoff_peers: no sessions");
  for (const std::string& p : options.peers) {
    if (p.empty() || p.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--handoff_peers entries are host:port, got '", p, "'"));
    }
  }
  return std::unique_ptr<SessionHandoff>(
      new SessionHandoff(std::move(options), sessions, authenticator, metrics));
}

SessionHandoff::SessionHandoff(Options options, SessionManager* sessions,
                               const Authenticator* authenticator, Metrics* metrics)
    : options_(std::move(options)),
      sessions_(sessions),
      authenticator_(authenticator),
      metrics_(metrics) {}

std::vector<std::string> SessionHandoff::ResolvePeers() const {
  std::vector<std::string> out;
  for (const std::string& peer : options_.peers) {
    constexpr absl::string_view kDns = "dns:///";
    if (!absl::StartsWith(peer, kDns)) {
      out.push_back(peer);
      continue;
    }
    const std::string hostport = peer.substr(kDns.size());
    const size_t colon = hostport.rfind(':');
    const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) {
      Log(absl::StrCat("hand-off: ", peer, " does not resolve"));
      continue;
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char ip[INET6_ADDRSTRLEN] = {};
      const void* addr =
          a->ai_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
      if (inet_ntop(a->ai_family, addr, ip, sizeof(ip)) == nullptr) continue;
      std::string address = a->ai_family == AF_INET ? absl::StrCat(ip, ":", port)
                                                     : absl::StrCat("[", ip, "]:", port);
      if (std::find(out.begin(), out.end(), address) == out.end()) out.push_back(address);
    }
    freeaddrinfo(found);
  }
  return out;
}

void SessionHandoff::Connect(const std::vector<std::string>& peers) {
  stubs_.clear();
  for (const std::string& peer : peers) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
    args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
    if (!options_.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options_.tls_server_name);
    }
    auto creds = options_.credentials ? options_.credentials : grpc::InsecureChannelCredentials();
    stubs_.push_back(
        v1::Attention::NewStub(grpc::CreateCustomChannel(peer, creds, args)));
  }
}

absl::StatusOr<std::string> SessionHandoff::SendTo(size_t p, const Session& session,
                                                   Clock::time_point deadline, int64_t* bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<SessionExporter> exporter,
                   SessionExporter::Create(session, &sessions_->pool(), options_.kv_region,
                                           options_.kv_device));
  // A peer that stops reading (hung, not gone) holds one attempt, not the whole drain: 5 s plus
  // the session's bytes at 50 MB/s, a tenth of the slowest rate measured, at most.
  const int64_t kv_bytes = 2 * exporter->header().page_bytes * exporter->header().TotalPages();
  const auto attempt = std::chrono::seconds(5) + std::chrono::milliseconds(kv_bytes / 50'000);
  const Clock::time_point until = std::min(deadline, Clock::now() + attempt);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + (until - Clock::now()));
  if (authenticator_ != nullptr) {
    ASSIGN_OR_RETURN(std::string token, authenticator_->TokenOf(session.owner()));
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }
  v1::ImportSessionResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::SessionTransferChunk>> stream =
      stubs_[p]->ImportSession(&ctx, &response);
  v1::SessionTransferChunk chunk;
  HeaderToWire(exporter->header(), session.id(), chunk.mutable_header());
  // A failed write means the call has ended: Finish says why.
  bool ok = stream->Write(chunk);
  int64_t sent = 0;
  while (ok) {
    std::optional<SessionTransferPage> page = exporter->Next();
    if (!page) break;
    v1::SessionTransferPage* wire = chunk.mutable_page();
    wire->set_index(page->index);
    wire->set_kv(std::move(page->kv));
    wire->set_crc32c(page->crc32c);
    sent += static_cast<int64_t>(wire->kv().size());
    ok = stream->Write(chunk);
  }
  if (!exporter->status().ok()) {
    // The peer sees the call cancelled and frees what it took.
    ctx.TryCancel();
    (void)stream->Finish();
    return exporter->status();
  }
  if (ok) stream->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(stream->Finish()));
  if (response.session_id().empty()) {
    return absl::InternalError("the peer answered ImportSession without a session id");
  }
  *bytes = sent;
  return response.session_id();
}

void SessionHandoff::Record(const std::string& id, const std::string& result,
                            const std::string& why) {
  if (metrics_) metrics_->AddSessionHandoff(result);
  if (result != "moved") Log(absl::StrCat("hand-off: session ", id, " not moved (", result, "): ", why));
}

SessionHandoff::Summary SessionHandoff::MoveAll(Clock::time_point deadline) {
  std::lock_guard<std::mutex> running(running_mu_);
  Summary summary;
  const std::vector<std::string> peers = ResolvePeers();
  Connect(peers);
  const std::vector<std::string> ids = sessions_->OpenSessionIds();
  Log(absl::StrCat("hand-off: moving ", ids.size(), " sessions to ", peers.size(), " peers (",
                   absl::StrJoin(peers, ", "), ")"));
  size_t turn = 0;
  for (const std::string& id : ids) {
    auto not_moved = [&](const std::string& result, const std::string& why) {
      ++summary.not_moved;
      Record(id, result, why);
    };
    if (stop_.load()) {
      not_moved("stopped", "a second signal ended the hand-off");
      continue;
    }
    if (peers.empty()) {
      not_moved("no_peer", "no --handoff_peers");
      continue;
    }
    // Frozen, no step begins any more; those that had begun end first.
    absl::StatusOr<std::shared_ptr<Session>> session = sessions_->BeginMove(id);
    if (absl::IsNotFound(session.status())) continue;  // closed (or expired) meanwhile
    if (!session.ok()) {
      not_moved("error", std::string(session.status().message()));
      continue;
    }
    while (!(*session)->Settled() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (!(*session)->Settled()) {
      sessions_->EndMove(*session, "", "");
      not_moved("busy", "a step it had begun did not end before the drain's deadline");
      continue;
    }
    absl::Status last = absl::DeadlineExceededError("drain_timeout_s ran out before a peer took it");
    std::string new_id, address;
    int64_t bytes = 0;
    for (size_t k = 0; k < peers.size() && Clock::now() < deadline; ++k) {
      const size_t p = (turn + k) % peers.size();
      absl::StatusOr<std::string> moved = SendTo(p, **session, deadline, &bytes);
      if (moved.ok()) {
        new_id = *moved;
        address = peers[p];
        turn = p + 1;  // the next session starts at the next peer
        break;
      }
      last = absl::Status(moved.status().code(),
                          absl::StrCat(peers[p], ": ", moved.status().message()));
    }
    sessions_->EndMove(*session, address, new_id);
    if (new_id.empty()) {
      not_moved(HandoffResultOf(last), std::string(last.message()));
      continue;
    }
    ++summary.moved;
    summary.bytes += bytes;
    if (metrics_) metrics_->AddSessionHandoffBytes(bytes);
    Record(id, "moved", "");
  }
  return summary;
}

void SessionHandoff::Stop() {
  stop_.store(true);
  std::lock_guard<std::mutex> wait_for_move_all(running_mu_);
}

}  // namespace attn
