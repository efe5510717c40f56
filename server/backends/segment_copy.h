// Many small copies between device addresses in one kernel: a launch whose members' tensors lie
// in GPU regions gathers them into its packed inputs (and scatters its outputs back) with one
// launch, where a cudaMemcpyAsync per tensor costs a few microseconds of host time each and a
// copy's start-up on the device each (a BatchStep of 32 such steps made ~160 of them).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attn {

// `rows` rows of row_bytes each, from src (rows src_pitch bytes apart) to dst (dst_pitch apart).
// Addresses the device can read and write (device memory, or GPU regions mapped into this
// process); any alignment (16-byte words where src, dst, row_bytes and the pitches allow).
struct CopySegment {
  const char* src = nullptr;
  char* dst = nullptr;
  int64_t row_bytes = 0;
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
  int32_t rows = 1;
};

// Does segments[0, n) (the array itself in device memory) on stream; the segments' destinations
// must not overlap each other or any source.
cudaError_t LaunchSegmentCopies(const CopySegment* segments, int32_t n, cudaStream_t stream);

}  // namespace attn
