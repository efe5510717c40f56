// libFuzzer target: arbitrary bytes as an attn.v1.AttendRequest through decoding, validation
// and the CPU kernel (see attend_fuzz.h). Build and run with scripts/fuzz.sh.
#include <cstdio>
#include <cstdlib>

#include "attend_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const attn::fuzz::Outcome out = attn::fuzz::RunAttendInput(data, size);
  if (!out.violation.empty()) {
    std::fprintf(stderr, "attend_fuzzer: invariant violated: %s\n", out.violation.c_str());
    std::abort();
  }
  return 0;
}
