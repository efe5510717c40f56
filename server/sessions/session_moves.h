// The statuses of a session that is moving, or has moved, to another replica (hand-off on drain,
// see ImportSession in attention.proto). Their texts are part of the wire contract: clients find
// the marker in the message (a BatchStep item carries no metadata of its own).
#pragma once

#include <string>

#include "absl/status/status.h"

namespace attn {

// Trailing metadata key, and the marker in the message, of a moved session: its value is
// "<address>;<new session id>".
inline constexpr char kMovedToKey[] = "attnd-moved-to";
// The marker in the message of a call refused while its session is being moved.
inline constexpr char kMovingMarker[] = "attnd-session-moving";

// UNAVAILABLE: nothing was applied; the call may be sent again shortly (to the same replica,
// which then answers with the session's new place, or with the session itself).
absl::Status SessionMovingError(const std::string& id);
// FAILED_PRECONDITION naming the new place: "... attnd-moved-to: <address>;<new id>". An empty
// address is the replica that answers (one that imported the session, asked by its old id).
absl::Status SessionMovedError(const std::string& id, const std::string& address,
                               const std::string& new_id);
// "<address>;<new id>" of a SessionMovedError's message, or "" for any other status.
std::string MovedToOf(const absl::Status& status);

}  // namespace attn
