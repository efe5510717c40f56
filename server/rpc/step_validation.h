// Validation of session requests against their session (Step, BatchStep items) and of
// CreateSession's enum: every check happens here, before any work, with a message naming the
// field.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attn/v1/attention.pb.h"
#include "engine/attend_job.h"
#include "engine/wire_tensors.h"
#include "rpc/attend_response_encoder.h"
#include "rpc/attend_validation.h"
#include "sessions/session.h"

namespace attn {

class RegionRegistry;

// Where a step's region slices are looked up: the caller's identity and the registry (null:
// shared memory is off, and a step naming a region is refused).
struct StepRegions {
  std::string owner;
  const RegionRegistry* registry = nullptr;
  // The backend computes steps whose tensors lie in GPU regions (Backend::HasGpu); else such
  // steps are refused.
  bool gpu_regions = false;
};

// A step decoded from the wire (rpc/step_request_decoder.h): its tensors' data as pieces of the
// received message (q, k_new, v_new in WireTensors' q, k, v), and the call's buffers its outputs
// are written into and sent from (rpc/attend_response_encoder.h).
struct WireStepData {
  const WireTensors* in = nullptr;
  OutputBytes* o = nullptr;
  OutputBytes* lse = nullptr;
};

// Checks request against session (layer range, tensors, dtype and shapes matching the
// session, heads a multiple of its KV heads, scale, window, regions, response size) and makes
// its job: key, sizes, where its tensors are (message, host or GPU regions), the StepWork (sharing
// session), and the response sized for the output. INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
// NOT_FOUND (a region) or FAILED_PRECONDITION (shared memory off) name the bad field.
// wire set: request's data fields are empty and the data is wire.in's; once validated it is
// copied (once) into the job's host_inputs, and outputs not bound for a region go into buffers
// allocated in wire.o and wire.lse instead of the response.
absl::StatusOr<std::unique_ptr<AttendJob>> ValidateStepRequest(
    const v1::StepRequest& request, std::shared_ptr<Session> session, const RequestLimits& limits,
    const StepRegions& regions, v1::StepResponse* response, const WireStepData& wire = {});

// The 16-bit cache dtype CreateSession asks for, or INVALID_ARGUMENT naming `dtype`.
absl::StatusOr<kernels::DType> SessionDType(v1::DType dtype);

}  // namespace attn
