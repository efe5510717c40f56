// Everything attnd can be told at start-up; main.cc fills it from flags.
#pragma once

#include <cstdint>
#include <string>

namespace attn {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";
  std::string metrics_listen = "0.0.0.0:9464";  // empty: no /metrics endpoint
  std::string backend = "auto";                  // auto | cpu | cuda
  int threads = 0;                               // CPU backend workers; 0: one per core
  int64_t max_message_bytes = 256ll << 20;
  int64_t max_batch_tokens = 16384;
  int64_t max_queue_delay_us = 500;
  int64_t max_queue_size = 1024;
  int64_t max_tensor_elements = int64_t{1} << 28;
  int streams = 2;                               // CUDA streams
  int64_t device_pool_bytes = 8ll << 30;         // CUDA backend transient tensors
  int64_t pinned_pool_bytes = 2ll << 30;         // CUDA backend staging
  double drain_timeout_s = 30;
};

}  // namespace attn
