// The KV cache's bookkeeping without a server: the page pool, sessions' page tables, forks with
// copy-on-write, truncation, expiry and the per-layer FIFO, under random operations and injected
// faults (steps whose launch fails and must give back what they took). After any sequence, every
// page is back on the free list once the sessions are gone, and while they live each page's
// reference count equals the number of page tables that hold it.
#include <gtest/gtest.h>

#include <cstring>

#include <map>
#include <random>
#include <set>

#include "sessions/crc32c.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session_moves.h"
#include "sessions/session_transfer.h"
#include "sessions/step_device.h"
#include "sessions/session_manager.h"

namespace attn {
namespace {

std::unique_ptr<KvPagePool> Pool(int64_t pages, uint64_t seed = 0) {
  return *KvPagePool::Create({pages, 2048, seed});
}

std::unique_ptr<SessionManager> Manager(KvPagePool* pool, int64_t max_sessions = 64) {
  SessionManager::Options o;
  o.replica_id = "unit";
  o.max_sessions = max_sessions;
  o.max_session_tokens = 4096;
  o.ttl = std::chrono::hours(1);
  o.head_dims = {32, 64};
  return *SessionManager::Create(o, pool, nullptr);
}

SessionManager::CreateParams Params(int layers) {
  SessionManager::CreateParams p;
  p.num_layers = layers;
  p.num_kv_heads = 2;
  p.head_dim = 64;  // 256-byte rows: 8 tokens per 2 KiB page
  return p;
}

TEST(KvPagePoolTest, AllocatesAllOrNothingAndCountsReferences) {
  auto pool = Pool(10, 99);
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool->Allocate(7, &pages).ok());
  EXPECT_EQ(pool->FreePages(), 3);
  const absl::Status st = pool->Allocate(4, &pages);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("needs 4 more pages and 3 of 10 pages"), std::string::npos) << st;
  EXPECT_EQ(pages.size(), 7u);
  EXPECT_EQ(std::set<int32_t>(pages.begin(), pages.end()).size(), 7u);
  pool->Ref({pages.data(), 2});
  EXPECT_EQ(pool->RefCount(pages[0]), 2);
  EXPECT_EQ(pool->Unref(pages), 5);
  EXPECT_EQ(pool->Unref({pages.data(), 2}), 2);
  EXPECT_EQ(pool->FreePages(), 10);
  EXPECT_FALSE(KvPagePool::Create({0, 2048, 0}).ok());
}

TEST(KvPagePoolTest, ShuffledFreeListHandsOutNonAdjacentPages) {
  auto pool = Pool(1000, 7);
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool->Allocate(20, &pages).ok());
  int adjacent = 0;
  for (size_t i = 1; i < pages.size(); ++i) adjacent += pages[i] == pages[i - 1] + 1;
  EXPECT_LT(adjacent, 5);
}

// Runs of pages (rows that do not divide a page): each run is `span` free pages starting at a
// multiple of span, counted as one; single pages and runs share the pool, and a request for
// more runs than are free takes none.
TEST(KvPagePoolTest, RunsOfAdjacentPagesShareThePoolWithSinglePages) {
  auto pool = Pool(30, 5);  // shuffled: single pages fall anywhere
  std::vector<int32_t> singles, runs;
  ASSERT_TRUE(pool->Allocate(4, &singles).ok());
  ASSERT_TRUE(pool->Allocate(3, &runs, 3).ok());
  EXPECT_EQ(pool->FreePages(), 30 - 4 - 9);
  std::set<int32_t> taken(singles.begin(), singles.end());
  for (int32_t r : runs) {
    ASSERT_GE(r, 0);
    ASSERT_LT(r, 10);
    for (int32_t p = 0; p < 3; ++p) {
      EXPECT_TRUE(taken.insert(r * 3 + p).second) << "page " << r * 3 + p << " handed out twice";
      EXPECT_EQ(pool->RefCount(r * 3 + p), 1);
    }
    EXPECT_EQ(pool->RefCount(r, 3), 1);
  }
  // Single pages never come from inside a run, and a run never overlaps single pages.
  std::vector<int32_t> more;
  ASSERT_TRUE(pool->Allocate(pool->FreePages(), &more).ok());
  for (int32_t p : more) EXPECT_TRUE(taken.insert(p).second) << "page " << p;
  EXPECT_EQ(pool->FreePages(), 0);
  EXPECT_EQ(pool->Unref(more), static_cast<int64_t>(more.size()));
  // Fewer free runs than asked for: none is taken.
  const int64_t free_before = pool->FreePages();
  std::vector<int32_t> too_many;
  const absl::Status st = pool->Allocate(8, &too_many, 3);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(too_many.empty());
  EXPECT_EQ(pool->FreePages(), free_before);
  pool->Ref({runs.data(), 1}, 3);
  EXPECT_EQ(pool->RefCount(runs[0], 3), 2);
  EXPECT_EQ(pool->Unref(runs, 3), 6);  // runs 1 and 2; run 0 is still referenced
  EXPECT_EQ(pool->Unref({runs.data(), 1}, 3), 3);
  EXPECT_EQ(pool->Unref(singles), 4);
  EXPECT_EQ(pool->FreePages(), 30);
}

// The page layout of a row: whole rows in the fewest adjacent pages, at most kMaxPageSpan.
TEST(SessionManagerTest, PageLayoutOfRowsThatDoNotDivideAPage) {
  auto pool = Pool(64);
  auto manager = Manager(pool.get());
  EXPECT_EQ(manager->PageLayoutFor(256).tokens, 8);   // divides: one page
  EXPECT_EQ(manager->PageLayoutFor(256).span, 1);
  EXPECT_EQ(manager->PageLayoutFor(384).tokens, 16);  // 3 x 128: 3 pages of 2048
  EXPECT_EQ(manager->PageLayoutFor(384).span, 3);
  EXPECT_EQ(manager->PageLayoutFor(4096).tokens, 1);  // a row larger than a page
  EXPECT_EQ(manager->PageLayoutFor(4096).span, 2);
  EXPECT_EQ(manager->PageLayoutFor(65 * 32).tokens, 0) << "65 pages is more than kMaxPageSpan";
  SessionManager::CreateParams p = Params(1);
  p.num_kv_heads = 3;  // 384-byte rows
  auto s = manager->CreateSession(p, "");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->shape().page_tokens, 16);
  EXPECT_EQ((*s)->shape().page_span, 3);
  ASSERT_TRUE((*s)->AcquireLayer(0, [] {}));
  auto a = (*s)->BeginAppend(0, 17);  // two pages of 16 rows: 6 pool pages
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool->FreePages(), 64 - 6);
  (*s)->CommitAppend(std::move(*a));
  (*s)->ReleaseLayer(0);
  EXPECT_EQ((*s)->PagesHeld(), 6);
  EXPECT_EQ(*manager->Close((*s)->id(), ""), 6);
  EXPECT_EQ(pool->FreePages(), 64);
}

// The per-layer FIFO: a step of a busy layer waits, and runs when the earlier one ends.
TEST(SessionTest, StepsOfOneLayerRunInArrivalOrder) {
  auto pool = Pool(16);
  auto manager = Manager(pool.get());
  auto s = *manager->CreateSession(Params(2), "");
  std::vector<int> ran;
  EXPECT_TRUE(s->AcquireLayer(0, [] {}));
  EXPECT_FALSE(s->AcquireLayer(0, [&] { ran.push_back(1); }));
  EXPECT_FALSE(s->AcquireLayer(0, [&] { ran.push_back(2); }));
  EXPECT_TRUE(s->AcquireLayer(1, [] {}));  // another layer is independent
  EXPECT_TRUE(s->Busy());
  s->ReleaseLayer(0);
  EXPECT_EQ(ran, std::vector<int>({1}));
  s->ReleaseLayer(0);
  EXPECT_EQ(ran, std::vector<int>({1, 2}));
  s->ReleaseLayer(0);
  s->ReleaseLayer(1);
  EXPECT_FALSE(s->Busy());
}

// Steps that end as soon as they start (refused by a full or draining batcher) release the
// layer from inside their start: a long FIFO must drain without recursing once per step.
TEST(SessionTest, ManyWaitingStepsThatEndAtOnceDoNotRecurse) {
  auto pool = Pool(16);
  auto manager = Manager(pool.get());
  auto s = *manager->CreateSession(Params(1), "");
  ASSERT_TRUE(s->AcquireLayer(0, [] {}));
  constexpr int kWaiting = 200000;
  int started = 0;
  for (int i = 0; i < kWaiting; ++i) {
    EXPECT_FALSE(s->AcquireLayer(0, [&] {
      ++started;
      s->ReleaseLayer(0);  // ends at once
    }));
  }
  s->ReleaseLayer(0);
  EXPECT_EQ(started, kWaiting);
  EXPECT_FALSE(s->Busy());
}

// Random operations with injected faults; checks the reference counts against the tables.
class Model {
 public:
  Model(KvPagePool* pool, SessionManager* manager, std::mt19937_64* rng)
      : pool_(pool), manager_(manager), rng_(rng) {}

  void RandomOp() {
    const int op = Uniform(0, 99);
    if (open_.empty() || op < 8) {
      auto s = manager_->CreateSession(Params(Uniform(1, 3)), "");
      if (s.ok()) open_.push_back(*s);
      return;
    }
    auto& s = open_[Uniform(0, static_cast<int>(open_.size()) - 1)];
    if (op < 60) {
      Step(*s);
    } else if (op < 75) {
      int64_t least = INT64_MAX;
      for (int l = 0; l < s->shape().num_layers; ++l) least = std::min(least, s->CachedTokens(l));
      auto r = manager_->Truncate(s->id(), "", Uniform(0, static_cast<int>(least) + 2));
      if (!r.ok()) EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    } else if (op < 87) {
      auto f = manager_->Fork(s->id(), "");
      if (f.ok()) open_.push_back(*f);
    } else if (op < 95) {
      EXPECT_TRUE(manager_->Close(s->id(), "").ok());
      std::swap(s, open_.back());
      open_.pop_back();
    } else {  // everything idle expires
      for (auto& o : open_) o->Touch(Session::Clock::now() - std::chrono::hours(2));
      EXPECT_EQ(manager_->ExpireIdle(Session::Clock::now()), static_cast<int64_t>(open_.size()));
      open_.clear();
    }
  }

  // A step whose launch fails one time in four (an injected fault): it must change nothing.
  void Step(Session& s) {
    const int layer = Uniform(0, s.shape().num_layers - 1);
    const int64_t before = s.CachedTokens(layer);
    ASSERT_TRUE(s.AcquireLayer(layer, [] {}));
    const int n = Uniform(0, 3) == 0 ? Uniform(9, 40) : 1;
    auto p = s.BeginAppend(layer, n);
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
    } else if (Uniform(0, 3) == 0) {
      s.AbortAppend(std::move(*p));
      EXPECT_EQ(s.CachedTokens(layer), before);
    } else {
      EXPECT_EQ(p->appended(), n);
      EXPECT_EQ(s.TableAfter(*p).size(), static_cast<size_t>((before + n + 7) / 8));
      s.CommitAppend(std::move(*p));
      EXPECT_EQ(s.CachedTokens(layer), before + n);
    }
    s.ReleaseLayer(layer);
  }

  // Every page's reference count equals the number of tables that hold it.
  void CheckReferences() {
    std::map<int32_t, int> holders;
    for (const auto& s : open_) {
      for (int l = 0; l < s->shape().num_layers; ++l) {
        ASSERT_TRUE(s->AcquireLayer(l, [] {}));
        auto p = s->BeginAppend(l, 0);  // a step of no tokens: the table as it is
        ASSERT_TRUE(p.ok());
        for (int32_t page : s->TableAfter(*p)) ++holders[page];
        s->AbortAppend(std::move(*p));
        s->ReleaseLayer(l);
      }
    }
    int64_t used = 0;
    for (const auto& [page, n] : holders) {
      EXPECT_EQ(pool_->RefCount(page), n) << "page " << page;
      ++used;
    }
    EXPECT_EQ(pool_->FreePages(), pool_->num_pages() - used);
  }

  void CloseAll() {
    for (auto& s : open_) EXPECT_TRUE(manager_->Close(s->id(), "").ok());
    open_.clear();
  }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(*rng_); }
  KvPagePool* pool_;
  SessionManager* manager_;
  std::mt19937_64* rng_;
  std::vector<std::shared_ptr<Session>> open_;
};

TEST(KvCacheTest, RandomOperationsAndFaultsLeakNoPage) {
  for (int round = 0; round < 20; ++round) {
    const uint64_t seed = std::random_device{}();
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    auto pool = Pool(120, seed | 1);  // small: the cache fills up often
    auto manager = Manager(pool.get(), 12);
    Model model(pool.get(), manager.get(), &rng);
    for (int i = 0; i < 400; ++i) {
      model.RandomOp();
      if (i % 25 == 0) model.CheckReferences();
      if (::testing::Test::HasFailure()) return;
    }
    model.CheckReferences();
    model.CloseAll();
    EXPECT_EQ(pool->FreePages(), 120);
  }
}

// A session closed while a step holds its layer gives that layer's pages back when the step ends.
TEST(KvCacheTest, CloseDuringAStepFreesTheLayerWhenTheStepEnds) {
  auto pool = Pool(32);
  auto manager = Manager(pool.get());
  auto s = *manager->CreateSession(Params(2), "");
  for (int l : {0, 1}) {
    ASSERT_TRUE(s->AcquireLayer(l, [] {}));
    auto p = s->BeginAppend(l, 20);  // 3 pages each
    ASSERT_TRUE(p.ok());
    s->CommitAppend(std::move(*p));
    s->ReleaseLayer(l);
  }
  EXPECT_EQ(pool->FreePages(), 26);
  ASSERT_TRUE(s->AcquireLayer(0, [] {}));
  auto p = s->BeginAppend(0, 5);  // one more page
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*manager->Close(s->id(), ""), 3);  // layer 1 only: layer 0 is in use
  EXPECT_EQ(pool->FreePages(), 28);
  bool ran = false;
  EXPECT_FALSE(s->AcquireLayer(0, [&] { ran = true; }));
  s->CommitAppend(std::move(*p));
  s->ReleaseLayer(0);  // starts the waiting step, which must find the session closed
  EXPECT_TRUE(ran);
  EXPECT_EQ(s->BeginAppend(0, 1).status().code(), absl::StatusCode::kNotFound);
  s->ReleaseLayer(0);
  EXPECT_EQ(pool->FreePages(), 32);
}

TEST(KvCacheTest, CopyOnWritePlansTheSharedRowsAndNewPages) {
  auto pool = Pool(16);
  auto manager = Manager(pool.get());
  auto a = *manager->CreateSession(Params(1), "");
  ASSERT_TRUE(a->AcquireLayer(0, [] {}));
  auto p = a->BeginAppend(0, 11);  // pages [x, y], y holds 3 rows
  ASSERT_TRUE(p.ok());
  const std::vector<int32_t> table = a->TableAfter(*p);
  a->CommitAppend(std::move(*p));
  a->ReleaseLayer(0);
  auto b = *manager->Fork(a->id(), "");
  ASSERT_TRUE(b->AcquireLayer(0, [] {}));
  auto q = b->BeginAppend(0, 6);  // copy y (3 rows), then one new page for rows 16..16
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(q->copies.size(), 3u);
  EXPECT_EQ(q->copies[0].src_row, int64_t{table[1]} * 8);
  EXPECT_EQ(q->replaced, table[1]);
  const std::vector<int32_t> after = b->TableAfter(*q);
  ASSERT_EQ(after.size(), 3u);
  EXPECT_EQ(after[0], table[0]);
  EXPECT_NE(after[1], table[1]);
  EXPECT_EQ(after[1], q->taken[0]);  // the copy
  EXPECT_EQ(after[2], q->taken[1]);  // the new page
  EXPECT_EQ(q->copies[2].dst_row, int64_t{after[1]} * 8 + 2);
  EXPECT_EQ(q->tokens_before, 11);
  EXPECT_EQ(q->tokens_after, 17);
  b->CommitAppend(std::move(*q));
  b->ReleaseLayer(0);
  EXPECT_EQ(pool->RefCount(table[0]), 2);
  EXPECT_EQ(pool->RefCount(table[1]), 1);
  EXPECT_TRUE(manager->Close(a->id(), "").ok());
  EXPECT_TRUE(manager->Close(b->id(), "").ok());
  EXPECT_EQ(pool->FreePages(), 16);
}


TEST(Crc32cTest, KnownValuesAndIncremental) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(Crc32cExtend(Crc32c("12345"), "6789", 4), 0xE3069283u);
  EXPECT_EQ(Crc32cExtendPortableForTest(0, "123456789", 9), 0xE3069283u);
  // The fast path and the table agree on random bytes of every length and alignment.
  std::mt19937_64 rng(99);
  std::string bytes(300, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; start + n <= bytes.size(); n += 7) {
      ASSERT_EQ(Crc32cExtend(5, bytes.data() + start, n),
                Crc32cExtendPortableForTest(5, bytes.data() + start, n))
          << start << " " << n;
    }
  }
}

// Host KV regions of two replicas, filled with random bytes.
struct HostRegion {
  std::vector<char> k, v;
  KvRegion region;
  HostRegion(int64_t pages, int64_t page_bytes, uint64_t seed)
      : k(pages * page_bytes), v(pages * page_bytes) {
    std::mt19937_64 rng(seed);
    for (char& c : k) c = static_cast<char>(rng());
    for (char& c : v) c = static_cast<char>(rng());
    region = {k.data(), v.data(), pages, page_bytes};
  }
  std::string Page(int32_t run, int32_t span) const {
    const int64_t off = int64_t{run} * span * region.page_bytes;
    const int64_t n = span * region.page_bytes;
    return std::string(k.data() + off, n) + std::string(v.data() + off, n);
  }
};

std::shared_ptr<Session> SessionWithTokens(SessionManager& m, int layers,
                                           const std::vector<int64_t>& tokens) {
  std::shared_ptr<Session> s = *m.CreateSession(Params(layers), "owner-a");
  for (int l = 0; l < layers; ++l) {
    EXPECT_TRUE(s->AcquireLayer(l, [] {}));
    absl::StatusOr<PendingAppend> p = s->BeginAppend(l, tokens[l]);
    EXPECT_TRUE(p.ok()) << p.status();
    s->CommitAppend(*std::move(p));
    s->ReleaseLayer(l);
  }
  return s;
}

TEST(SessionTransferTest, MovesEveryLayerPageByPageAndFreesTheExportersReferences) {
  auto src_pool = Pool(64, 7), dst_pool = Pool(64, 11);
  HostRegion src(64, 2048, 1), dst(64, 2048, 2);
  auto m = Manager(src_pool.get());
  auto s = SessionWithTokens(*m, 3, {1, 17, 40});  // 8 tokens per page: 1 + 3 + 5 pages
  auto fork = *m->Fork(s->id(), "owner-a");
  const int64_t src_free = src_pool->FreePages();
  {
    auto exporter = *SessionExporter::Create(*s, src_pool.get(), src.region);
    EXPECT_EQ(exporter->header().TotalPages(), 9);
    EXPECT_EQ(exporter->header().owner, "owner-a");
    auto importer = *SessionImporter::Create(exporter->header(), dst_pool.get(), dst.region);
    EXPECT_EQ(dst_pool->FreePages(), 64 - 9);
    // Closing the source (and its fork) during the move frees nothing the exporter still reads.
    ASSERT_TRUE(m->Close(fork->id(), "owner-a").ok());
    while (auto page = exporter->Next()) ASSERT_TRUE(importer->Accept(*page).ok());
    auto moved = *importer->Finish("dst.1");
    EXPECT_EQ(moved->owner(), "owner-a");
    const std::vector<int64_t> want_tokens = {1, 17, 40};
    auto src_states = *s->RefLayerStates();
    auto dst_states = *moved->RefLayerStates();
    for (int l = 0; l < 3; ++l) {
      EXPECT_EQ(moved->CachedTokens(l), want_tokens[l]);
      ASSERT_EQ(src_states[l].pages.size(), dst_states[l].pages.size());
      for (size_t p = 0; p < src_states[l].pages.size(); ++p) {
        EXPECT_EQ(src.Page(src_states[l].pages[p], 1), dst.Page(dst_states[l].pages[p], 1))
            << "layer " << l << " page " << p;
      }
      src_pool->Unref(src_states[l].pages);
      dst_pool->Unref(dst_states[l].pages);
    }
    EXPECT_EQ(moved->PagesHeld(), 9);
  }
  EXPECT_EQ(src_pool->FreePages(), src_free);  // the fork shared every page
  EXPECT_EQ(dst_pool->FreePages(), 64);        // the moved session is gone
  ASSERT_TRUE(m->Close(s->id(), "owner-a").ok());
  EXPECT_EQ(src_pool->FreePages(), 64);
}

// A session and two forks (one grown past the shared pages, one truncated into them) in one
// stream: each shared page crosses once, the peer holds as many pages as the source with the same
// references, and an append into a shared partial page there copies it (copy on write), leaving
// the others' bytes as they were.
TEST(SessionTransferTest, AForkFamilyCrossesInOneStreamAndSharesItsPagesAgain) {
  auto src_pool = Pool(64, 7), dst_pool = Pool(64, 11);
  HostRegion src(64, 2048, 5), dst(64, 2048, 6);
  auto m = Manager(src_pool.get());
  auto s = SessionWithTokens(*m, 2, {13, 20});  // 8 tokens per page: 2 + 3 pages
  auto grown = *m->Fork(s->id(), "owner-a");
  auto cut = *m->Fork(s->id(), "owner-a");
  for (int l = 0; l < 2; ++l) {  // grown: 5 more tokens per layer (a copy of the partial page)
    ASSERT_TRUE(grown->AcquireLayer(l, [] {}));
    auto p = grown->BeginAppend(l, 5);
    ASSERT_TRUE(p.ok()) << p.status();
    grown->CommitAppend(*std::move(p));
    grown->ReleaseLayer(l);
  }
  ASSERT_TRUE(cut->Truncate(6).ok());  // 7 and 14 tokens: shares 1 + 2 pages
  const std::vector<std::shared_ptr<Session>> family = {s, grown, cut};
  const int64_t src_used = 64 - src_pool->FreePages();
  std::vector<std::unique_ptr<Session>> moved;
  int64_t pages_sent = 0;
  {
    StreamPages out, in;
    std::vector<std::unique_ptr<SessionExporter>> exporters;
    std::vector<std::unique_ptr<SessionImporter>> importers;
    for (const auto& f : family) {
      exporters.push_back(*SessionExporter::Create(*f, src_pool.get(), src.region, nullptr, &out));
      auto importer =
          SessionImporter::Create(exporters.back()->header(), dst_pool.get(), dst.region, nullptr, &in);
      ASSERT_TRUE(importer.ok()) << importer.status();
      importers.push_back(*std::move(importer));
      while (auto page = exporters.back()->Next()) {
        ASSERT_TRUE(importers.back()->Accept(*page).ok());
        ++pages_sent;
      }
    }
    // The first session sends all of its pages, the forks only those they do not share.
    EXPECT_TRUE(exporters[0]->header().shared_pages.empty());
    EXPECT_EQ(exporters[2]->header().OwnPages(), 0);  // the truncated fork: all shared
    EXPECT_EQ(pages_sent, src_used);
    for (size_t i = 0; i < family.size(); ++i) {
      moved.push_back(*importers[i]->Finish("dst." + std::to_string(i)));
    }
  }
  EXPECT_EQ(64 - dst_pool->FreePages(), src_used);
  for (size_t i = 0; i < family.size(); ++i) {
    auto a = *family[i]->RefLayerStates();
    auto b = *moved[i]->RefLayerStates();
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(moved[i]->CachedTokens(l), family[i]->CachedTokens(l));
      ASSERT_EQ(a[l].pages.size(), b[l].pages.size());
      for (size_t p = 0; p < a[l].pages.size(); ++p) {
        EXPECT_EQ(src.Page(a[l].pages[p], 1), dst.Page(b[l].pages[p], 1));
        // As many references there as here (less the one each RefLayerStates took).
        EXPECT_EQ(dst_pool->RefCount(b[l].pages[p]), src_pool->RefCount(a[l].pages[p]))
            << "session " << i << " layer " << l << " page " << p;
      }
      src_pool->Unref(a[l].pages);
      dst_pool->Unref(b[l].pages);
    }
  }
  // Copy on write on the peer: the truncated fork appends into the page it shares with the
  // others (layer 0, 7 of 8 rows): it gets a copy, and the others' page keeps its bytes.
  Session& cut_here = *moved[2];
  const int32_t shared_page = cut_here.TablePages()[0];
  const std::string before = dst.Page(shared_page, 1);
  ASSERT_EQ(dst_pool->RefCount(shared_page), 3);
  ASSERT_TRUE(cut_here.AcquireLayer(0, [] {}));
  auto p = cut_here.BeginAppend(0, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->replaced.has_value());
  EXPECT_EQ(*p->replaced, shared_page);
  cut_here.CommitAppend(*std::move(p));
  cut_here.ReleaseLayer(0);
  EXPECT_EQ(dst_pool->RefCount(shared_page), 2);
  EXPECT_NE(cut_here.TablePages()[0], shared_page);
  EXPECT_EQ(dst.Page(shared_page, 1), before);
  moved.clear();  // every page goes back on both sides
  EXPECT_EQ(dst_pool->FreePages(), 64);
  for (const auto& f : family) ASSERT_TRUE(m->Close(f->id(), "owner-a").ok());
  EXPECT_EQ(src_pool->FreePages(), 64);
}

TEST(SessionTransferTest, CorruptPageFullPeerAndAbandonedMoveLeaveTheSourceWhole) {
  auto src_pool = Pool(32), dst_pool = Pool(32);
  HostRegion src(32, 2048, 3), dst(32, 2048, 4);
  auto m = Manager(src_pool.get());
  auto s = SessionWithTokens(*m, 2, {24, 9});  // 3 + 2 pages
  const int64_t src_free = src_pool->FreePages();
  {
    auto exporter = *SessionExporter::Create(*s, src_pool.get(), src.region);
    auto importer = *SessionImporter::Create(exporter->header(), dst_pool.get(), dst.region);
    auto page = *exporter->Next();
    page.kv[100] ^= 1;
    EXPECT_EQ(importer->Accept(page).code(), absl::StatusCode::kDataLoss);
    page.kv[100] ^= 1;
    page.index = 1;
    EXPECT_EQ(importer->Accept(page).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(importer->Finish("x").status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(dst_pool->FreePages(), 32);
  EXPECT_EQ(src_pool->FreePages(), src_free);
  EXPECT_EQ(s->PagesHeld(), 5);
  EXPECT_EQ(s->CachedTokens(0), 24);

  // A peer with too few free pages refuses before any byte moves and takes none.
  auto small_pool = Pool(4);
  HostRegion small(4, 2048, 5);
  auto exporter = *SessionExporter::Create(*s, src_pool.get(), src.region);
  EXPECT_EQ(SessionImporter::Create(exporter->header(), small_pool.get(), small.region)
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small_pool->FreePages(), 4);

  // A header that does not fit this replica names the field.
  SessionTransferHeader bad = exporter->header();
  bad.layer_pages[1] = 7;
  auto refused = SessionImporter::Create(bad, dst_pool.get(), dst.region);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("layer 1"), std::string::npos);
  bad = exporter->header();
  bad.page_bytes = 4096;
  EXPECT_NE(SessionImporter::Create(bad, dst_pool.get(), dst.region)
                .status()
                .message()
                .find("page_bytes"),
            std::string::npos);
  EXPECT_EQ(dst_pool->FreePages(), 32);
}

TEST(SessionTransferTest, ExportWaitsForNoStepInProgress) {
  auto pool = Pool(16);
  HostRegion region(16, 2048, 6);
  auto m = Manager(pool.get());
  auto s = SessionWithTokens(*m, 2, {3, 3});
  ASSERT_TRUE(s->AcquireLayer(1, [] {}));
  EXPECT_EQ(SessionExporter::Create(*s, pool.get(), region.region).status().code(),
            absl::StatusCode::kFailedPrecondition);
  s->ReleaseLayer(1);
  EXPECT_TRUE(SessionExporter::Create(*s, pool.get(), region.region).ok());
  ASSERT_TRUE(m->Close(s->id(), "owner-a").ok());
  EXPECT_EQ(SessionExporter::Create(*s, pool.get(), region.region).status().code(),
            absl::StatusCode::kNotFound);
}

// A step device that only copies KV pages (counting them), failing from the n-th copy on.
class CopyingDevice final : public StepDevice {
 public:
  explicit CopyingDevice(int fail_from) : fail_from_(fail_from) {}
  int Lanes() const override { return 1; }
  KvRegion kv_region() const override { return {}; }
  absl::StatusOr<char*> InputStaging(int, size_t) override { return absl::UnimplementedError(""); }
  absl::StatusOr<OutputBytes> OutputStaging(size_t) override { return absl::UnimplementedError(""); }
  absl::Status Launch(int, const StepLaunch&) override { return absl::UnimplementedError(""); }
  absl::StatusOr<StepLaunchTimes> Wait(int, const StepLaunch&) override {
    return absl::UnimplementedError("");
  }
  absl::Status ReadKv(char* host, const char* kv, size_t bytes) const override {
    return Copy(host, kv, bytes);
  }
  absl::Status WriteKv(char* kv, const char* host, size_t bytes) const override {
    return Copy(kv, host, bytes);
  }
  int copies() const { return copies_; }

 private:
  absl::Status Copy(char* dst, const char* src, size_t bytes) const {
    if (++copies_ >= fail_from_) return absl::InternalError("device copy failed");
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  const int fail_from_;
  mutable int copies_ = 0;
};

TEST(SessionTransferTest, PagesGoThroughTheDevicesCopiesAndAFailedCopyEndsTheMove) {
  auto src_pool = Pool(32), dst_pool = Pool(32);
  HostRegion src(32, 2048, 8), dst(32, 2048, 9);
  auto m = Manager(src_pool.get());
  auto s = SessionWithTokens(*m, 2, {9, 20});  // 2 + 3 pages
  {
    CopyingDevice reads(1000), writes(1000);
    auto exporter = *SessionExporter::Create(*s, src_pool.get(), src.region, &reads);
    auto importer = *SessionImporter::Create(exporter->header(), dst_pool.get(), dst.region, &writes);
    while (auto page = exporter->Next()) ASSERT_TRUE(importer->Accept(*page).ok());
    ASSERT_TRUE(exporter->status().ok());
    EXPECT_EQ(reads.copies(), 10);  // keys and values of 5 pages
    EXPECT_EQ(writes.copies(), 10);
    auto moved = *importer->Finish("dst.1");
    auto a = *s->RefLayerStates();
    auto b = *moved->RefLayerStates();
    for (int l = 0; l < 2; ++l) {
      for (size_t p = 0; p < a[l].pages.size(); ++p) {
        EXPECT_EQ(src.Page(a[l].pages[p], 1), dst.Page(b[l].pages[p], 1));
      }
      src_pool->Unref(a[l].pages);
      dst_pool->Unref(b[l].pages);
    }
  }
  EXPECT_EQ(dst_pool->FreePages(), 32);
  {
    // A read that fails ends the export with its status; a write that fails refuses the page.
    CopyingDevice reads(4), writes(3);
    auto exporter = *SessionExporter::Create(*s, src_pool.get(), src.region, &reads);
    auto importer = *SessionImporter::Create(exporter->header(), dst_pool.get(), dst.region, &writes);
    auto first = exporter->Next();
    ASSERT_TRUE(first.has_value());
    const absl::Status accepted = importer->Accept(*first);
    EXPECT_TRUE(accepted.ok()) << accepted;
    EXPECT_FALSE(exporter->Next().has_value());
    EXPECT_EQ(exporter->status().code(), absl::StatusCode::kInternal);
    auto again = *SessionExporter::Create(*s, src_pool.get(), src.region);
    again->Next();
    EXPECT_EQ(importer->Accept(*again->Next()).code(), absl::StatusCode::kInternal);
    EXPECT_FALSE(importer->Finish("dst.2").ok());
  }
  EXPECT_EQ(dst_pool->FreePages(), 32);  // the importer gave back what it took
  EXPECT_EQ(s->CachedTokens(1), 20);     // the source is whole
  ASSERT_TRUE(m->Close(s->id(), "owner-a").ok());
  EXPECT_EQ(src_pool->FreePages(), 32);
}

TEST(SessionManagerTest, AMovingSessionRefusesChangesAndAMovedOneSaysWhere) {
  auto pool = Pool(32);
  auto m = Manager(pool.get());
  auto s = SessionWithTokens(*m, 2, {5, 5});
  // A step that had begun before the freeze ends as usual; the export waits for it.
  ASSERT_TRUE(s->AcquireLayer(0, [] {}));
  auto begun = s->BeginAppend(0, 2);
  ASSERT_TRUE(begun.ok()) << begun.status();
  auto moving = m->BeginMove(s->id());
  ASSERT_TRUE(moving.ok()) << moving.status();
  EXPECT_FALSE(s->Settled());
  EXPECT_EQ(s->RefLayerStates().status().code(), absl::StatusCode::kFailedPrecondition);
  s->CommitAppend(*std::move(begun));
  s->ReleaseLayer(0);
  EXPECT_TRUE(s->Settled());
  EXPECT_EQ(s->CachedTokens(0), 7);
  // Frozen: steps, truncate, fork and close are refused with the retry status; nothing changes.
  ASSERT_TRUE(s->AcquireLayer(1, [] {}));
  EXPECT_EQ(s->BeginAppend(1, 1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s->BeginAppend(1, 1).status().message().find("attnd-session-moving"),
            std::string::npos);
  // The export still reads its tables while a refused step holds the layer.
  auto states = s->RefLayerStates();
  ASSERT_TRUE(states.ok()) << states.status();
  for (const Session::LayerState& l : *states) pool->Unref(l.pages);
  s->ReleaseLayer(1);
  for (const absl::Status& st : {m->Truncate(s->id(), "owner-a", 1).status(),
                                 m->Fork(s->id(), "owner-a").status(),
                                 m->Close(s->id(), "owner-a").status()}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  }
  EXPECT_EQ(s->CachedTokens(0), 7);
  // A failed move thaws it.
  m->EndMove(*moving, "", "");
  EXPECT_TRUE(m->Truncate(s->id(), "owner-a", 1).ok());
  // A move that succeeds closes it here (its pages freed) and remembers where it went.
  moving = m->BeginMove(s->id());
  ASSERT_TRUE(moving.ok());
  m->EndMove(*moving, "10.0.0.7:50051", "peer.abc");
  EXPECT_EQ(pool->FreePages(), 32);
  EXPECT_EQ(m->OpenSessions(), 0);
  for (const absl::Status& st : {m->Find(s->id(), "owner-a").status(),
                                 m->Close(s->id(), "owner-a").status()}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_EQ(MovedToOf(st), "10.0.0.7:50051;peer.abc") << st;
  }
  // A step that found it before the move is sent again, and then learns where it went.
  EXPECT_EQ(s->BeginAppend(0, 1).status().code(), absl::StatusCode::kUnavailable);
  // While draining: no new session, and a fork is told to come back (its session will move).
  m->StopCreating();
  EXPECT_EQ(m->CreateSession(Params(1), "owner-a").status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attn
