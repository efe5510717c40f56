#include "attn/client/session.h"

#include <algorithm>
#include <future>
#include <map>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/client/wire_coding.h"
#include "endpoints.h"

namespace attn::client {
namespace {

using std::chrono::milliseconds;

// The context of one session call: bearer token, deadline, wait-for-ready as the client sets them.
void Prepare(const Client& client, grpc::ClientContext* ctx, milliseconds timeout) {
  client.PrepareContext(ctx, timeout);
}

// The BatchStep request of items[indices] (all of them when indices is null).
v1::BatchStepRequest BuildBatch(const std::vector<StepInput>& items,
                                const std::vector<size_t>* indices) {
  v1::BatchStepRequest request;
  if (indices == nullptr) {
    for (const StepInput& in : items) *request.add_steps() = BuildStepRequest(in);
  } else {
    for (size_t i : *indices) *request.add_steps() = BuildStepRequest(items[i]);
  }
  return request;
}

// Results of a BatchStep response; a response with another number of results than the request
// had items is the server's fault and fails as a whole.
absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> ParseBatch(
    const v1::BatchStepResponse& response, size_t items) {
  if (static_cast<size_t>(response.results_size()) != items) {
    return absl::InternalError(absl::StrCat("BatchStep: the server sent ", response.results_size(),
                                            " results for ", items, " items"));
  }
  std::vector<absl::StatusOr<StepResult>> out;
  out.reserve(items);
  for (const v1::StepResult& r : response.results()) out.push_back(ParseStepResult(r));
  return out;
}

// One BatchStep call of items[indices] (all of them when indices is null), through the wire
// coding when the client has it on, else through protobuf messages and the generated stub.
absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> SendOneBatch(
    Client& client, const std::vector<StepInput>& items, const std::vector<size_t>* indices,
    milliseconds timeout) {
  const size_t n = indices != nullptr ? indices->size() : items.size();
  if (client.wire_coding()) {
    BorrowedSlices borrowed;
    grpc::ByteBuffer response;
    const grpc::Status st = client.CallBatchStep(
        EncodeBatchStepRequest(items, indices, &borrowed), timeout, &response);
    // The request's slices point into the items' tensors: held until gRPC lets go of them.
    borrowed.Wait();
    if (!st.ok()) return FromGrpc(st);
    return BatchStepResultsFromWire(&response, n);
  }
  v1::BatchStepResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->BatchStep(&ctx, BuildBatch(items, indices), &response);
  if (!st.ok()) return FromGrpc(st);
  return ParseBatch(response, n);
}

// items[indices] (all when null) in order, cut where the tensors of a part would pass max_bytes
// (an item larger than that is a part of its own). An answer is never larger than its request
// (o has q's shape, lse 4 bytes per query head and token), so it fits as well.
std::vector<std::vector<size_t>> PartsWithin(const std::vector<StepInput>& items,
                                             const std::vector<size_t>* indices,
                                             int64_t max_bytes) {
  std::vector<std::vector<size_t>> parts;
  int64_t bytes = 0;
  const size_t n = indices != nullptr ? indices->size() : items.size();
  for (size_t j = 0; j < n; ++j) {
    const size_t i = indices != nullptr ? (*indices)[j] : j;
    const StepInput& in = items[i];
    const int64_t size =
        static_cast<int64_t>(in.q.data.size() + in.k_new.data.size() + in.v_new.data.size());
    if (parts.empty() || bytes + size > max_bytes) {
      parts.emplace_back();
      bytes = 0;
    }
    parts.back().push_back(i);
    bytes += size;
  }
  return parts;
}

// BatchStep of items[indices] (all when null): one call, or several in order where the items'
// tensors pass half the client's largest message. Then a call that fails fails its own items
// (their status is the call's), and the others keep their answers.
absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> SendBatch(
    Client& client, const std::vector<StepInput>& items, const std::vector<size_t>* indices,
    milliseconds timeout) {
  const std::vector<std::vector<size_t>> parts =
      PartsWithin(items, indices, client.max_message_bytes() / 2);
  if (parts.size() <= 1) return SendOneBatch(client, items, indices, timeout);
  std::vector<absl::StatusOr<StepResult>> results;
  for (const std::vector<size_t>& part : parts) {
    auto answer = SendOneBatch(client, items, &part, timeout);
    for (size_t j = 0; j < part.size(); ++j) {
      if (answer.ok()) {
        results.push_back(std::move((*answer)[j]));
      } else {
        results.push_back(answer.status());
      }
    }
  }
  return results;
}

// GetServerInfo with its own deadline (Client::GetServerInfo has a fixed one).
absl::StatusOr<v1::GetServerInfoResponse> AskInfo(Client& client, milliseconds timeout) {
  v1::GetServerInfoResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &response);
  if (!st.ok()) return FromGrpc(st);
  return response;
}

// GetServerInfo of every client at once: the answers, in order.
std::vector<absl::StatusOr<v1::GetServerInfoResponse>> AskAll(const std::vector<std::shared_ptr<Client>>& clients,
                                                              milliseconds timeout) {
  std::vector<std::future<absl::StatusOr<v1::GetServerInfoResponse>>> calls;
  for (const auto& c : clients) {
    calls.push_back(std::async(std::launch::async, [c, timeout] { return AskInfo(*c, timeout); }));
  }
  std::vector<absl::StatusOr<v1::GetServerInfoResponse>> answers;
  for (auto& f : calls) answers.push_back(f.get());
  return answers;
}

// The addresses of all targets, each once, in order; a target that does not resolve adds its
// error to problems.
std::vector<internal::Endpoint> ResolveAll(const std::vector<std::string>& targets,
                                           std::vector<std::string>* problems) {
  std::vector<internal::Endpoint> endpoints;
  for (const std::string& t : targets) {
    auto resolved = internal::ResolveEndpoints(t);
    if (!resolved.ok()) {
      problems->push_back(std::string(resolved.status().message()));
      continue;
    }
    for (auto& e : *resolved) {
      const bool seen = std::any_of(endpoints.begin(), endpoints.end(),
                                    [&](const internal::Endpoint& x) { return x.address == e.address; });
      if (!seen) endpoints.push_back(std::move(e));
    }
  }
  return endpoints;
}

constexpr char kMovedTo[] = "attnd-moved-to: ";
constexpr char kMoving[] = "attnd-session-moving";

// "<address>;<new id>" of a moved session's status, or "".
std::string MovedTo(const absl::Status& st) {
  if (!absl::IsFailedPrecondition(st)) return "";
  const absl::string_view m = st.message();
  const size_t at = m.rfind(kMovedTo);
  if (at == absl::string_view::npos) return "";
  absl::string_view rest = m.substr(at + sizeof(kMovedTo) - 1);
  return std::string(rest.substr(0, rest.find(')')));
}

bool Moving(const absl::Status& st) {
  return absl::IsUnavailable(st) && st.message().find(kMoving) != absl::string_view::npos;
}

bool Followable(const absl::Status& st) { return !MovedTo(st).empty() || Moving(st); }

bool PassOverOnCreate(const absl::Status& st) {
  return absl::IsResourceExhausted(st) || absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st);
}

}  // namespace

// --- messages -----------------------------------------------------------------------------------

v1::CreateSessionRequest BuildCreateSessionRequest(const SessionSpec& spec) {
  v1::CreateSessionRequest r;
  r.set_num_layers(spec.num_layers);
  r.set_num_kv_heads(spec.num_kv_heads);
  r.set_head_dim(spec.head_dim);
  r.set_dtype(ToWireDType(spec.dtype));
  r.set_max_tokens(spec.max_tokens);
  if (spec.cache_dtype) r.set_cache_dtype(ToWireDType(*spec.cache_dtype));
  r.mutable_k_scales()->Add(spec.k_scales.begin(), spec.k_scales.end());
  r.mutable_v_scales()->Add(spec.v_scales.begin(), spec.v_scales.end());
  return r;
}

v1::StepRequest BuildStepRequest(const StepInput& in) {
  v1::StepRequest r;
  r.set_session_id(in.session_id);
  r.set_layer(in.layer);
  ToWireTensor(in.q, r.mutable_q());
  ToWireTensor(in.k_new, r.mutable_k_new());
  ToWireTensor(in.v_new, r.mutable_v_new());
  r.mutable_k_new_scales()->Add(in.k_new_scales.begin(), in.k_new_scales.end());
  r.mutable_v_new_scales()->Add(in.v_new_scales.begin(), in.v_new_scales.end());
  r.set_softmax_scale(in.options.softmax_scale);
  r.set_return_lse(in.options.return_lse);
  if (in.options.window_left >= 0 || in.options.window_right >= 0) {
    r.mutable_window()->set_left(in.options.window_left);
    r.mutable_window()->set_right(in.options.window_right);
  }
  return r;
}

absl::StatusOr<StepResult> ParseStepResponse(const v1::StepResponse& response) {
  StepResult result;
  auto o = FromWireTensor(response.o());
  if (!o.ok()) return o.status();
  result.o = std::move(*o);
  if (response.has_lse()) {
    auto lse = FromWireTensor(response.lse());
    if (!lse.ok()) return lse.status();
    result.lse = std::move(*lse);
  }
  result.cached_tokens = response.cached_tokens();
  result.timing = response.timing();
  return result;
}

absl::StatusOr<StepResult> ParseStepResult(const v1::StepResult& item) {
  if (item.status_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(item.status_code()), item.status_message());
  }
  return ParseStepResponse(item.response());
}

// --- one endpoint -------------------------------------------------------------------------------

absl::StatusOr<SessionInfo> CreateSession(Client& client, const SessionSpec& spec,
                                          milliseconds timeout) {
  v1::CreateSessionResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->CreateSession(&ctx, BuildCreateSessionRequest(spec), &response);
  if (!st.ok()) return FromGrpc(st);
  SessionInfo info;
  info.session_id = response.session_id();
  info.replica_id = response.replica_id();
  info.page_tokens = response.page_tokens();
  info.ttl_seconds = response.ttl_seconds();
  info.max_tokens = response.max_tokens();
  switch (response.cache_dtype()) {
    case v1::DTYPE_FLOAT8_E4M3: info.cache_dtype = DType::kFloat8E4M3; break;
    case v1::DTYPE_FLOAT16: info.cache_dtype = DType::kFloat16; break;
    case v1::DTYPE_BFLOAT16: info.cache_dtype = DType::kBFloat16; break;
    default: break;  // a server that does not say
  }
  return info;
}

absl::StatusOr<StepResult> Step(Client& client, const StepInput& in, milliseconds timeout) {
  if (client.wire_coding()) {
    BorrowedSlices borrowed;
    grpc::ByteBuffer response;
    const grpc::Status st = client.CallStep(EncodeStepRequest(in, &borrowed), timeout, &response);
    borrowed.Wait();  // as in SendBatch: the tensors are the caller's
    if (!st.ok()) return FromGrpc(st);
    return StepResultFromWire(&response);
  }
  v1::StepResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->Step(&ctx, BuildStepRequest(in), &response);
  if (!st.ok()) return FromGrpc(st);
  return ParseStepResponse(response);
}

absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> BatchStep(
    Client& client, const std::vector<StepInput>& items, milliseconds timeout) {
  return SendBatch(client, items, nullptr, timeout);
}

absl::StatusOr<TruncateResult> TruncateSession(Client& client, const std::string& session_id,
                                               int64_t tokens, milliseconds timeout) {
  v1::TruncateSessionRequest request;
  request.set_session_id(session_id);
  request.set_tokens(tokens);
  v1::TruncateSessionResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->TruncateSession(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  TruncateResult result;
  result.cached_tokens.assign(response.cached_tokens().begin(), response.cached_tokens().end());
  result.freed_pages = response.freed_pages();
  return result;
}

absl::StatusOr<SessionInfo> ForkSession(Client& client, const std::string& session_id,
                                        milliseconds timeout) {
  v1::ForkSessionRequest request;
  request.set_session_id(session_id);
  v1::ForkSessionResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->ForkSession(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  SessionInfo info;
  info.session_id = response.session_id();
  info.replica_id = response.replica_id();
  return info;
}

absl::StatusOr<int64_t> CloseSession(Client& client, const std::string& session_id,
                                     milliseconds timeout) {
  v1::CloseSessionRequest request;
  request.set_session_id(session_id);
  v1::CloseSessionResponse response;
  grpc::ClientContext ctx;
  Prepare(client, &ctx, timeout);
  const grpc::Status st = client.stub()->CloseSession(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  return response.freed_pages();
}

// --- endpoints ----------------------------------------------------------------------------------

absl::StatusOr<std::vector<std::string>> ResolveTarget(const std::string& target) {
  auto endpoints = internal::ResolveEndpoints(target);
  if (!endpoints.ok()) return endpoints.status();
  std::vector<std::string> out;
  for (const auto& e : *endpoints) out.push_back(e.address);
  return out;
}

// --- SessionClient ------------------------------------------------------------------------------

SessionClient::SessionClient(SessionClientOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<SessionClient>> SessionClient::Create(
    const SessionClientOptions& options) {
  if (options.client.target.empty() && options.more_targets.empty()) {
    return absl::InvalidArgumentError("SessionClient: no target");
  }
  // The options are checked once here (TLS pairs, lb_policy) rather than per endpoint later.
  if (!options.client.target.empty()) {
    auto probe = Client::Create(options.client);
    if (!probe.ok()) return probe.status();
  }
  std::unique_ptr<SessionClient> c(new SessionClient(options));
  const absl::Status st = c->Refresh();
  if (!st.ok()) return st;
  return c;
}

absl::Status SessionClient::Refresh() {
  std::lock_guard<std::mutex> refresh_lock(refresh_mu_);
  std::vector<std::string> targets;
  if (!options_.client.target.empty()) targets.push_back(options_.client.target);
  targets.insert(targets.end(), options_.more_targets.begin(), options_.more_targets.end());
  std::vector<std::string> problems;
  const std::vector<internal::Endpoint> endpoints = ResolveAll(targets, &problems);

  // Replicas known now, by address: their clients (connections, calls in flight) are kept.
  std::map<std::string, std::shared_ptr<Replica>> known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& r : replicas_) known[r->info.endpoint] = r;
  }
  std::vector<std::shared_ptr<Client>> clients;
  for (const auto& e : endpoints) {
    auto it = known.find(e.address);
    auto c = it != known.end() ? absl::StatusOr<std::shared_ptr<Client>>(it->second->client) : ClientOf(e);
    if (!c.ok()) return c.status();
    clients.push_back(std::move(*c));
  }
  auto answers = AskAll(clients, options_.info_timeout);

  std::vector<std::shared_ptr<Replica>> fresh;
  for (size_t i = 0; i < endpoints.size(); ++i) {
    const auto& info = answers[i];
    if (!info.ok()) {
      problems.push_back(absl::StrCat(endpoints[i].address, ": ", absl::StatusCodeToString(info.status().code()),
                                      ": ", info.status().message()));
      continue;
    }
    // Two addresses of one process (localhost as 127.0.0.1 and ::1) are one replica. (A server
    // that reports no id cannot be matched: each such address stays on its own.)
    const bool dup = !info->replica_id().empty() &&
                     std::any_of(fresh.begin(), fresh.end(), [&](const std::shared_ptr<Replica>& r) {
                       return r->info.replica_id == info->replica_id();
                     });
    if (dup) continue;
    auto r = std::make_shared<Replica>();
    r->info.replica_id = info->replica_id();
    if (r->info.replica_id.empty()) {
      // A server that does not say its id: keep the one its sessions' ids taught (CreateSession).
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = known.find(endpoints[i].address); it != known.end()) r->info.replica_id = it->second->info.replica_id;
    }
    r->info.endpoint = endpoints[i].address;
    r->info.free_pages = info->kv_cache().free_pages();
    r->info.total_pages = info->kv_cache().total_pages();
    r->info.sessions = info->kv_cache().sessions();
    r->client = clients[i];
    fresh.push_back(std::move(r));
  }
  std::lock_guard<std::mutex> lock(mu_);
  refreshed_at_ = std::chrono::steady_clock::now();
  if (fresh.empty()) {
    // Keep what was known: a resolver or network hiccup must not strand every open session.
    return absl::UnavailableError(absl::StrCat(
        "no attnd answered GetServerInfo at ", absl::StrJoin(targets, ", "), ": ",
        problems.empty() ? "the targets resolved to no address" : absl::StrJoin(problems, "; ")));
  }
  replicas_ = std::move(fresh);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Client>> SessionClient::ClientOf(const internal::Endpoint& e) const {
  ClientOptions o = options_.client;
  o.target = e.address;
  const bool tls = !o.tls_ca_pem.empty() || !o.tls_cert_pem.empty();
  // The certificate names the service, not each pod's address.
  if (tls && o.tls_server_name.empty() && !e.host.empty()) o.tls_server_name = e.host;
  auto c = Client::Create(o);
  if (!c.ok()) return c.status();
  return std::shared_ptr<Client>(std::move(*c));
}

void SessionClient::RefreshIfOlder(milliseconds age) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::chrono::steady_clock::now() - refreshed_at_ < age) return;
  }
  (void)Refresh();  // on failure the known replicas stay, and the call reports its own error
}

std::shared_ptr<SessionClient::Replica> SessionClient::FindReplica(const std::string& session_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Replica> best;
  for (const auto* list : {&replicas_, &followed_}) {
    for (const auto& r : *list) {
      const std::string& id = r->info.replica_id;
      if (id.empty() || session_id.size() <= id.size() || session_id[id.size()] != '.' ||
          session_id.compare(0, id.size(), id) != 0) {
        continue;
      }
      // Replica ids may hold dots themselves (--replica_id=host.domain): the longest match wins;
      // among equals, the targets' replica.
      if (!best || id.size() > best->info.replica_id.size()) best = r;
    }
  }
  return best;
}

absl::Status SessionClient::NoReplicaError(const std::string& session_id) const {
  std::vector<std::string> known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& r : replicas_) {
      known.push_back(absl::StrCat(r->info.replica_id.empty() ? "(id not known)" : r->info.replica_id, " at ",
                                   r->info.endpoint));
    }
  }
  const size_t dot = session_id.rfind('.');
  if (dot == std::string::npos || dot == 0) {
    return absl::NotFoundError(absl::StrCat("session '", session_id,
                                            "': not a session id (expected <replica_id>.<random>)"));
  }
  return absl::NotFoundError(absl::StrCat(
      "session '", session_id, "' is held by replica '", session_id.substr(0, dot),
      "', which is none of the replicas this client reaches (", absl::StrJoin(known, ", "),
      "): that replica has gone, and its sessions with it, or is not among the targets"));
}

absl::StatusOr<std::shared_ptr<SessionClient::Replica>> SessionClient::Route(const std::string& session_id) {
  if (auto r = FindReplica(session_id)) return r;
  // A replica that came up since the last resolution (a session id from another process).
  RefreshIfOlder(options_.min_refresh_interval);
  if (auto r = FindReplica(session_id)) return r;
  return NoReplicaError(session_id);
}

absl::StatusOr<std::shared_ptr<Client>> SessionClient::ClientFor(const std::string& session_id) {
  auto r = Route(session_id);
  if (!r.ok()) return r.status();
  return (*r)->client;
}

std::shared_ptr<Client> SessionClient::ClientForReplica(const std::string& replica_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& r : replicas_) {
    if (r->info.replica_id == replica_id) return r->client;
  }
  return nullptr;
}

std::vector<ReplicaInfo> SessionClient::Replicas() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ReplicaInfo> out;
  for (const auto& r : replicas_) out.push_back(r->info);
  return out;
}

std::vector<SessionClient::Candidate> SessionClient::RankForCreate() {
  std::vector<std::shared_ptr<Replica>> replicas;
  uint64_t turn = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    replicas = replicas_;
    turn = create_turn_++;
  }
  // Free pages now, not as of the last refresh: sessions come and go between creates.
  std::vector<std::shared_ptr<Client>> clients;
  for (const auto& r : replicas) clients.push_back(r->client);
  const auto answers = AskAll(clients, options_.info_timeout);
  std::vector<Candidate> candidates;
  const size_t n = replicas.size();
  for (size_t i = 0; i < n; ++i) {
    const auto& info = answers[i];
    Candidate c{replicas[i], "", info.ok(), 0, 0, (i + n - turn % n) % n};
    std::lock_guard<std::mutex> lock(mu_);
    if (info.ok()) {
      c.free_pages = info->kv_cache().free_pages();
      c.sessions = info->kv_cache().sessions();
      replicas[i]->info.free_pages = c.free_pages;
      replicas[i]->info.total_pages = info->kv_cache().total_pages();
      replicas[i]->info.sessions = c.sessions;
    }
    c.name = absl::StrCat(replicas[i]->info.replica_id, " at ", replicas[i]->info.endpoint);
    candidates.push_back(std::move(c));
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.answered != b.answered) return a.answered;
    if (a.free_pages != b.free_pages) return a.free_pages > b.free_pages;
    if (a.sessions != b.sessions) return a.sessions < b.sessions;
    return a.rank < b.rank;
  });
  return candidates;
}

absl::StatusOr<SessionInfo> SessionClient::CreateSession(const SessionSpec& spec, milliseconds timeout) {
  RefreshIfOlder(options_.refresh_interval);
  absl::Status last = absl::UnavailableError("CreateSession: no replica is known");
  std::vector<std::string> tried;
  for (const Candidate& c : RankForCreate()) {
    auto created = attn::client::CreateSession(*c.replica->client, spec, timeout);
    if (created.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      created->endpoint = c.replica->info.endpoint;
      // The id the session carries is the replica's own word: an address whose process restarted
      // since it was last asked (or that did not say) is known by it from now on.
      if (!created->replica_id.empty()) c.replica->info.replica_id = created->replica_id;
      return created;
    }
    last = created.status();
    tried.push_back(absl::StrCat(c.name, ": ", absl::StatusCodeToString(last.code()), ": ", last.message()));
    if (!PassOverOnCreate(last)) return last;
  }
  if (tried.size() <= 1) return last;
  return absl::Status(last.code(), absl::StrCat("CreateSession failed on every replica: ",
                                                absl::StrJoin(tried, "; ")));
}

std::string SessionClient::CurrentSessionId(const std::string& session_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string id = session_id;
  // A session may move more than once; a cycle cannot arise, but the walk is bounded anyway.
  for (int hops = 0; hops < 16; ++hops) {
    auto it = moved_.find(id);
    if (it == moved_.end()) break;
    id = it->second;
  }
  return id;
}

bool SessionClient::LearnMove(const std::string& id, const absl::Status& st) {
  const std::string to = MovedTo(st);
  const size_t semi = to.find(';');
  if (semi == std::string::npos || semi + 1 >= to.size()) return false;
  const std::string address = to.substr(0, semi), new_id = to.substr(semi + 1);
  const size_t dot = new_id.rfind('.');
  if (dot == std::string::npos || dot == 0 || new_id == id) return false;
  if (FindReplica(new_id) == nullptr) {
    // No address: the replica that answered, which is known (its id starts the new one).
    if (address.empty()) return false;
    // The replica it moved to is not one of the targets (yet): reach it at the address named.
    auto resolved = internal::ResolveEndpoints(address);
    if (!resolved.ok() || resolved->empty()) return false;
    auto c = ClientOf(resolved->front());
    if (!c.ok()) return false;
    auto r = std::make_shared<Replica>();
    r->info.replica_id = new_id.substr(0, dot);
    r->info.endpoint = resolved->front().address;
    r->client = std::move(*c);
    std::lock_guard<std::mutex> lock(mu_);
    followed_.push_back(std::move(r));
  }
  std::lock_guard<std::mutex> lock(mu_);
  moved_[id] = new_id;
  return true;
}

bool SessionClient::FindMoved(const std::string& id, const std::shared_ptr<Replica>& unreached,
                              std::chrono::steady_clock::time_point deadline) {
  RefreshIfOlder(options_.min_refresh_interval);
  std::vector<std::shared_ptr<Replica>> others;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto* list : {&replicas_, &followed_}) {
      for (const auto& r : *list) {
        if (r != unreached && r->client != (unreached ? unreached->client : nullptr)) {
          others.push_back(r);
        }
      }
    }
  }
  for (const auto& r : others) {
    const auto left =
        std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left <= milliseconds(0)) return false;
    // Truncating no token changes nothing: the replica that took the session answers with its
    // new id, the others that they do not hold it.
    auto asked = attn::client::TruncateSession(*r->client, id, 0,
                                               std::min(left, options_.info_timeout));
    if (LearnMove(id, asked.status())) return true;
  }
  return false;
}

template <typename Result, typename Call>
absl::StatusOr<Result> SessionClient::OnSession(const std::string& session_id, milliseconds timeout,
                                                const Call& call) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string id = CurrentSessionId(session_id);
  int follows = 0;
  milliseconds pause{2};
  for (;;) {
    auto r = Route(id);
    const auto left =
        std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    absl::StatusOr<Result> out =
        r.ok() ? call(id, *(*r)->client, std::max(left, milliseconds(1)))
               : absl::StatusOr<Result>(r.status());
    if (out.ok()) return out;
    if (follows < 2 && LearnMove(id, out.status())) {
      id = CurrentSessionId(id);
      ++follows;
      continue;
    }
    // Its replica is gone (a drain whose answers about the moves this caller, idle, missed), or
    // not reached: one that took the session in a hand-off knows it by this id.
    const bool unreached = !r.ok() || (absl::IsUnavailable(out.status()) && !Moving(out.status()));
    if (follows < 2 && unreached && FindMoved(id, r.ok() ? *r : nullptr, deadline)) {
      id = CurrentSessionId(id);
      ++follows;
      continue;
    }
    if (Moving(out.status()) && std::chrono::steady_clock::now() + pause < deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, milliseconds(50));
      continue;
    }
    return out;
  }
}

absl::StatusOr<StepResult> SessionClient::Step(const StepInput& in, milliseconds timeout) {
  return OnSession<StepResult>(in.session_id, timeout,
                               [&](const std::string& id, Client& c, milliseconds t) {
                                 if (id == in.session_id) return attn::client::Step(c, in, t);
                                 StepInput moved = in;
                                 moved.session_id = id;
                                 return attn::client::Step(c, moved, t);
                               });
}

absl::StatusOr<std::vector<absl::StatusOr<StepResult>>> SessionClient::BatchStep(
    const std::vector<StepInput>& items, milliseconds timeout) {
  std::vector<absl::StatusOr<StepResult>> results(items.size(), absl::UnknownError("not sent"));
  std::vector<std::pair<std::shared_ptr<Replica>, std::vector<size_t>>> groups;
  absl::Status first_error;
  std::vector<bool> unrouted(items.size(), false);
  for (size_t i = 0; i < items.size(); ++i) {
    auto r = Route(CurrentSessionId(items[i].session_id));
    if (!r.ok()) {
      results[i] = r.status();
      unrouted[i] = true;
      if (first_error.ok()) first_error = r.status();
      continue;
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == *r; });
    if (g == groups.end()) {
      groups.push_back({*r, {}});
      g = groups.end() - 1;
    }
    g->second.push_back(i);
  }
  if (items.empty()) {
    // The server's answer to an empty batch (its own status) rather than one invented here.
    auto any = Replicas();
    if (any.empty()) return absl::UnavailableError("BatchStep: no replica is known");
    return attn::client::BatchStep(*ClientForReplica(any[0].replica_id), items, timeout);
  }
  // Items of moved sessions go with their current ids.
  std::vector<StepInput> renamed;
  bool any_moved = false;
  for (const StepInput& in : items) any_moved |= CurrentSessionId(in.session_id) != in.session_id;
  if (any_moved) {
    renamed = items;
    for (StepInput& in : renamed) in.session_id = CurrentSessionId(in.session_id);
  }
  const std::vector<StepInput>& sent = any_moved ? renamed : items;
  auto send = [&](size_t g) {
    return SendBatch(*groups[g].first->client, sent, &groups[g].second, timeout);
  };
  std::vector<std::future<absl::StatusOr<std::vector<absl::StatusOr<StepResult>>>>> calls;
  for (size_t g = 1; g < groups.size(); ++g) calls.push_back(std::async(std::launch::async, send, g));
  bool reached = false;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto answer = g == 0 ? send(0) : calls[g - 1].get();
    const std::vector<size_t>& idx = groups[g].second;
    if (!answer.ok()) {
      for (size_t i : idx) results[i] = answer.status();
      if (first_error.ok() || g == 0) first_error = answer.status();
      continue;
    }
    reached = true;
    for (size_t j = 0; j < idx.size(); ++j) results[idx[j]] = std::move((*answer)[j]);
  }
  // Items whose session moved, or was moving, go again one by one (Step follows), in order; so do
  // those whose replica is gone or was not reached (Step asks the other replicas whether one took
  // the session in a hand-off).
  bool found = false;
  for (size_t i = 0; i < items.size(); ++i) {
    if (results[i].ok()) continue;
    const absl::Status& st = results[i].status();
    const bool unreached = unrouted[i] || (absl::IsUnavailable(st) && !Moving(st));
    if (Followable(st) || unreached) {
      results[i] = Step(items[i], timeout);
      found |= results[i].ok();
    }
  }
  if (!reached && !found) return first_error;
  return results;
}

absl::StatusOr<TruncateResult> SessionClient::TruncateSession(const std::string& session_id,
                                                              int64_t tokens, milliseconds timeout) {
  return OnSession<TruncateResult>(session_id, timeout,
                                   [&](const std::string& id, Client& c, milliseconds t) {
                                     return attn::client::TruncateSession(c, id, tokens, t);
                                   });
}

absl::StatusOr<SessionInfo> SessionClient::ForkSession(const std::string& session_id,
                                                       milliseconds timeout) {
  auto forked = OnSession<SessionInfo>(session_id, timeout,
                                       [&](const std::string& id, Client& c, milliseconds t) {
                                         return attn::client::ForkSession(c, id, t);
                                       });
  if (forked.ok()) {
    if (auto r = FindReplica(forked->session_id)) {
      std::lock_guard<std::mutex> lock(mu_);
      forked->endpoint = r->info.endpoint;
    }
  }
  return forked;
}

absl::StatusOr<int64_t> SessionClient::CloseSession(const std::string& session_id,
                                                    milliseconds timeout) {
  return OnSession<int64_t>(session_id, timeout,
                            [&](const std::string& id, Client& c, milliseconds t) {
                              return attn::client::CloseSession(c, id, t);
                            });
}

}  // namespace attn::client
