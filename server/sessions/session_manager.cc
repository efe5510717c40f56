#include "sessions/session_manager.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_util.h"
#include "observability/metrics.h"
#include "sessions/session_moves.h"

namespace attn {
namespace {

constexpr int32_t kMaxLayers = 1024;

bool ValidReplicaId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
  });
}

int64_t Seconds(std::chrono::milliseconds d) {
  return std::chrono::duration_cast<std::chrono::seconds>(d).count();
}

}  // namespace

std::string ReplicaOfSessionId(const std::string& id) {
  const size_t dot = id.find('.');
  return dot == std::string::npos ? std::string() : id.substr(0, dot);
}

absl::StatusOr<std::unique_ptr<SessionManager>> SessionManager::Create(const Options& options,
                                                                       KvPagePool* pool,
                                                                       Metrics* metrics) {
  if (!ValidReplicaId(options.replica_id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--replica_id must be 1 to 64 of [A-Za-z0-9_-], got '", options.replica_id, "'"));
  }
  if (options.max_sessions < 1) return absl::InvalidArgumentError("--max_sessions must be >= 1");
  if (options.max_session_tokens < 1) {
    return absl::InvalidArgumentError("--max_session_tokens must be >= 1");
  }
  if (options.ttl.count() < 1) return absl::InvalidArgumentError("--session_ttl_s must be > 0");
  if (pool == nullptr) return absl::InvalidArgumentError("KV page pool is null");
  return std::unique_ptr<SessionManager>(new SessionManager(options, pool, metrics));
}

SessionManager::SessionManager(const Options& options, KvPagePool* pool, Metrics* metrics)
    : options_(options), pool_(pool), metrics_(metrics), rng_(std::random_device{}()) {
  UpdateMetrics();
  expiry_ = std::thread([this] { ExpiryLoop(); });
}

SessionManager::~SessionManager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  expiry_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, s] : sessions_) s->Close();
  sessions_.clear();
}

PageLayout SessionManager::PageLayoutFor(int64_t row_bytes) const {
  const int64_t page = pool_->page_bytes();
  if (row_bytes < 1) return {0, 1};
  // The fewest pages whose bytes are a whole number of rows: row / gcd(row, page).
  const int64_t span = row_bytes / std::gcd(row_bytes, page);
  if (span > kMaxPageSpan) return {0, 1};
  const int64_t tokens = span * page / row_bytes;
  if (tokens > std::numeric_limits<int32_t>::max()) return {0, 1};
  return {static_cast<int32_t>(tokens), static_cast<int32_t>(span)};
}

absl::Status SessionManager::CheckCreateParams(const CreateParams& p) const {
  auto invalid = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (p.num_layers < 1 || p.num_layers > kMaxLayers) {
    return invalid("num_layers must be in [1, ", kMaxLayers, "], got ", p.num_layers);
  }
  if (p.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1, got ", p.num_kv_heads);
  const auto& dims = options_.head_dims;
  if (std::find(dims.begin(), dims.end(), p.head_dim) == dims.end()) {
    return invalid("head_dim ", p.head_dim, " is not supported; supported: ",
                   absl::StrJoin(dims, ", "));
  }
  if (p.max_tokens < 0 || p.max_tokens > options_.max_session_tokens) {
    return invalid("max_tokens must be in [0, ", options_.max_session_tokens,
                   "] (0: the server's limit, --max_session_tokens), got ", p.max_tokens);
  }
  if (p.num_kv_heads > (1 << 16)) {
    return invalid("num_kv_heads must be at most 65536, got ", p.num_kv_heads);
  }
  const size_t elem = kernels::DTypeSize(p.cache_dtype.value_or(p.dtype));
  if (p.cache_dtype && *p.cache_dtype == kernels::DType::kFloat8E4M3) {
    for (const auto& [scales, name] :
         {std::pair{&p.k_scales, "k_scales"}, std::pair{&p.v_scales, "v_scales"}}) {
      if (static_cast<int64_t>(scales->size()) != p.num_kv_heads) {
        return invalid(name, " must have num_kv_heads (", p.num_kv_heads, ") entries, got ",
                       scales->size());
      }
      for (size_t i = 0; i < scales->size(); ++i) {
        const float x = (*scales)[i];
        if (!std::isfinite(x) || !(x > 0)) {
          return invalid(name, "[", i, "] must be finite and > 0, got ", x);
        }
      }
    }
  }
  const int64_t row = int64_t{p.num_kv_heads} * p.head_dim * static_cast<int64_t>(elem);
  if (PageLayoutFor(row).tokens == 0) {
    return invalid("num_kv_heads (", p.num_kv_heads, ") x head_dim (", p.head_dim, ") x ", elem,
                   " bytes = ", row, " bytes per token fit no run of at most ",
                   kMaxPageSpan, " KV pages of ", pool_->page_bytes(),
                   " bytes (--kv_page_tokens x 2048) as whole rows; start attnd with another "
                   "--kv_page_tokens");
  }
  return absl::OkStatus();
}

std::string SessionManager::NewIdLocked() {
  for (;;) {
    std::string id = absl::StrFormat("%s.%016x%016x", options_.replica_id, rng_(), rng_());
    if (!sessions_.count(id) && !gone_.count(id)) return id;
  }
}

absl::Status SessionManager::RoomForMoreLocked(int64_t n) const {
  if (stop_creating_) return Draining();
  if (static_cast<int64_t>(sessions_.size()) + n > options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this replica (", options_.replica_id, ") has ", sessions_.size(),
        " open sessions, its limit (--max_sessions ", options_.max_sessions, ")",
        n > 1 ? absl::StrCat(", and ", n, " more were asked for") : "",
        "; close sessions or use another replica"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::CreateSession(const CreateParams& p,
                                                                       const std::string& owner) {
  if (absl::Status st = CheckCreateParams(p); !st.ok()) return st;
  SessionShape shape;
  shape.num_layers = p.num_layers;
  shape.num_kv_heads = p.num_kv_heads;
  shape.head_dim = p.head_dim;
  shape.dtype = p.dtype;
  if (p.cache_dtype && *p.cache_dtype != p.dtype) {
    shape.cache_dtype = p.cache_dtype;
    shape.k_scales = p.k_scales;
    shape.v_scales = p.v_scales;
  }
  shape.max_tokens = p.max_tokens > 0 ? p.max_tokens : options_.max_session_tokens;
  const PageLayout layout = PageLayoutFor(shape.RowBytes());
  shape.page_tokens = layout.tokens;
  shape.page_span = layout.span;
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(RoomForMoreLocked(1));
    s = std::make_shared<Session>(NewIdLocked(), owner, shape, pool_);
    sessions_.emplace(s->id(), s);
  }
  UpdateMetrics();
  return s;
}

void SessionManager::RememberLocked(const std::string& id, const char* how) {
  if (options_.remembered_ids == 0) return;
  if (gone_.emplace(id, how).second) gone_order_.push_back(id);
  while (gone_order_.size() > options_.remembered_ids) {
    moved_.erase(gone_order_.front());
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
}

absl::Status SessionManager::NotOpen(const std::string& id) const {
  const std::string replica = ReplicaOfSessionId(id);
  if (!replica.empty() && replica != options_.replica_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", id, " belongs to replica ", replica, ", but this is replica ",
        options_.replica_id, "; send the session's calls to replica ", replica));
  }
  if (auto it = moved_.find(id); it != moved_.end()) {
    return SessionMovedError(id, it->second.first, it->second.second);
  }
  if (auto it = gone_.find(id); it != gone_.end()) {
    if (std::string(it->second) == "expired") {
      return absl::NotFoundError(absl::StrCat("session ", id, " expired: it was idle for more ",
                                              "than the TTL of ", Seconds(options_.ttl),
                                              " s (--session_ttl_s); create a new one"));
    }
    return absl::NotFoundError(absl::StrCat("session ", id, " was closed"));
  }
  return absl::NotFoundError(absl::StrCat("no session ", id.empty() ? "''" : id,
                                          " on replica ", options_.replica_id));
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(const std::string& id,
                                                              const std::string& owner) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = FindOwnedLocked(id, owner);
  if (!it.ok()) return it.status();
  (*it)->second->Touch(Clock::now());
  return (*it)->second;
}

absl::StatusOr<SessionManager::SessionMap::iterator> SessionManager::FindOwnedLocked(
    const std::string& id, const std::string& owner) {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second->owner() == owner) return it;
  // Another identity's session reads as unknown: its existence is not disclosed.
  if (it != sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session ", id, " on replica ", options_.replica_id));
  }
  // A session imported here, asked for by its id on the replica it came from (by its owner).
  if (auto alias = imported_from_.find(id); alias != imported_from_.end()) {
    auto here = sessions_.find(alias->second);
    if (here != sessions_.end() && here->second->owner() == owner) {
      return SessionMovedError(id, "", alias->second);
    }
  }
  return NotOpen(id);
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Fork(const std::string& id,
                                                              const std::string& owner) {
  auto parent = Find(id, owner);
  if (!parent.ok()) return parent.status();
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_creating_) return SessionMovingError(id);
    if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this replica (", options_.replica_id, ") has ", sessions_.size(),
          " open sessions, its limit (--max_sessions ", options_.max_sessions,
          "); close sessions before forking"));
    }
    if ((*parent)->frozen()) return SessionMovingError(id);
    s = (*parent)->Fork(NewIdLocked());
    sessions_.emplace(s->id(), s);
  }
  UpdateMetrics();
  return s;
}

absl::StatusOr<int64_t> SessionManager::Close(const std::string& id, const std::string& owner) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = FindOwnedLocked(id, owner);
    if (!it.ok()) return it.status();
    if ((*it)->second->frozen()) return SessionMovingError(id);
    s = std::move((*it)->second);
    sessions_.erase(*it);
    RememberLocked(id, "closed");
  }
  const int64_t freed = s->Close();
  UpdateMetrics();
  return freed;
}

absl::StatusOr<Session::TruncateResult> SessionManager::Truncate(const std::string& id,
                                                                 const std::string& owner,
                                                                 int64_t tokens) {
  if (tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tokens must be >= 0, got ", tokens));
  }
  auto s = Find(id, owner);
  if (!s.ok()) return s.status();
  auto r = (*s)->Truncate(tokens);
  UpdateMetrics();
  return r;
}

absl::Status SessionManager::Draining() const {
  return absl::UnavailableError(absl::StrCat("replica ", options_.replica_id,
                                             " is draining: it creates no sessions; use another "
                                             "replica"));
}

void SessionManager::StopCreating() {
  std::lock_guard<std::mutex> lock(mu_);
  stop_creating_ = true;
}

std::vector<std::string> SessionManager::OpenSessionIds() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> ids;
  ids.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  return ids;
}

std::vector<std::vector<std::string>> SessionManager::OpenSessionFamilies() const {
  std::vector<std::shared_ptr<Session>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) open.push_back(s);
  }
  // Ids are "<replica>.<random>": the order of opening is not in them, so families keep the
  // order of the session map, sorted by id for a stable order between runs.
  std::sort(open.begin(), open.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  // Union-find over the sessions, joined through the pages their tables hold.
  std::vector<size_t> parent(open.size());
  std::iota(parent.begin(), parent.end(), size_t{0});
  auto root = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  std::unordered_map<int32_t, size_t> holder;  // page run -> a session holding it
  for (size_t i = 0; i < open.size(); ++i) {
    for (int32_t run : open[i]->TablePages()) {
      auto [it, first] = holder.emplace(run, i);
      if (!first) parent[root(i)] = root(it->second);
    }
  }
  std::vector<std::vector<std::string>> families;
  std::unordered_map<size_t, size_t> family_of_root;
  for (size_t i = 0; i < open.size(); ++i) {
    auto [it, first] = family_of_root.emplace(root(i), families.size());
    if (first) families.emplace_back();
    families[it->second].push_back(open[i]->id());
  }
  return families;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::BeginMove(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotOpen(id);
  RETURN_IF_ERROR(it->second->Freeze());
  return it->second;
}

void SessionManager::EndMove(const std::shared_ptr<Session>& session, const std::string& address,
                             const std::string& new_id) {
  if (new_id.empty()) {
    session->Thaw();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(session->id());
    moved_[session->id()] = {address, new_id};
    RememberLocked(session->id(), "moved");
  }
  session->Close();
  UpdateMetrics();
}

absl::Status SessionManager::CheckImport(const SessionShape& shape, int64_t before) const {
  CreateParams p;
  p.num_layers = shape.num_layers;
  p.num_kv_heads = shape.num_kv_heads;
  p.head_dim = shape.head_dim;
  p.dtype = shape.dtype;
  p.max_tokens = shape.max_tokens;
  p.cache_dtype = shape.cache_dtype;
  p.k_scales = shape.k_scales;
  p.v_scales = shape.v_scales;
  if (shape.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session transfer: max_tokens must be >= 1 (the session's limit), got ", shape.max_tokens));
  }
  RETURN_IF_ERROR(CheckCreateParams(p));
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(RoomForMoreLocked(before + 1));
  }
  const PageLayout layout = PageLayoutFor(shape.RowBytes());
  if (layout.tokens != shape.page_tokens || layout.span != shape.page_span) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session transfer: page_tokens ", shape.page_tokens, " / page_span ", shape.page_span,
        " differ from this replica's ", layout.tokens, " / ", layout.span,
        " for that row (replicas must share --kv_page_tokens)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::shared_ptr<Session>>> SessionManager::AddImported(
    const std::vector<std::function<absl::StatusOr<std::unique_ptr<Session>>(std::string id)>>&
        finish,
    const std::vector<std::string>& source_ids) {
  std::vector<std::shared_ptr<Session>> made;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(RoomForMoreLocked(static_cast<int64_t>(finish.size())));
    for (const auto& f : finish) {
      absl::StatusOr<std::unique_ptr<Session>> s = f(NewIdLocked());
      if (!s.ok()) {
        // None of the stream's sessions opens; those made give their pages back as they go.
        for (auto& m : made) m->Close();
        return s.status();
      }
      made.push_back(std::move(*s));
    }
    for (size_t i = 0; i < made.size(); ++i) {
      sessions_.emplace(made[i]->id(), made[i]);
      // Ids of this replica's own are never another replica's: no alias shadows one.
      if (i < source_ids.size() && !source_ids[i].empty() &&
          ReplicaOfSessionId(source_ids[i]) != options_.replica_id &&
          options_.remembered_ids > 0) {
        if (imported_from_.insert_or_assign(source_ids[i], made[i]->id()).second) {
          imported_order_.push_back(source_ids[i]);
        }
        while (imported_order_.size() > options_.remembered_ids) {
          imported_from_.erase(imported_order_.front());
          imported_order_.pop_front();
        }
      }
    }
  }
  UpdateMetrics();
  return made;
}

int64_t SessionManager::ExpireIdle(Clock::time_point now) {
  std::vector<std::shared_ptr<Session>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      const std::shared_ptr<Session>& s = it->second;
      if (now - s->last_used() > options_.ttl && !s->Busy() && !s->frozen()) {
        RememberLocked(it->first, "expired");
        expired.push_back(std::move(it->second));
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& s : expired) s->Close();
  if (metrics_ && !expired.empty()) {
    metrics_->AddSessionEvictions("ttl", static_cast<int64_t>(expired.size()));
  }
  if (!expired.empty()) UpdateMetrics();
  return static_cast<int64_t>(expired.size());
}

void SessionManager::ExpiryLoop() {
  auto interval = options_.sweep_interval;
  if (interval.count() <= 0) {
    interval = std::clamp(options_.ttl / 4, std::chrono::milliseconds(1),
                          std::chrono::milliseconds(1000));
  }
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, interval, [&] { return stop_; })) {
    lock.unlock();
    ExpireIdle(Clock::now());
    UpdateMetrics();  // pages given back by steps that ended after a close
    lock.lock();
  }
}

int64_t SessionManager::OpenSessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(sessions_.size());
}

void SessionManager::UpdateMetricsSometimes() {
  const Clock::rep now = Clock::now().time_since_epoch().count();
  Clock::rep last = metrics_updated_.load();
  const Clock::rep every =
      std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(50)).count();
  if (now - last < every || !metrics_updated_.compare_exchange_strong(last, now)) return;
  UpdateMetrics();
}

void SessionManager::UpdateMetrics() {
  if (!metrics_) return;
  const int64_t free = pool_->FreePages();
  metrics_->SetSessions(OpenSessions());
  metrics_->SetKvCachePages(pool_->num_pages() - free, free);
}

}  // namespace attn
