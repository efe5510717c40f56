#include "engine/backend.h"

#include <memory>

namespace attn {

absl::Status Backend::StageWireInputs(AttendJob& job, const WireTensors& in) {
  StageWireInputsOnHost(in, &job);
  return absl::OkStatus();
}

void StageWireInputsOnHost(const WireTensors& in, AttendJob* job_ptr, bool view_whole) {
  AttendJob& job = *job_ptr;
  const auto start = Clock::now();
  const std::pair<const WireBytes*, std::string_view*> tensors[] = {
      {&in.q, &job.q_bytes}, {&in.k, &job.k_bytes}, {&in.v, &job.v_bytes}};
  // A tensor in a region has no pieces (resolved already); one in a single piece may be viewed.
  auto viewed = [view_whole](const WireBytes& b) { return view_whole && b.pieces.size() == 1; };
  size_t copied = 0;
  for (const auto& [bytes, view] : tensors) {
    if (bytes->size > 0 && !viewed(*bytes)) copied += bytes->size;
  }
  if (copied > 0) job.host_inputs = std::make_unique_for_overwrite<char[]>(copied);
  char* at = job.host_inputs.get();
  for (const auto& [bytes, view] : tensors) {
    if (bytes->size == 0) continue;
    if (viewed(*bytes)) {
      *view = bytes->pieces.front();
      continue;
    }
    bytes->CopyTo(at);
    *view = std::string_view(at, bytes->size);
    at += bytes->size;
  }
  job.host_copy_us += Micros(Clock::now() - start);
}

}  // namespace attn
