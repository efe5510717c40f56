// Runs a decode step and a chunked-prefill step of a throwaway session through the step pipeline
// at start-up, so that the first caller's steps do not pay for loading the paged kernels.
#pragma once

#include "absl/status/status.h"
#include "engine/batch_runner.h"
#include "sessions/session_manager.h"

namespace attn {

absl::Status WarmUpSessionSteps(BatchRunner& steps, SessionManager& sessions);

}  // namespace attn
