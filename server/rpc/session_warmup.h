// Runs a decode step and a chunked-prefill step of a throwaway session through the backend at
// start-up, so that the first caller's steps do not pay for loading the paged kernels.
#pragma once

#include "absl/status/status.h"
#include "engine/backend.h"
#include "sessions/session_manager.h"

namespace attn {

absl::Status WarmUpSessionSteps(Backend& backend, SessionManager& sessions);

}  // namespace attn
