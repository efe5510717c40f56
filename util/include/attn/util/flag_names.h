// Command-line flags may be written with dashes or underscores: --max-batch-tokens=8 is read as
// --max_batch_tokens=8 (absl flag names are identifiers).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace attn::util {

// argv with every "--flag-name" spelled "--flag_name"; values and positional args untouched.
inline std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
  }
  return args;
}

// Pointers into args, for absl::ParseCommandLine; args must outlive them.
inline std::vector<char*> ArgvOf(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return argv;
}

}  // namespace attn::util
