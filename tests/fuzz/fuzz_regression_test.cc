// Replays every input under tests/fuzz/regressions/ (inputs that once crashed or broke an
// invariant in attend_fuzzer) and the seed corpus tests/fuzz/corpus/ through the fuzzer's code
// path, in the normal build.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "attend_fuzz.h"

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
    const auto out = attn::fuzz::RunAttendInput(reinterpret_cast<const uint8_t*>(bytes.data()),
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
    const auto out = attn::fuzz::RunAttendInput(reinterpret_cast<const uint8_t*>(bytes.data()),
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
        attn::fuzz::RunAttendInput(reinterpret_cast<const uint8_t*>(g.data()), g.size());
    EXPECT_FALSE(out.computed);
    EXPECT_TRUE(out.violation.empty()) << out.violation;
  }
}

}  // namespace
