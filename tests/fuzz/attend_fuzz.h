// The Attend target (attend_fuzzer.cc): bytes -> the wire path's reader (DecodeAttendRequest over
// pieces of the input, checked against protobuf's parser and the protobuf path's validation), and
// bytes -> attn.v1.AttendRequest -> ValidateAttendRequest with small limits -> region resolution
// (ResolveAttendTensors against FuzzRegions) -> the CPU kernel, with invariants checked on the
// output. fuzz_regression_test replays the same path.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fuzz_env.h"

namespace attn::fuzz {

// Runs data through the whole path. Never throws; a memory or UB bug shows up under the
// sanitizers, a wrong answer as a violation.
Outcome RunAttendInput(const uint8_t* data, size_t size);

}  // namespace attn::fuzz
