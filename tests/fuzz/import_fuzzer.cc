// libFuzzer target: see import_fuzz.h. Built and run by scripts/fuzz.sh; an input that breaks an
// invariant aborts (libFuzzer keeps it as a crash).
#include <cstdio>
#include <cstdlib>

#include "import_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const attn::fuzz::Outcome out = attn::fuzz::RunImportInput(data, size);
  if (!out.violation.empty()) {
    std::fprintf(stderr, "import_fuzzer: invariant violated: %s\n", out.violation.c_str());
    std::abort();
  }
  return 0;
}
