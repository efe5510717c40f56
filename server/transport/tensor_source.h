// Where a request tensor's bytes are: in the message (Tensor.data) or in a shared-memory region
// of the caller's (Tensor.region, AttendRequest.o_region / lse_region). Every check on a region
// slice happens here, before any work: the region exists for this identity, the slice has the
// tensor's size, starts at a multiple of the tensor's element size and lies inside the region
// (without overflow).
//
// Alignment: a region starts on a page (host regions are mmap'ed memfds) or at the start of a
// CUDA allocation (256-byte aligned at least), so an offset that is a multiple of the element
// size gives an address aligned for that element: every reader (the CPU kernel, the float32
// conversions, the CUDA kernels' packed copies) may then load the elements as their type.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attn/v1/attention.pb.h"
#include "engine/attend_job.h"

namespace attn {

class RegionRegistry;

struct ResolvedBytes {
  char* data = nullptr;
  uint64_t bytes = 0;
  // The region the bytes lie in (null for bytes in the message): hold it while using them.
  std::shared_ptr<const void> hold;
  const void* region = nullptr;  // identity of that region, for overlap checks
  bool on_gpu = false;           // data is a device address (a GPU region)
  // A host region registered with the backend's device (SharedRegion::device_registered).
  bool device_registered = false;
};

// What a slice must hold: its byte size, and the size of one element (2 for float16 and
// bfloat16, 4 for float32 and lse), which its offset must be a multiple of.
struct SliceShape {
  uint64_t bytes = 0;
  uint64_t element_bytes = 1;
};

// The bytes a slice names. registry null: shared memory is off (FAILED_PRECONDITION). field is
// the slice's name in messages ("q.region", "o_region").
absl::StatusOr<ResolvedBytes> ResolveSlice(const v1::RegionSlice& slice, const std::string& field,
                                           SliceShape want, const std::string& owner,
                                           const RegionRegistry* registry);

// A tensor's bytes: t.data (already checked to be want.bytes long), or t.region resolved as
// ResolveSlice does under the name "<field>.region". The result's data is not to be written
// when it points into the message.
absl::StatusOr<ResolvedBytes> ResolveTensor(const v1::Tensor& t, const std::string& field,
                                            SliceShape want, const std::string& owner,
                                            const RegionRegistry* registry);

// Points job's q/k/v sources and o/lse destinations at the request's regions where it names
// any, and holds those regions for the job's lifetime. Call after ValidateAttendRequest and
// before the backend's Prepare.
absl::Status ResolveAttendTensors(const v1::AttendRequest& request, const std::string& owner,
                                  const RegionRegistry* registry, AttendJob* job);

// The same for a session step (q, k_new, v_new, o_region, lse_region), always: afterwards the
// job's q/k/v bytes and o/lse destinations say where the step's tensors are, in the message or
// in regions. GPU regions are all or nothing, as for Attend (q, k_new, v_new, o_region and
// lse_region when return_lse), and only where gpu_regions says the backend computes steps on
// them (else FAILED_PRECONDITION naming the field). Call after ValidateStepRequest's checks,
// before the response is sized.
absl::Status ResolveStepTensors(const v1::StepRequest& request, const std::string& owner,
                                const RegionRegistry* registry, bool gpu_regions, Job* job);

}  // namespace attn
