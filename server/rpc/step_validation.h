// Validation of session requests against their session (Step, BatchStep items) and of
// CreateSession's enum: every check happens here, before any work, with a message naming the
// field.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attn/v1/attention.pb.h"
#include "engine/wire_tensors.h"
#include "rpc/attend_validation.h"
#include "sessions/session.h"
#include "sessions/session_manager.h"
#include "sessions/step_job.h"

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

// Checks request against session (layer range, tensors, dtype and shapes matching the
// session, heads a multiple of its KV heads, scale, window, regions, response size) and makes
// its job: key, sizes, where its tensors are (the received message, the request's data fields,
// host or GPU regions) and the session it appends to. wire set: the request's data fields are
// empty and the data of q, k_new and v_new is in *wire (pieces of the received message), which is
// moved into the job (whose input_hold the caller sets to what keeps those pieces). Outputs not
// bound for a region come back in the job's o and lse. INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
// NOT_FOUND (a region) or FAILED_PRECONDITION (shared memory off) name the bad field.
absl::StatusOr<std::unique_ptr<StepJob>> ValidateStepRequest(const v1::StepRequest& request,
                                                             std::shared_ptr<Session> session,
                                                             const RequestLimits& limits,
                                                             const StepRegions& regions,
                                                             WireTensors* wire = nullptr);

// DescribeOutputs (attend_validation.h): the response's o (and lse) tensors without their data.
void PrepareStepResponse(const StepJob& job, const v1::StepRequest& request,
                         v1::StepResponse* response);

// The cache element type and KV scales CreateSession asks for, into p: INVALID_ARGUMENT naming
// cache_dtype, k_scales or v_scales for a bad one (SessionManager checks the scales' count and
// values against num_kv_heads), FAILED_PRECONDITION for an FP8 cache the backend lacks.
absl::Status SessionCacheParams(const v1::CreateSessionRequest& request, const Fp8Features& fp8,
                                SessionManager::CreateParams* p);

// The 16-bit cache dtype CreateSession asks for, or INVALID_ARGUMENT naming `dtype`.
absl::StatusOr<kernels::DType> SessionDType(v1::DType dtype);

}  // namespace attn
