// The session target (session_fuzzer.cc): bytes -> a program of session requests
// (CreateSession, Step, BatchStep, TruncateSession, ForkSession, CloseSession, each a serialized
// attn.v1 message) run through the server's own session manager, step validation and CPU backend,
// with every answer checked against a float64 model of the caches, and every page back on the
// free list once the program's sessions are closed.
//
// Input: records of [op: 1 byte][length: 2 bytes, little-endian][message].
// A session_id "#k" names the k-th session the program created (modulo their count).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attn/v1/attention.pb.h"
#include "backends/cpu_backend.h"
#include "backends/cpu_step_device.h"
#include "fuzz_env.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session_manager.h"
#include "sessions/step_job.h"
#include "sessions/step_pipeline.h"

namespace attn::fuzz {

enum class SessionOp : uint8_t { kCreate = 0, kStep, kBatchStep, kTruncate, kFork, kClose, kCount };

Outcome RunSessionInput(const uint8_t* data, size_t size);

// Appends one record to a program (for seeds and tests).
void AppendRecord(std::string* program, SessionOp op, const std::string& message);

// What session programs (and the region target's steps) run on: one CPU backend (one thread) with
// its step device and step pipeline, page pool and session manager per process, shared by every input; each input closes the
// sessions it made, after which every page must be free.
struct SessionEngine {
  static constexpr int64_t kPageBytes = 2048;
  static constexpr int64_t kPages = 96;
  static constexpr int64_t kMaxSessionTokens = 96;

  static SessionEngine& Get();
  // Sets job's done to fill *response (cached_tokens, and o and lse where they came back in the
  // job, as attnd answers) and *status.
  static void AnswerInto(StepJob& job, v1::StepResponse* response, absl::Status* status);
  // Runs batch (steps) through the step pipeline and waits until it is done and each of its jobs
  // is destroyed, so that what they held (pages, memory) is back before the caller goes on.
  void RunBatchAndWait(JobBatch batch);
  // Runs jobs (validated steps of one BatchKey, each on a layer of its own) as one batch, as
  // RunBatchAndWait does, holding their layers meanwhile; answers into responses[i]; their
  // statuses.
  std::vector<absl::Status> RunSteps(std::vector<std::unique_ptr<StepJob>> jobs,
                                     std::vector<v1::StepResponse*> responses);

  std::unique_ptr<CpuBackend> backend;
  std::unique_ptr<CpuStepDevice> device;    // the backend's thread pool runs its steps
  std::unique_ptr<StepPipeline> pipeline;   // over device
  std::unique_ptr<KvPagePool> pool;
  std::unique_ptr<SessionManager> manager;
};

// Head dims session programs may use (the manager's).
const std::vector<int32_t>& SessionHeadDims();

}  // namespace attn::fuzz
