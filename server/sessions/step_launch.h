// One launch of session steps as the step pipeline plans it (sessions/step_pipeline.h): its
// members (each with its append begun), how each moves its tensors, and where every part lies in
// the launch's staging. The host arrays of the launch (sequence offsets, the CSR page table,
// the rows to copy and append) are written straight into the input staging, which the device
// copies as it is; the kernel arguments point into it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "attn/kernels/attention.h"
#include "engine/job.h"
#include "engine/output_bytes.h"
#include "sessions/step_job.h"

namespace attn {

// How one member of a launch moves its tensors: straight between the device and where they lie
// (true: a GPU region, or a host region registered with the device), or through the launch's
// staging (false).
struct StepRoute {
  bool q = false, k = false, v = false, o = false, lse = false;
  bool device = false;  // the direct ones are device addresses (GPU regions)
  bool AnyInput() const { return q || k || v; }
  bool AnyOutput() const { return o || lse; }
};

// Offsets of each part in the input staging (and in its copy on the device, which has the same
// layout) and in the output staging. A launch in place has no room for tensors (sizes 0).
struct StepLayout {
  size_t q = 0, k = 0, v = 0;                             // packed q, k_new, v_new
  size_t tables = 0;                                      // where the arrays below begin
  size_t cu_q = 0, indptr = 0, indices = 0, seqlens = 0;  // int32 arrays
  size_t copy_src = 0, copy_dst = 0, append = 0;          // int64 rows of the KV region
  size_t k_scales = 0, v_scales = 0;  // FP8 cache: float [members, num_kv_heads] each
  size_t saturations = 0;             // FP8 cache: an int64 the device may count into
  size_t in_bytes = 0;
  size_t o = 0, lse = 0, out_bytes = 0;
};

struct StepLaunch {
  BatchKey key;
  std::vector<StepJob*> members;
  std::vector<StepRoute> routes;  // per member
  bool in_place = false;          // the device runs it over the member's regions, no copies
  bool any_lse = false;
  bool staged_out = false;        // some output comes back through `out`
  // The device may poll (spin) for the launch's end: no other lane is at work, so a lone
  // caller's latency is all that counts. Else it sleeps in the driver and leaves the core to the
  // transport, whose CPU is what many callers' steps are bound by.
  bool poll_wait = false;
  int32_t total_q = 0, max_q = 0, max_k = 0;
  int64_t page_entries = 0;  // entries of the CSR page table
  int64_t copy_rows = 0;     // copy-on-write rows
  int32_t num_pages = 0;     // pages of the KV region in the members' page size
  int64_t row_bytes = 0;     // bytes of one token's keys (or values)
  double kv_bytes_read = 0;  // K and V bytes the kernel reads from the KV region
  StepLayout layout;
  char* in = nullptr;  // input staging (host), layout.in_bytes
  OutputBytes out;     // output staging (host), layout.out_bytes; empty unless staged_out

  template <typename T>
  T* At(size_t offset) const { return reinterpret_cast<T*>(in + offset); }
  // An FP8 cache whose new rows come in 16 bits (staged as sent): the device quantizes them into
  // the cache with each member's scales, E4M3(x / scale) saturating (sessions/fp8_quantize.h).
  bool Fp8Quantizes() const { return key.fp8_cache && !key.fp8_kv; }
  const int32_t* cu_seqlens_q() const { return At<int32_t>(layout.cu_q); }
  // Where member m's o begins in the launch's output ([total_q, num_heads, head_dim]).
  size_t OAt(size_t m) const {
    const size_t row = size_t(key.num_heads) * key.head_dim * kernels::DTypeSize(key.wire_dtype);
    return layout.o + size_t(cu_seqlens_q()[m]) * row;
  }
  // The kernel arguments with the host arrays in `in`; q, k, v, o and lse are unset (the
  // device puts its own addresses in, and those of the arrays' device copy).
  kernels::AttentionArgs HostArgs() const;
};

}  // namespace attn
