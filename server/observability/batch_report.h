// What one finished batch did, as the backend or the step pipeline reports it for metrics.
#pragma once

#include <cstdint>

namespace attn {

struct BatchReport {
  int32_t requests = 0;
  int64_t tokens = 0;
  double compute_seconds = 0;
  double transfer_seconds = 0;
  double flops = 0;
  double bytes = 0;  // q, k, v read and o written by the kernel
  // Session steps: launches the batch took (0 for Attend), whether they were decode steps (one
  // new token each), and the K and V bytes they read from the KV cache.
  int32_t step_launches = 0;
  bool decode = false;
  double kv_bytes_read = 0;
  // Elements of 16-bit k_new/v_new that saturated to +-448 on their way into an FP8 cache.
  int64_t kv_fp8_saturations = 0;
  // Session steps: host time of the launches' parts on their lane (summed over the batch's
  // launches): planning and staging, enqueueing the copies and kernels, waiting for the device,
  // and finishing (appends committed, outputs handed on, callers told or handed to threads).
  double stage_seconds = 0, enqueue_seconds = 0, wait_seconds = 0, finish_seconds = 0;
};

}  // namespace attn
