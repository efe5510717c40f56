// attn-bench --mode decode: KV-cache sessions driven through Step or BatchStep, and Echo of the
// same bytes at the same concurrency (see attn_bench.cc's header for the table it prints).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/client/client.h"

namespace attn::client {

// The FP8 cache's scale of every KV head in the decode benchmark: the random inputs lie in
// [-1, 1], so 4/448 leaves headroom and no element saturates.
inline constexpr float kFp8BenchScale = 4.0f / 448.0f;

struct DecodeBenchOptions {
  std::string target;
  std::vector<int> sessions;  // levels to sweep: concurrent sessions
  int layers = 1;
  int heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  DType dtype = DType::kBFloat16;
  // Sessions with an FP8 (E4M3) cache, scales kFp8BenchScale per KV head; steps still send k_new
  // and v_new in dtype (the server quantizes them).
  bool kv_fp8 = false;
  int64_t cache_tokens = 4096;  // prefilled before the measured run, not timed
  int prefill_chunk = 1024;
  // 0: every session has its own caller sending Step; N > 0: callers send BatchStep with one step
  // of each of up to N sessions (the sessions of one caller are on one replica).
  int batch_step = 0;
  // Decode tokens a session may add before the caller truncates them again (not timed), so that
  // the cache stays within [cache_tokens, cache_tokens + window] however long the run.
  int decode_window = 64;
  bool lse = false;
  double duration_s = 10;
  double warmup_s = 2;
  int64_t max_calls = 0;  // stop a level after this many measured calls (0: none)
  int channels = 0;       // connections shared by the callers (0: one per caller)
  // How the decode calls are coded, one decode row each, in this order, on the same sessions:
  // "stub" (request messages built once, sent through the generated stub), "wire" and "protobuf"
  // (the client library's Step/BatchStep with ClientOptions::wire_coding on and off: requests
  // coded from the caller's tensors on every call, results read into StepResults), "shm" and
  // "gpu" (every tensor in a same-host region of the caller's, a host memfd or GPU memory, and
  // the requests naming their slices; attnd needs --allow_shared_memory, gpu its CUDA backend).
  // Region codings get an Echo row of their own: calls of the same (tensor-free) size.
  std::vector<std::string> codings = {"stub"};
  std::string csv, json, label;
};

// Runs every level and prints the table; 0 when every call succeeded, 1 otherwise (also when
// sessions cannot be created or filled: the server's status is printed).
int RunDecodeBench(const DecodeBenchOptions& options);

}  // namespace attn::client
