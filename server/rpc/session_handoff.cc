#include "rpc/session_handoff.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/support/channel_arguments.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <numeric>
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
  out->mutable_shared_pages()->Assign(h.shared_pages.begin(), h.shared_pages.end());
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

absl::StatusOr<std::vector<std::string>> SessionHandoff::SendTo(
    size_t p, const std::vector<std::shared_ptr<Session>>& sessions, Clock::time_point deadline,
    int64_t* bytes) {
  // Every exporter first (each holds its pages until the transfer ends), in one numbering: a page
  // a session shares with one before it is named in its header, not sent again.
  StreamPages numbering;
  std::vector<std::unique_ptr<SessionExporter>> exporters;
  int64_t kv_bytes = 0;
  for (const auto& s : sessions) {
    ASSIGN_OR_RETURN(std::unique_ptr<SessionExporter> e,
                     SessionExporter::Create(*s, &sessions_->pool(), options_.kv_region,
                                             options_.kv_device, &numbering));
    kv_bytes += 2 * e->header().page_bytes * e->header().OwnPages();
    exporters.push_back(std::move(e));
  }
  // A peer that stops reading (hung, not gone) holds one attempt, not the whole drain: 5 s plus
  // the family's bytes at 50 MB/s, a tenth of the slowest rate measured, at most.
  const auto attempt = std::chrono::seconds(5) + std::chrono::milliseconds(kv_bytes / 50'000);
  const Clock::time_point until = std::min(deadline, Clock::now() + attempt);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + (until - Clock::now()));
  if (authenticator_ != nullptr) {
    // A family has one owner (forks keep their parent's).
    ASSIGN_OR_RETURN(std::string token, authenticator_->TokenOf(sessions.front()->owner()));
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }
  v1::ImportSessionResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::SessionTransferChunk>> stream =
      stubs_[p]->ImportSession(&ctx, &response);
  // A failed write means the call has ended: Finish says why.
  bool ok = true;
  int64_t sent = 0;
  absl::Status read;
  for (size_t i = 0; ok && read.ok() && i < exporters.size(); ++i) {
    v1::SessionTransferChunk chunk;
    HeaderToWire(exporters[i]->header(), sessions[i]->id(), chunk.mutable_header());
    ok = stream->Write(chunk);
    while (ok) {
      std::optional<SessionTransferPage> page = exporters[i]->Next();
      if (!page) break;
      v1::SessionTransferPage* wire = chunk.mutable_page();
      wire->set_index(page->index);
      wire->set_kv(std::move(page->kv));
      wire->set_crc32c(page->crc32c);
      sent += static_cast<int64_t>(wire->kv().size());
      ok = stream->Write(chunk);
    }
    read = exporters[i]->status();
  }
  if (!read.ok()) {
    // The peer sees the call cancelled and frees what it took.
    ctx.TryCancel();
    (void)stream->Finish();
    return read;
  }
  if (ok) stream->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(stream->Finish()));
  std::vector<std::string> ids(response.session_ids().begin(), response.session_ids().end());
  // A peer that predates fork families names its one session in session_id only.
  if (ids.empty() && sessions.size() == 1 && !response.session_id().empty()) {
    ids.push_back(response.session_id());
  }
  if (ids.size() != sessions.size() ||
      std::any_of(ids.begin(), ids.end(), [](const std::string& id) { return id.empty(); })) {
    return absl::InternalError(absl::StrCat("the peer answered ImportSession of ",
                                            sessions.size(), " sessions with ", ids.size(),
                                            " session ids"));
  }
  *bytes = sent;
  return ids;
}

std::vector<SessionHandoff::Moved> SessionHandoff::MoveFamily(
    const std::vector<std::shared_ptr<Session>>& family, const std::vector<std::string>& peers,
    Clock::time_point deadline, size_t* turn, int64_t* bytes, absl::Status* last) {
  std::vector<Moved> moved(family.size());
  std::vector<size_t> left(family.size());
  std::iota(left.begin(), left.end(), size_t{0});
  for (size_t k = 0; k < peers.size() && !left.empty() && Clock::now() < deadline; ++k) {
    const size_t p = (*turn + k) % peers.size();
    std::vector<std::vector<size_t>> streams = {left};
    std::vector<size_t> still;
    for (size_t s = 0; s < streams.size(); ++s) {
      std::vector<std::shared_ptr<Session>> sessions;
      for (size_t i : streams[s]) sessions.push_back(family[i]);
      int64_t sent = 0;
      absl::StatusOr<std::vector<std::string>> ids = SendTo(p, sessions, deadline, &sent);
      if (ids.ok()) {
        for (size_t j = 0; j < streams[s].size(); ++j) moved[streams[s][j]] = {peers[p], (*ids)[j]};
        *bytes += sent;
        continue;
      }
      *last = absl::Status(ids.status().code(),
                           absl::StrCat(peers[p], ": ", ids.status().message()));
      // A peer without fork families refuses the second header: one session per stream there.
      if (absl::IsInvalidArgument(ids.status()) && streams[s].size() > 1) {
        const std::vector<size_t> one_by_one = streams[s];
        for (size_t i : one_by_one) streams.push_back({i});
        continue;
      }
      still.insert(still.end(), streams[s].begin(), streams[s].end());
    }
    if (still.size() < left.size()) *turn = p + 1;  // the next family starts at the next peer
    left = std::move(still);
  }
  return moved;
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
  const std::vector<std::vector<std::string>> families = sessions_->OpenSessionFamilies();
  size_t open = 0;
  for (const auto& f : families) open += f.size();
  Log(absl::StrCat("hand-off: moving ", open, " sessions (", families.size(),
                   " fork families) to ", peers.size(), " peers (", absl::StrJoin(peers, ", "),
                   ")"));
  size_t turn = 0;
  for (const std::vector<std::string>& ids : families) {
    auto not_moved = [&](const std::string& id, const std::string& result,
                         const std::string& why) {
      ++summary.not_moved;
      Record(id, result, why);
    };
    if (stop_.load() || peers.empty()) {
      for (const std::string& id : ids) {
        if (stop_.load()) {
          not_moved(id, "stopped", "a second signal ended the hand-off");
        } else {
          not_moved(id, "no_peer", "no --handoff_peers");
        }
      }
      continue;
    }
    // Frozen, no step begins any more; those that had begun end first.
    std::vector<std::shared_ptr<Session>> family;
    for (const std::string& id : ids) {
      absl::StatusOr<std::shared_ptr<Session>> session = sessions_->BeginMove(id);
      if (absl::IsNotFound(session.status())) continue;  // closed (or expired) meanwhile
      if (!session.ok()) {
        not_moved(id, "error", std::string(session.status().message()));
        continue;
      }
      family.push_back(std::move(*session));
    }
    if (family.empty()) continue;
    auto settled = [&] {
      return std::all_of(family.begin(), family.end(),
                         [](const auto& s) { return s->Settled(); });
    };
    while (!settled() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (!settled()) {
      for (const auto& s : family) {
        sessions_->EndMove(s, "", "");
        not_moved(s->id(), "busy", "a step of its fork family did not end before the drain's "
                                   "deadline");
      }
      continue;
    }
    absl::Status last = absl::DeadlineExceededError("drain_timeout_s ran out before a peer took it");
    int64_t bytes = 0;
    const std::vector<Moved> moved = MoveFamily(family, peers, deadline, &turn, &bytes, &last);
    for (size_t i = 0; i < family.size(); ++i) {
      sessions_->EndMove(family[i], moved[i].address, moved[i].new_id);
      if (moved[i].new_id.empty()) {
        not_moved(family[i]->id(), HandoffResultOf(last), std::string(last.message()));
        continue;
      }
      ++summary.moved;
      Record(family[i]->id(), "moved", "");
    }
    summary.bytes += bytes;
    if (metrics_ && bytes > 0) metrics_->AddSessionHandoffBytes(bytes);
  }
  return summary;
}

void SessionHandoff::Stop() {
  stop_.store(true);
  std::lock_guard<std::mutex> wait_for_move_all(running_mu_);
}

}  // namespace attn
