// libFuzzer target: arbitrary bytes as an attn.v1.AttendRequest through decoding, validation
// and the CPU kernel (attend_fuzz.h), or as a program of session requests through the session
// manager and the CPU backend (session_fuzz.h). Build and run with scripts/fuzz.sh.
#include <cstdio>
#include <cstdlib>

#include "session_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const attn::fuzz::Outcome out = attn::fuzz::RunInput(data, size);
  if (!out.violation.empty()) {
    std::fprintf(stderr, "attend_fuzzer: invariant violated: %s\n", out.violation.c_str());
    std::abort();
  }
  return 0;
}
