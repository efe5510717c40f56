// Small helpers shared by the service's handlers: deadlines on the steady clock and the
// ServerTiming of a finished job.
#pragma once

#include <chrono>

#include <grpcpp/server_context.h>

#include "attn/v1/attention.pb.h"
#include "engine/job.h"

namespace attn {

// The call's deadline on the steady clock (max when it has none).
inline Clock::time_point SteadyDeadline(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  if (left > std::chrono::hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(left);
}

inline void FillTiming(const Job& job, Clock::time_point arrival, v1::ServerTiming* t) {
  t->set_queue_us(job.queue_us);
  t->set_transfer_us(job.transfer_us);
  t->set_compute_us(job.compute_us);
  t->set_host_copy_us(job.host_copy_us);
  t->set_batch_requests(job.batch_requests);
  t->set_batch_tokens(job.batch_tokens);
  t->set_total_us(Micros(Clock::now() - arrival));
}

}  // namespace attn
