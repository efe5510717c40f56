// Replays, in the normal build, through each fuzz target's own code path: every input under
// tests/fuzz/regressions/<target>/ (inputs that once crashed or broke an invariant there) and the
// seed corpus tests/fuzz/corpus/<target>/, for the targets attend, session, region and import.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "attend_fuzz.h"
#include "attn/v1/attention.pb.h"
#include "import_fuzz.h"
#include "region_fuzz.h"
#include "session_fuzz.h"

namespace {

using attn::fuzz::Outcome;

struct Target {
  const char* name;
  Outcome (*run)(const uint8_t*, size_t);
};
const Target kTargets[] = {{"attend", attn::fuzz::RunAttendInput},
                           {"session", attn::fuzz::RunSessionInput},
                           {"region", attn::fuzz::RunRegionInput},
                           {"import", attn::fuzz::RunImportInput}};

// Regular files under dir, sorted; none when dir does not exist (git keeps no empty folder).
std::vector<std::filesystem::path> FilesUnder(const std::string& dir) {
  std::vector<std::filesystem::path> files;
  if (!std::filesystem::is_directory(dir)) return files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string Read(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

Outcome RunOn(const Target& t, const std::string& bytes) {
  return t.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

TEST(FuzzRegression, EveryRegressionInputPasses) {
  size_t replayed = 0;
  for (const Target& t : kTargets) {
    for (const auto& f : FilesUnder(std::string(ATTN_FUZZ_DIR "/regressions/") + t.name)) {
      const Outcome out = RunOn(t, Read(f));
      EXPECT_TRUE(out.violation.empty()) << t.name << "/" << f.filename() << ": " << out.violation;
      ++replayed;
    }
  }
  std::cout << replayed << " regression inputs replayed\n";
}

// The inputs fuzzing found first: float32 K, then V, in a host region at an offset that is not
// a multiple of 4. Refused, by name, before the kernel reads them.
TEST(FuzzRegression, MisalignedFloat32RegionInputsAreRefused) {
  for (const char* name : {"misaligned_f32_k_region.pb", "misaligned_f32_v_region.pb"}) {
    const std::string bytes = Read(std::string(ATTN_FUZZ_DIR "/regressions/attend/") + name);
    ASSERT_FALSE(bytes.empty()) << name;
    const Outcome out = attn::fuzz::RunAttendInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                                   bytes.size());
    EXPECT_TRUE(out.parsed) << name;
    EXPECT_FALSE(out.valid) << name;
    EXPECT_FALSE(out.computed) << name;
    EXPECT_TRUE(out.violation.empty()) << name << ": " << out.violation;
  }
}

TEST(FuzzRegression, EverySeedIsAcceptedAndRun) {
  for (const Target& t : kTargets) {
    const auto files = FilesUnder(std::string(ATTN_FUZZ_DIR "/corpus/") + t.name);
    ASSERT_FALSE(files.empty()) << t.name;
    for (const auto& f : files) {
      const Outcome out = RunOn(t, Read(f));
      EXPECT_TRUE(out.valid) << t.name << "/" << f.filename() << " is not accepted";
      // Seeds with GPU regions are resolved only (a device backend's requests).
      EXPECT_TRUE(out.computed || out.on_gpu) << t.name << "/" << f.filename() << " did not run";
      EXPECT_TRUE(out.violation.empty()) << t.name << "/" << f.filename() << ": " << out.violation;
    }
  }
}

TEST(FuzzRegression, GarbageIsRejectedQuietly) {
  const std::string garbage[] = {"", "\x0a", "\x0a\xff\xff\xff\xff\x0f", std::string(64, '\xff'),
                                 "\x0a\x02\x08\x01\x12\x00"};
  for (const std::string& g : garbage) {
    for (const Target& t : kTargets) {
      const Outcome out = RunOn(t, g);
      // The region target makes a request of any 3 bytes (a template, edited): it may run.
      if (std::string(t.name) != "region") EXPECT_FALSE(out.computed) << t.name;
      EXPECT_TRUE(out.violation.empty()) << t.name << ": " << out.violation;
    }
  }
}

// The region target's oracle on inputs built here: a float32 Attend (the first finding's shape)
// with every tensor in r0 runs and equals its inline twin; K moved 2 bytes (a multiple of 2, not
// of 4) is refused; a bfloat16 one all in the GPU region resolves only; a step with its tensors in
// r1 and outputs in r0 runs and equals its twin.
TEST(FuzzRegression, RegionTargetRunsAlignedSlicesAndRefusesOthers) {
  using attn::fuzz::RegionEdit;
  using attn::fuzz::RegionInput;
  using N = attn::fuzz::RegionName;
  using S = attn::fuzz::RegionSlot;
  auto run = [](const std::string& input) {
    return attn::fuzz::RunRegionInput(reinterpret_cast<const uint8_t*>(input.data()),
                                      input.size());
  };
  std::vector<RegionEdit> edits = {{S::kQ, N::kR0, 0},    {S::kK, N::kR0, 128},
                                   {S::kV, N::kR0, 384},  {S::kO, N::kR0, 640},
                                   {S::kLse, N::kR0, 1024}};
  Outcome out = run(RegionInput(0, 5, 0, edits));
  EXPECT_TRUE(out.computed);
  EXPECT_TRUE(out.violation.empty()) << out.violation;
  edits[1].offset = 130;
  out = run(RegionInput(0, 5, 0, edits));
  EXPECT_TRUE(out.parsed);
  EXPECT_FALSE(out.valid);
  EXPECT_TRUE(out.violation.empty()) << out.violation;
  for (RegionEdit& e : edits) e.region = N::kG0;
  edits[1].offset = 128;
  out = run(RegionInput(1, 5, 0, edits));
  EXPECT_TRUE(out.on_gpu);
  EXPECT_FALSE(out.computed);
  EXPECT_TRUE(out.violation.empty()) << out.violation;
  const std::vector<RegionEdit> step = {{S::kQ, N::kR1, 0},   {S::kK, N::kR1, 512},
                                        {S::kV, N::kR1, 1024}, {S::kO, N::kR0, 16},
                                        {S::kLse, N::kR0, 4096}};
  out = run(RegionInput(4, 9, 0, step));
  EXPECT_TRUE(out.computed);
  EXPECT_TRUE(out.violation.empty()) << out.violation;
}

// A session program built here: every op, the answers checked by the fuzz path's own model.
TEST(FuzzRegression, SessionProgramRunsCleanAndLeavesEveryPageFree) {
  using attn::fuzz::SessionOp;
  std::string p;
  attn::v1::CreateSessionRequest create;
  create.set_num_layers(2);
  create.set_num_kv_heads(2);
  create.set_head_dim(8);
  create.set_dtype(attn::v1::DTYPE_FLOAT16);
  attn::fuzz::AppendRecord(&p, SessionOp::kCreate, create.SerializeAsString());
  auto step = [](int layer, int n, uint16_t seed) {
    attn::v1::StepRequest r;
    r.set_session_id("#0");
    r.set_layer(layer);
    for (auto* t : {r.mutable_q(), r.mutable_k_new(), r.mutable_v_new()}) {
      t->set_dtype(attn::v1::DTYPE_FLOAT16);
      t->add_shape(n);
      t->add_shape(t == r.mutable_q() ? 4 : 2);
      t->add_shape(8);
      std::string& d = *t->mutable_data();
      for (int i = 0; i < n * t->shape(1) * 8; ++i) {
        const uint16_t h = static_cast<uint16_t>(0x3000 + (seed * 7919 + i * 104729) % 0x800);
        d.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    return r;
  };
  attn::fuzz::AppendRecord(&p, SessionOp::kStep, step(0, 19, 1).SerializeAsString());
  attn::v1::BatchStepRequest batch;
  *batch.add_steps() = step(0, 1, 2);
  *batch.add_steps() = step(1, 3, 3);
  *batch.add_steps() = step(0, 2, 4);
  attn::fuzz::AppendRecord(&p, SessionOp::kBatchStep, batch.SerializeAsString());
  attn::v1::ForkSessionRequest fork;
  fork.set_session_id("#0");
  attn::fuzz::AppendRecord(&p, SessionOp::kFork, fork.SerializeAsString());
  attn::v1::TruncateSessionRequest truncate;
  truncate.set_session_id("#0");
  truncate.set_tokens(3);
  attn::fuzz::AppendRecord(&p, SessionOp::kTruncate, truncate.SerializeAsString());
  attn::v1::StepRequest on_fork = step(0, 5, 5);
  on_fork.set_session_id("#1");
  attn::fuzz::AppendRecord(&p, SessionOp::kStep, on_fork.SerializeAsString());
  attn::fuzz::AppendRecord(&p, SessionOp::kStep, step(1, 1, 6).SerializeAsString());
  const auto out = attn::fuzz::RunSessionInput(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  EXPECT_TRUE(out.computed);
  EXPECT_TRUE(out.violation.empty()) << out.violation;
  // The same program with a truncate past the start and a step of another dtype: refused, and
  // still clean.
  truncate.set_tokens(1000);
  attn::fuzz::AppendRecord(&p, SessionOp::kTruncate, truncate.SerializeAsString());
  attn::v1::StepRequest wrong = step(0, 1, 7);
  wrong.mutable_q()->set_dtype(attn::v1::DTYPE_BFLOAT16);
  attn::fuzz::AppendRecord(&p, SessionOp::kStep, wrong.SerializeAsString());
  const auto out2 = attn::fuzz::RunSessionInput(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  EXPECT_TRUE(out2.violation.empty()) << out2.violation;
}

// Import streams built here, each refused (or accepted) with every page and session count as
// before: the good stream of the f16 seed's shape, then that stream with a checksum off, a page
// short, a page index skipped, a page too many, the stream ended early, dropped midway, a second
// header, absurd sizes, FP8 scales missing, and the layer_pages not matching the tokens.
TEST(FuzzRegression, ImportTargetRefusesBadStreamsAndLeavesNothing) {
  using attn::fuzz::ImportOp;
  using attn::fuzz::ImportPagePayload;
  auto header = [](auto change) {
    attn::v1::SessionTransferChunk c;
    attn::v1::SessionTransferHeader* h = c.mutable_header();
    h->set_num_layers(2);
    h->set_num_kv_heads(2);
    h->set_head_dim(8);
    h->set_dtype(attn::v1::DTYPE_FLOAT16);
    h->set_max_tokens(96);
    h->set_page_tokens(64);
    h->set_page_span(1);
    h->set_page_bytes(2048);
    for (int64_t t : {70, 3}) {
      h->add_layer_tokens(t);
      h->add_layer_pages((t + 63) / 64);
    }
    change(*h);
    return c.SerializeAsString();
  };
  auto stream = [&](auto change, std::vector<std::string> pages, bool end = true) {
    std::string in;
    attn::fuzz::AppendImportRecord(&in, ImportOp::kChunk, header(change));
    for (const std::string& p : pages) attn::fuzz::AppendImportRecord(&in, ImportOp::kPage, p);
    if (end) attn::fuzz::AppendImportRecord(&in, ImportOp::kEnd, "");
    return in;
  };
  auto run = [](const std::string& in) {
    return attn::fuzz::RunImportInput(reinterpret_cast<const uint8_t*>(in.data()), in.size());
  };
  const auto same = [](attn::v1::SessionTransferHeader&) {};
  const std::string ok = ImportPagePayload(0, 0, 0, 5);
  Outcome good = run(stream(same, {ok, ok, ok}));
  EXPECT_TRUE(good.valid && good.computed);
  EXPECT_TRUE(good.violation.empty()) << good.violation;
  struct Bad {
    const char* what;
    std::string input;
  };
  std::string second_header = stream(same, {ok}, false);
  attn::fuzz::AppendImportRecord(&second_header, ImportOp::kChunk, header(same));
  std::string dropped = stream(same, {ok, ok}, false);
  attn::fuzz::AppendImportRecord(&dropped, ImportOp::kDrop, "");
  const std::vector<Bad> bad = {
      {"a checksum off", stream(same, {ok, ImportPagePayload(0, 0, 1, 5), ok})},
      {"a page short", stream(same, {ok, ImportPagePayload(0, -1, 0, 5), ok})},
      {"a page index skipped", stream(same, {ok, ImportPagePayload(1, 0, 0, 5)})},
      {"a page index repeated", stream(same, {ok, ImportPagePayload(-1, 0, 0, 5)})},
      {"a page too many", stream(same, {ok, ok, ok, ok})},
      {"the stream ended early", stream(same, {ok, ok})},
      {"dropped midway", dropped},
      {"a second header", second_header},
      {"absurd page_bytes", stream([](auto& h) { h.set_page_bytes(int64_t{1} << 50); }, {ok})},
      {"absurd layer counts", stream([](auto& h) {
         h.set_num_layers(1 << 30);
       }, {ok})},
      {"more pages than the pool has", stream([](auto& h) {
         h.set_max_tokens(1 << 20);
         h.set_layer_tokens(0, int64_t{64} << 20);
         h.set_layer_pages(0, int64_t{1} << 20);
       }, {ok})},
      {"negative tokens", stream([](auto& h) { h.set_layer_tokens(1, -3); }, {ok})},
      {"layer_pages not matching the tokens", stream([](auto& h) { h.set_layer_pages(1, 2); }, {ok})},
      {"FP8 cache without scales", stream([](auto& h) {
         h.set_cache_dtype(attn::v1::DTYPE_FLOAT8_E4M3);
       }, {ok})},
      {"FP8 scales without an FP8 cache", stream([](auto& h) { h.add_k_scales(1.0f); }, {ok})},
      {"FP8 scale NaN", stream([](auto& h) {
         h.set_cache_dtype(attn::v1::DTYPE_FLOAT8_E4M3);
         h.add_k_scales(std::nanf(""));
         h.add_k_scales(1.0f);
         h.add_v_scales(1.0f);
         h.add_v_scales(1.0f);
       }, {ok})},
  };
  for (const Bad& b : bad) {
    const Outcome out = run(b.input);
    EXPECT_FALSE(out.valid) << b.what;
    EXPECT_TRUE(out.violation.empty()) << b.what << ": " << out.violation;
  }

  // A fork family in one stream: the session, then a fork sharing its first layer's two pages
  // and a page of its own; then the fork's shared_pages wrong in every way.
  auto family = [&](auto change_fork, int fork_pages = 1) {
    std::string in = stream(same, {ok, ok, ok}, false);
    attn::fuzz::AppendImportRecord(&in, ImportOp::kChunk, header([&](auto& h) {
                                     h.set_layer_tokens(1, 5);
                                     for (int64_t k : {1, 2, 0}) h.add_shared_pages(k);
                                     change_fork(h);
                                   }));
    for (int i = 0; i < fork_pages; ++i) attn::fuzz::AppendImportRecord(&in, ImportOp::kPage, ok);
    attn::fuzz::AppendImportRecord(&in, ImportOp::kEnd, "");
    return in;
  };
  const Outcome fam = run(family(same));
  EXPECT_TRUE(fam.valid && fam.computed);
  EXPECT_TRUE(fam.violation.empty()) << fam.violation;
  const std::vector<Bad> bad_family = {
      {"shared_pages naming a page not sent", family([](auto& h) { h.set_shared_pages(1, 4); })},
      {"shared_pages negative", family([](auto& h) { h.set_shared_pages(0, -1); })},
      {"shared_pages one entry short", family([](auto& h) { h.mutable_shared_pages()->RemoveLast(); })},
      {"shared_pages of another page_span", family([](auto& h) {
         h.set_num_kv_heads(3);  // rows of 48 bytes: pages of 3 pool pages
         h.set_page_tokens(128);
         h.set_page_span(3);
         h.set_page_bytes(6144);
         h.set_layer_pages(0, 1);
         h.mutable_shared_pages()->RemoveLast();
       })},
      {"the fork's own page missing", family(same, 0)},
  };
  for (const Bad& b : bad_family) {
    const Outcome out = run(b.input);
    EXPECT_FALSE(out.valid) << b.what;
    EXPECT_TRUE(out.violation.empty()) << b.what << ": " << out.violation;
  }
}

}  // namespace
