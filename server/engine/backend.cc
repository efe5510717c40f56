#include "engine/backend.h"

#include <memory>

namespace attn {

absl::Status Backend::Prepare(AttendJob& job) {
  PrepareHostOutputs(job);
  return absl::OkStatus();
}

absl::Status Backend::StageWireInputs(AttendJob& job, const WireTensors& in) {
  StageWireInputsOnHost(in, &job);
  return absl::OkStatus();
}

void StageWireInputsOnHost(const WireTensors& in, AttendJob* job_ptr) {
  AttendJob& job = *job_ptr;
  const auto start = Clock::now();
  job.host_inputs = std::make_unique_for_overwrite<char[]>(in.q.size + in.k.size + in.v.size);
  char* at = job.host_inputs.get();
  for (auto [bytes, view] : {std::pair{&in.q, &job.q_bytes}, std::pair{&in.k, &job.k_bytes},
                             std::pair{&in.v, &job.v_bytes}}) {
    if (bytes->size == 0) continue;  // in a region: resolved already
    bytes->CopyTo(at);
    *view = std::string_view(at, bytes->size);
    at += bytes->size;
  }
  job.host_copy_us += Micros(Clock::now() - start);
}

void PrepareHostOutputs(AttendJob& job) {
  if (job.o_out == nullptr) {
    job.o = OutputBytes::Allocate(job.OBytes());
    job.o_out = job.o.data;
  }
  if (job.return_lse && job.lse_out == nullptr) {
    job.lse = OutputBytes::Allocate(job.LseBytes());
    job.lse_out = job.lse.data;
  }
}

}  // namespace attn
