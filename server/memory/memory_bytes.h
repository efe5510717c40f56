// Bytes a memory pool holds, as reported to metrics.
#pragma once

#include <cstdint>

namespace attn {

struct MemoryBytes {
  int64_t used = 0;      // on loan to requests
  int64_t reserved = 0;  // taken from the system, used or cached for reuse
  int64_t limit = 0;     // the configured bound
};

}  // namespace attn
