// Everything attnd can be told at start-up; attnd_main.cc fills it from flags.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace attn {

struct ServerOptions {
  std::string listen = "0.0.0.0:50051";
  std::string metrics_listen = "0.0.0.0:9464";  // empty: no /metrics endpoint
  std::string backend = "auto";                  // auto | cpu | cuda
  int threads = 0;                               // CPU backend workers; 0: one per core
  int64_t max_message_bytes = 256ll << 20;
  int64_t max_batch_tokens = 16384;
  int64_t max_queue_delay_us = 500;  // an Attend's wait for company while the backend is busy
  bool gather_when_idle = false;     // ... and while it is idle too
  int64_t max_queue_size = 1024;
  int64_t max_tensor_elements = int64_t{1} << 28;
  int64_t max_inflight_bytes = int64_t{4} << 30;  // tensor bytes of queued + running requests
  int streams = 2;                               // CUDA streams of Attend
  int step_lanes = 4;  // CUDA streams (and staging) of session steps; 0: as many as streams
  int64_t batch_step_chunk = 32;  // a BatchStep's steps submitted in chunks of this many; 0: at once
  int64_t step_idle_poll_us = 200;  // a GPU step lane's look for the next launch before it sleeps
  // GPU step lanes poll (for their next launch, and for the device) even while other lanes are
  // at work; false: only a lane alone at work does, so that many callers' steps leave the cores
  // to the transport (64 callers' Steps 3-5% faster on an H100 host, the rest unchanged:
  // docs/PERF.md, 2026-12-06).
  bool step_poll_when_busy = false;
  // A 16-bit decode step's new rows written into their pages by the decode kernel itself (one
  // device operation fewer per launch); false: by a copy kernel before it.
  bool step_append_in_kernel = true;
  // A small decode step launch's o and lse (up to 64 KiB) written by the decode kernel straight
  // into the pinned host memory they are answered from; false: copied there after the kernel.
  bool step_output_to_host = true;
  // A decode step launch with KV splits merges them in its split kernel (the last CTA of each
  // sequence's KV head, on counters the step lane keeps zeroed) instead of a combine kernel
  // launched after it: one launch fewer, ~9 us less enqueue a lone step (docs/PERF.md,
  // 2026-12-07 eighth session); false: the combine kernel.
  bool step_fused_combine = true;
  int64_t device_pool_bytes = 8ll << 30;         // CUDA backend transient tensors
  int64_t pinned_pool_bytes = 2ll << 30;         // CUDA backend staging
  // CUDA backend, FP8 attention of more than 16 queries per sequence (all-FP8 Attend, and steps
  // of FP8-cache sessions): "convert" (widened to 16 bits, then the 16-bit kernel),
  // "tensor_cores" (the FP8 wgmma kernel, where it serves the launch: sm_90a, head dims 128 and
  // 256; P rounded to e4m3, and a session step's q quantized per (sequence, KV head); docs/FP8.md)
  // or "auto": tensor cores for all-FP8 Attend (q already in e4m3), conversion for session steps
  // (whose 16-bit q would be rounded to e4m3).
  std::string fp8_attention = "auto";
  // On SIGTERM: new calls get UNAVAILABLE until none has arrived or been answered for
  // drain_quiet_ms and nothing is queued or running, for at most drain_grace_s; then open
  // AttendStreams end with UNAVAILABLE, the listener closes and open calls get drain_timeout_s
  // to finish.
  double drain_grace_s = 5;
  int64_t drain_quiet_ms = 200;
  double drain_timeout_s = 30;
  // Hand-off on drain: peers (host:port) the open sessions move to on SIGTERM, tried in turn,
  // within drain_timeout_s (rpc/session_handoff.h); empty: sessions end with the process. With
  // TLS the peers are called with this replica's certificate and key (mTLS) and verified against
  // tls_client_ca; handoff_tls_server_name overrides the name checked in their certificates.
  std::vector<std::string> handoff_peers;
  std::string handoff_tls_server_name;
  // Security (server/rpc/auth.h). TLS when tls_cert and tls_key (PEM file paths) are set; mTLS
  // (client certificates required and verified against this CA) when tls_client_ca is set too.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // Bearer tokens, one per line; when set, every attn.v1 call needs one (health is exempt).
  std::string auth_token_file;
  // Most Attend calls plus in-flight AttendStream items of one client (its token, or its peer
  // host without tokens); 0: unlimited.
  int64_t max_pending_per_client = 256;

  // KV-cache sessions. The cache region: 0 picks the default (CPU: 256 MiB of host memory;
  // CUDA: 80% of the device memory free at start after the device pool's bound and 1 GiB of
  // headroom). A page holds kv_page_tokens tokens of a 2 KiB KV row (8 KV heads x 128 x 2 bytes)
  // of keys and as many of values; rows of other sizes fit page_bytes / row tokens, or, where
  // they do not divide a page, whole rows in runs of adjacent pages.
  int64_t kv_cache_bytes = 0;
  int64_t kv_page_tokens = 16;
  int64_t max_sessions = 1024;
  int64_t max_session_tokens = 131072;  // per layer
  double session_ttl_s = 600;
  std::string replica_id;  // empty: random per start
  // Session steps wait for company only while the step pipeline is busy, at most this long (us;
  // 0: not at all, a step goes into the next launch the pipeline can take).
  int64_t max_step_delay_us = 0;
  // At most this many launches of a few decode steps (8 tokens or fewer) in flight at once (0:
  // as many as there are step lanes); more such steps gather for the next one.
  int max_small_step_launches = 0;
  // ... only while at least this many session steps are queued or running (0: always).
  int64_t small_step_cap_min_steps = 0;
  // Tests: shuffles the KV cache's free list so that page tables are not contiguous (0: off).
  uint64_t kv_shuffle_seed = 0;
  // Same-host shared memory (transport/, the SharedMemory service): off unless allowed. The
  // region socket's path ("" : $TMPDIR or /tmp, then attnd-<pid>.regions.sock) and the limits
  // per client identity.
  bool allow_shared_memory = false;
  std::string shm_socket;
  int64_t shm_max_regions_per_client = 64;
  int64_t shm_max_bytes_per_client = int64_t{16} << 30;
  // CUDA backend: most host-region bytes page-locked (cudaHostRegister) at once, over every
  // client, so that the GPU copies straight from and into them; regions past it go through
  // pinned staging. 0: no region is registered (always staged).
  int64_t shm_max_registered_bytes = int64_t{32} << 30;
  // Size of gRPC's TCP reads (reads grow up to 8x it); 0: gRPC's own (8 KiB, adaptive). Off by
  // default: no measured gain yet (docs/PERF.md, "Transport settings").
  int tcp_read_chunk_bytes = 0;
  // Extra gRPC server channel arguments (name, integer value), applied after attnd's own
  // transport settings (rpc/transport_args.h), so that they can override them: --grpc_arg.
  std::vector<std::pair<std::string, int>> grpc_args;
  // Attend's tensors straight between gRPC's slices and the backend's buffers (one host copy in,
  // none out on the CPU backend, one on CUDA); false: through whole protobuf messages, as the
  // generated method would do it (for measuring the difference: --attend_wire_path=false).
  bool attend_wire_path = true;
};

}  // namespace attn
