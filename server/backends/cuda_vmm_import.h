// GPU memory another process allocated with the CUDA virtual memory API (cuMemCreate, POSIX file
// descriptor handle type), mapped into this process for shared-memory regions.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/backend.h"

namespace attn {

// Imports the allocation behind fd (borrowed; the caller closes it: the mapping keeps the
// memory) and maps its first `bytes`, rounded up to the allocation granularity, readable and
// writable by `device`, which must be the allocation's device. INVALID_ARGUMENT, naming the
// field, when fd is not such an allocation, lies on another device, or is smaller than bytes.
// The driver is reached through the runtime's entry points, so that attnd does not link libcuda.
absl::StatusOr<GpuImport> ImportVmmAllocation(int fd, int device, uint64_t bytes);

}  // namespace attn
