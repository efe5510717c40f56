// `attnctl session demo`: one session through its whole life (create, chunked prefill, decode,
// truncate, fork, close), each step optionally checked against a float64 reference computed here
// over the cache the client mirrors.
#pragma once

#include <chrono>
#include <cstdint>

#include "attn/client/session.h"

namespace attn::client {

// The FP8 cache's scale of every KV head in the demo (its random inputs lie in [-1, 1]).
inline constexpr float kFp8DemoScale = 2.0f / 448.0f;

struct SessionDemoOptions {
  int layers = 2;
  int heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  DType dtype = DType::kBFloat16;
  // An FP8 (E4M3) cache with the scale kFp8DemoScale per KV head: the server quantizes each step's
  // k_new/v_new, and the check's reference reads the cache as quantized.
  bool kv_fp8 = false;
  int prefill = 100;   // tokens of the prefill, per layer
  int chunk = 0;       // prefill chunk (tokens per step); 0: the whole prefill in one step
  int decode = 20;     // decode tokens (one step per layer each)
  int truncate = 4;    // tokens dropped after the decode
  int fork_decode = 2; // decode tokens on the parent and on the fork each, after the fork
  bool lse = false;
  bool check = false;
  int window_left = -1;  // sliding window, keys to the left (-1: none)
  uint64_t seed = 1;
  std::chrono::milliseconds timeout{60000};
};

// Exit status: 0 done (and, with check, every step within tolerance), 2 a call failed, 3 a step's
// answer is off (or the server did not behave as the contract says).
int RunSessionDemo(SessionClient& sessions, const SessionDemoOptions& options);

}  // namespace attn::client
