// One paged launch over a batch of session steps, as the host plans it: each step's append
// begun (pages taken, copy-on-write planned), the CSR page table of the launch and where the
// new rows go. The backend then copies rows, appends the new keys and values, runs the kernel
// with StepLaunchArgs, and ends the launch: every append is committed when the launch
// succeeded and given back otherwise, so a failed step leaves its session's cache as it was.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "attn/kernels/attention.h"
#include "engine/attend_job.h"
#include "sessions/session.h"

namespace attn {

struct StepLaunch {
  std::vector<size_t> members;          // indices into the batch of the jobs in the launch
  std::vector<int32_t> cu_seqlens_q;    // [members + 1]
  std::vector<int32_t> page_indptr;     // [members + 1]
  std::vector<int32_t> page_indices;
  std::vector<int32_t> seqlens_k;       // [members], keys after the append
  std::vector<RowCopy> copies;          // copy-on-write, pool row to pool row, before appends
  std::vector<int64_t> append_rows;     // pool row of each new token, in launch order
  int32_t total_q = 0;
  int32_t max_q = 0;
  int32_t max_k = 0;
  double kv_bytes_read = 0;             // K and V bytes the kernel reads from the pool
};

// Begins the append of every job of the batch (BeginAppend); a job that cannot begin gets its
// error in status[i] and is left out of the launch.
StepLaunch BeginStepLaunch(std::span<std::unique_ptr<AttendJob>> jobs,
                           std::span<absl::Status> status);

// Commits each member's append when launch is OK, else gives its pages back and sets
// status[i] = launch. Sets each member's cached_tokens.
void EndStepLaunch(std::span<std::unique_ptr<AttendJob>> jobs, const StepLaunch& launch,
                   std::span<absl::Status> status, const absl::Status& launch_status);

// The kernel arguments of the launch, with the CSR arrays pointing into `launch` (host memory);
// q, k, v, o, lse and, for device launches, the array pointers are for the backend to set.
kernels::AttentionArgs StepLaunchArgs(const BatchKey& key, const StepLaunch& launch,
                                      int32_t num_pages);

// Sizes the response's o (and lse) for the step so that a backend can write into them, or
// names the output regions there.
void PrepareStepResponse(const AttendJob& job);
// Where a step's o and lse are written: its output regions, else its response's data.
char* StepOutput(AttendJob& job);
float* StepLse(AttendJob& job);

}  // namespace attn
