// The code path shared by the libFuzzer target (attend_fuzzer.cc) and the regression test
// (fuzz_regression_test.cc): bytes -> the wire path's reader (DecodeAttendRequest over pieces of
// the input, checked against protobuf's parser and the protobuf path's validation), and bytes ->
// attn.v1.AttendRequest -> ValidateAttendRequest with small limits -> region resolution
// (ResolveAttendTensors, one registered region "r0") -> the CPU kernel, with invariants checked
// on the output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace attn::fuzz {

// Limits that keep one run in the millisecond range.
constexpr int64_t kMaxTensorElements = int64_t{1} << 16;
constexpr int64_t kMaxTokens = 256;  // per tensor (q.shape[0], k.shape[0])
// Size of the one shared-memory region, "r0", that inputs may name in Tensor.region,
// o_region and lse_region.
constexpr uint64_t kRegionBytes = 64 << 10;

struct Outcome {
  bool parsed = false;     // the bytes were an AttendRequest
  bool valid = false;      // ValidateAttendRequest accepted it (and it was small enough)
  bool computed = false;   // the CPU kernel ran
  std::string violation;   // non-empty: an invariant broke (a bug); says which
};

// Runs data through the whole path. Never throws; a memory or UB bug shows up under the
// sanitizers, a wrong answer as a violation.
Outcome RunAttendInput(const uint8_t* data, size_t size);

}  // namespace attn::fuzz
