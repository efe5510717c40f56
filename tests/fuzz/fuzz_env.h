// What the fuzz targets share (tests/fuzz/*_fuzzer.cc): the outcome of one input, the
// shared-memory regions inputs may name, the invariants every resolved request must meet, and
// one Attend computed by the CPU kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/attend_job.h"
#include "engine/job.h"
#include "transport/region_registry.h"

namespace attn::fuzz {

// Limits that keep one run in the millisecond range.
constexpr int64_t kMaxTensorElements = int64_t{1} << 16;
constexpr int64_t kMaxTokens = 256;  // per tensor (q.shape[0], k.shape[0])

struct Outcome {
  bool parsed = false;     // the bytes made a request (or program)
  bool valid = false;      // it was accepted (and small enough to run)
  bool computed = false;   // the CPU kernel ran it
  bool on_gpu = false;     // accepted with its tensors in GPU regions (resolution only: no GPU)
  std::string violation;   // non-empty: an invariant broke (a bug); says which
};

// The fuzzed client's shared-memory regions, registered to identity "fuzz" in a registry of
// their own. Inputs may name them, or any other name, in every region field:
//   "r0"  host, 64 KiB;
//   "r1"  host, 4099 bytes (an end that no element size divides);
//   "g0"  GPU, 64 KiB, faked: host memory that only region resolution sees, as a device
//         backend's registry would hand it out (the CPU backend registers no GPU region).
// One per process (libFuzzer calls a plain function); the contents are refilled per input.
class FuzzRegions {
 public:
  static constexpr uint64_t kR0Bytes = 64 << 10;
  static constexpr uint64_t kR1Bytes = 4099;
  static constexpr uint64_t kG0Bytes = 64 << 10;
  static constexpr char kOwner[] = "fuzz";

  static FuzzRegions& Get();

  const RegionRegistry& registry() const { return registry_; }
  // Refills every region with finite values of every dtype (16-bit halves whose exponent is never
  // all ones), a pattern of seed's, so that a run never depends on the ones before it.
  void Fill(uint32_t seed);
  // "" when every tensor of job (q, k, v read; o, lse written when not in the response) starts at
  // a multiple of its element size and, where it lies in a region, lies inside it; else which
  // does not. o and lse in the response are not checked (they are sized later).
  std::string CheckResolved(const Job& job) const;

 private:
  FuzzRegions();
  std::unique_ptr<char[], void (*)(void*)> gpu_memory_;  // before registry_, which hands it out
  RegionRegistry registry_;
  struct Span {
    char* data;
    uint64_t bytes;
  };
  Span r0_{}, r1_{}, g0_{};
};

// Sizes job's response (PrepareAttendResponse) and computes it with the CPU kernel on this thread,
// checking that a validated job is one the kernel takes; outputs not bound for a region end up in
// the response's data, as attnd answers (and job.o_out / lse_out stay null for them). "" or the
// violation.
std::string ComputeAttendOnCpu(AttendJob& job, const v1::AttendRequest& request,
                               v1::AttendResponse* response);

// The input as the slices a message may arrive in, cut where the input says: after each byte whose
// low 3 bits are 0b101, and at 1/3 and 2/3 of it (views of data).
std::vector<std::string_view> PiecesOf(const uint8_t* data, size_t size);

}  // namespace attn::fuzz
