// `--help` for attnd's programs. Abseil lists only the flags of a file named after the program
// (by argv[0]); a program whose source file is named otherwise, or a binary that is renamed or
// run through a link, would list none. This lists the flags of the program's own main file.
#pragma once

#include <string>

#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace attn::util {

// main_file: the main source file, as the build names it relative to the source root
// (e.g. "server/attnd_main.cc"); version: what --version prints.
inline void SetUsageConfigForMain(const std::string& main_file, const std::string& version) {
  auto is_main = [main_file](absl::string_view f) {
    return f == main_file || absl::EndsWith(f, "/" + main_file);
  };
  absl::FlagsUsageConfig config;
  config.contains_help_flags = is_main;
  config.contains_helpshort_flags = is_main;
  // Flags are listed under main_file, not the build machine's absolute path; other files as
  // Abseil's default does (leading slashes dropped).
  config.normalize_filename = [is_main, main_file](absl::string_view f) {
    if (is_main(f)) return main_file;
    const size_t start = f.find_first_not_of('/');
    return std::string(start == absl::string_view::npos ? f : f.substr(start));
  };
  config.version_string = [version] { return version + "\n"; };
  absl::SetFlagsUsageConfig(config);
}

}  // namespace attn::util
