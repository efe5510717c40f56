#include "sessions/session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "sessions/session_moves.h"

namespace attn {

Session::Session(std::string id, std::string owner, SessionShape shape, KvPagePool* pool)
    : id_(std::move(id)),
      owner_(std::move(owner)),
      shape_(shape),
      pool_(pool),
      layers_(shape.num_layers),
      last_used_(Clock::now()) {}

Session::~Session() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Layer& layer : layers_) ReleaseLayerPagesLocked(layer);
}

std::unique_ptr<Session> Session::Fork(std::string id) const {
  auto fork = std::make_unique<Session>(std::move(id), owner_, shape_, pool_);
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    fork->layers_[l].pages = layers_[l].pages;
    fork->layers_[l].tokens = layers_[l].tokens;
    pool_->Ref(layers_[l].pages, shape_.page_span);
  }
  return fork;
}

absl::StatusOr<std::vector<Session::LayerState>> Session::RefLayerStates() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return absl::NotFoundError(absl::StrCat("session ", id_, " is closed"));
  std::vector<LayerState> states;
  states.reserve(layers_.size());
  // A frozen session's steps that have not begun fail before they change it: only those that
  // had begun matter then.
  if (frozen_ && appending_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id_, " has ", appending_, " steps appending"));
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!frozen_ && (layers_[l].busy || !layers_[l].waiting.empty())) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", id_, " layer ", l, " has a step in progress"));
    }
    states.push_back({layers_[l].pages, layers_[l].tokens});
  }
  for (const LayerState& s : states) pool_->Ref(s.pages, shape_.page_span);
  return states;
}

void Session::AdoptLayers(std::vector<LayerState> layers) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t l = 0; l < layers_.size() && l < layers.size(); ++l) {
    layers_[l].pages = std::move(layers[l].pages);
    layers_[l].tokens = layers[l].tokens;
  }
}

absl::Status Session::Freeze() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return absl::NotFoundError(absl::StrCat("session ", id_, " is closed"));
  frozen_ = true;
  return absl::OkStatus();
}

bool Session::Settled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return appending_ == 0;
}

void Session::Thaw() {
  std::lock_guard<std::mutex> lock(mu_);
  frozen_ = false;
}

bool Session::frozen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return frozen_;
}

bool Session::AcquireLayer(int32_t layer, std::function<void()> start) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& l = layers_[layer];
  if (!l.busy) {
    l.busy = true;
    return true;
  }
  l.waiting.push_back(std::move(start));
  return false;
}

void Session::ReleaseLayer(int32_t layer) {
  std::function<void()> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Layer& l = layers_[layer];
    if (!l.waiting.empty()) {
      next = std::move(l.waiting.front());
      l.waiting.pop_front();
    } else {
      l.busy = false;
      if (closed_) ReleaseLayerPagesLocked(l);
    }
  }
  if (!next) return;
  // The started step holds the layer now. A start may end its step at once (refused by the
  // batcher) and so call ReleaseLayer again: the outermost call on this thread runs those starts
  // one after another instead of recursing, however many steps wait.
  thread_local std::deque<std::function<void()>>* starts = nullptr;
  if (starts != nullptr) {
    starts->push_back(std::move(next));
    return;
  }
  std::deque<std::function<void()>> local;
  local.push_back(std::move(next));
  starts = &local;
  while (!local.empty()) {
    std::function<void()> start = std::move(local.front());
    local.pop_front();
    start();
  }
  starts = nullptr;
}

absl::StatusOr<PendingAppend> Session::BeginAppend(int32_t layer, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  // A frozen session that was closed has moved: the step is sent again and finds where.
  if (frozen_) return SessionMovingError(id_);
  if (closed_) {
    return absl::NotFoundError(absl::StrCat("session ", id_, " was closed before this step ran"));
  }
  const Layer& l = layers_[layer];
  PendingAppend p;
  p.layer = layer;
  p.tokens_before = l.tokens;
  p.tokens_after = l.tokens + n;
  if (p.tokens_after > shape_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", id_, " layer ", layer, " holds ", l.tokens, " tokens; ", n,
        " more would make ", p.tokens_after, ", over the session's limit of ", shape_.max_tokens,
        " tokens per layer (CreateSession max_tokens, at most the server's "
        "--max_session_tokens); truncate or close the session"));
  }
  const int64_t t = shape_.page_tokens;
  const int64_t in_last = l.tokens % t;  // rows used in a partial last page
  const bool copy_last =
      n > 0 && in_last != 0 && pool_->RefCount(l.pages.back(), shape_.page_span) > 1;
  const int64_t fresh = p.TablePages(shape_.page_tokens) - static_cast<int64_t>(l.pages.size());
  if (absl::Status st = pool_->Allocate(fresh + (copy_last ? 1 : 0), &p.taken, shape_.page_span);
      !st.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(st.message(), " (session ", id_, ", layer ", layer, ")"));
  }
  if (copy_last) {
    const int32_t shared = l.pages.back(), copy = p.taken.front();
    p.copies.reserve(in_last);
    for (int64_t r = 0; r < in_last; ++r) p.copies.push_back({shared * t + r, copy * t + r});
    p.replaced = shared;
  }
  ++appending_;  // until CommitAppend or AbortAppend
  return p;
}

void Session::WriteTableAfter(const PendingAppend& p, int32_t* dst) const {
  // The holder of the layer is the only one to change its table: read without the lock.
  const std::vector<int32_t>& before = layers_[p.layer].pages;
  std::copy(before.begin(), before.end(), dst);
  size_t next = 0;
  if (p.replaced) dst[before.size() - 1] = p.taken[next++];
  std::copy(p.taken.begin() + static_cast<std::ptrdiff_t>(next), p.taken.end(),
            dst + before.size());
}

std::vector<int32_t> Session::TableAfter(const PendingAppend& p) const {
  std::vector<int32_t> table(static_cast<size_t>(p.TablePages(shape_.page_tokens)));
  WriteTableAfter(p, table.data());
  return table;
}

void Session::CommitAppend(PendingAppend p) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --appending_;
    Layer& l = layers_[p.layer];
    size_t next = 0;
    if (p.replaced) l.pages.back() = p.taken[next++];
    l.pages.insert(l.pages.end(), p.taken.begin() + next, p.taken.end());
    l.tokens = p.tokens_after;
  }
  // The shared page stays with its sharers.
  if (p.replaced) pool_->Unref({&*p.replaced, 1}, shape_.page_span);
}

void Session::AbortAppend(PendingAppend p) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --appending_;
  }
  pool_->Unref(p.taken, shape_.page_span);
}

absl::StatusOr<Session::TruncateResult> Session::Truncate(int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (frozen_) return SessionMovingError(id_);
  if (closed_) return absl::NotFoundError(absl::StrCat("session ", id_, " was closed"));
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].busy) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", id_, " layer ", i, " has a step in progress; truncate once it is done"));
    }
    if (layers_[i].tokens < tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens (", tokens, ") is more than layer ", i, " of session ", id_, " holds (",
          layers_[i].tokens, "); nothing was truncated"));
    }
  }
  TruncateResult r;
  const int64_t t = shape_.page_tokens;
  for (Layer& l : layers_) {
    l.tokens -= tokens;
    const size_t keep = static_cast<size_t>((l.tokens + t - 1) / t);
    r.freed_pages +=
        pool_->Unref({l.pages.data() + keep, l.pages.size() - keep}, shape_.page_span);
    l.pages.resize(keep);
    r.cached_tokens.push_back(l.tokens);
  }
  return r;
}

int64_t Session::ReleaseLayerPagesLocked(Layer& l) {
  const int64_t freed = pool_->Unref(l.pages, shape_.page_span);
  l.pages.clear();
  l.tokens = 0;
  return freed;
}

int64_t Session::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  int64_t freed = 0;
  for (Layer& l : layers_) {
    if (!l.busy) freed += ReleaseLayerPagesLocked(l);
  }
  return freed;
}

bool Session::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

int64_t Session::CachedTokens(int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layers_[layer].tokens;
}

int64_t Session::PagesHeld() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const Layer& l : layers_) n += static_cast<int64_t>(l.pages.size()) * shape_.page_span;
  return n;
}

std::vector<int32_t> Session::TablePages() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> runs;
  for (const Layer& l : layers_) runs.insert(runs.end(), l.pages.begin(), l.pages.end());
  return runs;
}

void Session::Touch(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  last_used_ = now;
}

Session::Clock::time_point Session::last_used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_used_;
}

bool Session::Busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Layer& l : layers_) {
    if (l.busy || !l.waiting.empty()) return true;
  }
  return false;
}

}  // namespace attn
