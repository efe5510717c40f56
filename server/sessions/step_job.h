// One step of a KV-cache session on its way through the server: append k_new/v_new to one layer
// of one session's cache and attend q over the whole of it (causal inside the new tokens). A Job
// whose q, k and v are the step's q, k_new and v_new, whose total_q counts the tokens it appends.
//
// Ownership: the session is shared with the SessionManager. `append` is set by the step
// pipeline between planning and finishing the launch and owns the pages it took. The received
// message's slices that `wire` points into are held by `input_hold` until the job is gone.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "engine/job.h"
#include "engine/wire_tensors.h"
#include "sessions/session.h"

namespace attn {

struct StepJob : Job {
  StepJob() : Job(JobKind::kStep) {}

  std::shared_ptr<Session> session;
  int32_t layer = 0;
  // Tensors still in the received message: pieces of its slices (q, k_new, v_new as q, k, v;
  // none for a tensor in a region or in q_bytes..), copied straight into the launch's staging.
  WireTensors wire;
  std::shared_ptr<const void> input_hold;
  // Set by the step pipeline while the job is in a launch.
  std::optional<PendingAppend> append;
  // Tokens the layer holds after the step, once it succeeded.
  int64_t cached_tokens = 0;

  // Bytes of q, k_new, v_new wherever they are.
  uint64_t QBytes() const { return wire.q.size > 0 ? wire.q.size : q_bytes.size(); }
  uint64_t KvBytes() const { return wire.k.size > 0 ? wire.k.size : k_bytes.size(); }
};

}  // namespace attn
