// Replays every input under tests/fuzz/regressions/ (inputs that once crashed or broke an
// invariant in attend_fuzzer) and the seed corpus tests/fuzz/corpus/ through the fuzzer's code
// path, in the normal build.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "attn/v1/attention.pb.h"
#include "session_fuzz.h"

namespace {

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

TEST(FuzzRegression, EveryRegressionInputPasses) {
  const auto files = FilesUnder(ATTN_FUZZ_DIR "/regressions");
  for (const auto& f : files) {
    const std::string bytes = Read(f);
    const auto out = attn::fuzz::RunInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                                bytes.size());
    EXPECT_TRUE(out.violation.empty()) << f.filename() << ": " << out.violation;
  }
  std::cout << files.size() << " regression inputs replayed\n";
}

TEST(FuzzRegression, EverySeedIsValidAndComputed) {
  const auto files = FilesUnder(ATTN_FUZZ_DIR "/corpus");
  ASSERT_FALSE(files.empty());
  for (const auto& f : files) {
    const std::string bytes = Read(f);
    const auto out = attn::fuzz::RunInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                                bytes.size());
    EXPECT_TRUE(out.computed) << f.filename() << " is not a valid, computed request";
    EXPECT_TRUE(out.violation.empty()) << f.filename() << ": " << out.violation;
  }
}

TEST(FuzzRegression, GarbageIsRejectedQuietly) {
  const std::string garbage[] = {"", "\x0a", "\x0a\xff\xff\xff\xff\x0f", std::string(64, '\xff'),
                                 "\x0a\x02\x08\x01\x12\x00"};
  for (const std::string& g : garbage) {
    const auto out =
        attn::fuzz::RunInput(reinterpret_cast<const uint8_t*>(g.data()), g.size());
    EXPECT_FALSE(out.computed);
    EXPECT_TRUE(out.violation.empty()) << out.violation;
  }
}

// A session program built here: every op, the answers checked by the fuzz path's own model.
TEST(FuzzRegression, SessionProgramRunsCleanAndLeavesEveryPageFree) {
  using attn::fuzz::SessionOp;
  std::string p = attn::fuzz::kSessionMagic;
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
  const auto out = attn::fuzz::RunInput(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  EXPECT_TRUE(out.computed);
  EXPECT_TRUE(out.violation.empty()) << out.violation;
  // The same program with a truncate past the start and a step of another dtype: refused, and
  // still clean.
  truncate.set_tokens(1000);
  attn::fuzz::AppendRecord(&p, SessionOp::kTruncate, truncate.SerializeAsString());
  attn::v1::StepRequest wrong = step(0, 1, 7);
  wrong.mutable_q()->set_dtype(attn::v1::DTYPE_BFLOAT16);
  attn::fuzz::AppendRecord(&p, SessionOp::kStep, wrong.SerializeAsString());
  const auto out2 = attn::fuzz::RunInput(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  EXPECT_TRUE(out2.violation.empty()) << out2.violation;
}

}  // namespace
