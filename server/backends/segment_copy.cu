#include "backends/segment_copy.h"

#include <algorithm>
#include <cstdint>

namespace attn {
namespace {

template <typename Word>
__device__ void CopyRows(const CopySegment& s) {
  const int64_t words = s.row_bytes / int64_t{sizeof(Word)};
  for (int32_t r = 0; r < s.rows; ++r) {
    const Word* from = reinterpret_cast<const Word*>(s.src + r * s.src_pitch);
    Word* to = reinterpret_cast<Word*>(s.dst + r * s.dst_pitch);
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
  }
}

// Segments over blocks (grid-stride), a segment's words over the block's threads, in the widest
// word that every address, the row length and the pitches are multiples of.
__global__ void SegmentCopiesKernel(const CopySegment* segments, int32_t n) {
  for (int32_t i = blockIdx.x; i < n; i += gridDim.x) {
    const CopySegment s = segments[i];
    uint64_t bits = reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) |
                    uint64_t(s.row_bytes);
    if (s.rows > 1) bits |= uint64_t(s.src_pitch) | uint64_t(s.dst_pitch);
    if ((bits & 15) == 0) {
      CopyRows<uint4>(s);
    } else if ((bits & 3) == 0) {
      CopyRows<uint32_t>(s);
    } else {
      CopyRows<uint8_t>(s);
    }
  }
}

}  // namespace

cudaError_t LaunchSegmentCopies(const CopySegment* segments, int32_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int32_t>(n, 1024));
  SegmentCopiesKernel<<<blocks, 256, 0, stream>>>(segments, n);
  return cudaGetLastError();
}

}  // namespace attn
