// attnd: the attention compute service.
#include <malloc.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "attn/util/flag_names.h"
#include "attn/util/usage.h"
#include "rpc/attn_server.h"
#include "version.h"

namespace {
const attn::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, listen, kDefaults.listen, "gRPC listen address, host:port");
ABSL_FLAG(std::string, metrics_listen, kDefaults.metrics_listen,
          "Prometheus /metrics address, host:port; empty disables it");
ABSL_FLAG(std::string, backend, kDefaults.backend, "auto, cpu or cuda");
ABSL_FLAG(int, threads, kDefaults.threads, "CPU backend worker threads; 0: one per core");
ABSL_FLAG(int64_t, max_message_bytes, kDefaults.max_message_bytes,
          "Largest request or response message, bytes");
ABSL_FLAG(int64_t, max_batch_tokens, kDefaults.max_batch_tokens,
          "Most query tokens packed into one batch");
ABSL_FLAG(int64_t, max_queue_delay_us, kDefaults.max_queue_delay_us,
          "Longest an Attend request waits for others to batch with while the backend is busy, "
          "microseconds (an idle backend takes it at once)");
ABSL_FLAG(bool, gather_when_idle, kDefaults.gather_when_idle,
          "Attend requests wait --max_queue_delay_us for company even while the backend is idle "
          "(packing over latency, for offline batch jobs)");
ABSL_FLAG(int64_t, max_queue_size, kDefaults.max_queue_size,
          "Most queued requests; beyond it RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_tensor_elements, kDefaults.max_tensor_elements,
          "Most elements of any one request tensor");
ABSL_FLAG(int64_t, max_inflight_bytes, kDefaults.max_inflight_bytes,
          "Most tensor bytes (inputs and outputs) held by queued and running requests; beyond "
          "it RESOURCE_EXHAUSTED");
ABSL_FLAG(int, streams, kDefaults.streams, "CUDA streams of Attend (CUDA backend)");
ABSL_FLAG(int, step_lanes, kDefaults.step_lanes,
          "CUDA streams of session steps, each with its own staging: launches in flight at once "
          "(CUDA backend); 0: as many as --streams");
ABSL_FLAG(int64_t, batch_step_chunk, kDefaults.batch_step_chunk,
          "A BatchStep's steps go to the step lanes in chunks of this many as they are decoded, so "
          "that an idle lane stages the first while the rest are decoded (0: all at once)");
ABSL_FLAG(int64_t, step_idle_poll_us, kDefaults.step_idle_poll_us,
          "CUDA backend: how long a step lane that finished a launch looks for the next one, "
          "yielding its core, before it sleeps (microseconds; 0: sleeps at once)");
ABSL_FLAG(bool, step_poll_when_busy, kDefaults.step_poll_when_busy,
          "CUDA backend: step lanes poll for their next launch and for the device even while "
          "other lanes are at work (false: only a lane alone at work polls, one idle lane at a "
          "time; the others sleep, leaving the cores to the transport)");
ABSL_FLAG(bool, step_append_in_kernel, kDefaults.step_append_in_kernel,
          "CUDA backend: a 16-bit decode step's new keys and values are written into their pages "
          "by the decode kernel itself (false: by a copy kernel launched before it)");
ABSL_FLAG(bool, step_output_to_host, kDefaults.step_output_to_host,
          "CUDA backend: a small decode step launch's o and lse (up to 64 KiB) are written by the "
          "decode kernel straight into the pinned host memory they are answered from (false: "
          "copied there after it)");
ABSL_FLAG(bool, step_fused_combine, kDefaults.step_fused_combine,
          "CUDA backend: a decode step launch with KV splits merges them in its split kernel (the "
          "last CTA of each group of splits) instead of launching a combine kernel after it "
          "(false: the combine kernel)");
ABSL_FLAG(int64_t, device_pool_bytes, kDefaults.device_pool_bytes,
          "Device memory pool bound, bytes (CUDA backend)");
ABSL_FLAG(int64_t, pinned_pool_bytes, kDefaults.pinned_pool_bytes,
          "Pinned host staging pool bound, bytes (CUDA backend)");
ABSL_FLAG(std::string, fp8_attention, kDefaults.fp8_attention,
          "CUDA backend, FP8 attention of more than 16 queries per sequence (all-FP8 Attend, and "
          "steps of FP8-cache sessions): convert (widen to 16 bits, then the 16-bit kernel), "
          "tensor_cores (the FP8 wgmma kernel where it serves the launch: sm_90a, head dims 128 "
          "and 256; P is rounded to e4m3, and a session step's q is quantized per (sequence, KV "
          "head)) or auto (tensor cores for all-FP8 Attend, conversion for session steps)");
ABSL_FLAG(double, drain_grace_s, kDefaults.drain_grace_s,
          "On SIGTERM/SIGINT, the longest time new calls are refused with UNAVAILABLE (so clients "
          "go elsewhere) before the listener closes; ends early once no call has arrived for "
          "--drain_quiet_ms and nothing is queued or running");
ABSL_FLAG(int64_t, drain_quiet_ms, kDefaults.drain_quiet_ms,
          "On SIGTERM/SIGINT, the lame-duck phase ends once no call has arrived or been answered "
          "for this long (milliseconds) and nothing is queued or running");
ABSL_FLAG(double, drain_timeout_s, kDefaults.drain_timeout_s,
          "On SIGTERM/SIGINT, how long open calls get to finish, seconds");
ABSL_FLAG(std::vector<std::string>, handoff_peers, {},
          "On SIGTERM/SIGINT, move every open session to one of these replicas (host:port, "
          "comma-separated, tried in turn) within --drain_timeout_s; calls on a moved session "
          "then get FAILED_PRECONDITION naming its new replica and id (attnd-moved-to). Empty: "
          "sessions end with the process");
ABSL_FLAG(std::string, handoff_tls_server_name, "",
          "With TLS: the name the peers' certificates are checked against (default: the "
          "--handoff_peers host)");
ABSL_FLAG(std::string, tls_cert, kDefaults.tls_cert,
          "PEM server certificate (chain) file; with --tls_key, serves TLS");
ABSL_FLAG(std::string, tls_key, kDefaults.tls_key, "PEM private key file of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, kDefaults.tls_client_ca,
          "PEM CA file; when set, clients must present a certificate it signed (mTLS)");
ABSL_FLAG(std::string, auth_token_file, kDefaults.auth_token_file,
          "File of accepted bearer tokens, one per line ('#' comments); when set, attn.v1 "
          "calls without a valid 'authorization: Bearer <token>' get UNAUTHENTICATED "
          "(health is exempt)");
ABSL_FLAG(int64_t, max_pending_per_client, kDefaults.max_pending_per_client,
          "Most pending Attend calls and AttendStream items per client (its token, else its "
          "address); beyond it RESOURCE_EXHAUSTED; 0: unlimited");

ABSL_FLAG(int64_t, kv_cache_bytes, kDefaults.kv_cache_bytes,
          "KV cache region of sessions, bytes (keys and values); 0: CPU 256 MiB, CUDA 80% of the "
          "device memory free at start after --device_pool_bytes and 1 GiB of headroom");
ABSL_FLAG(int64_t, kv_page_tokens, kDefaults.kv_page_tokens,
          "Tokens per KV page for a 2 KiB KV row (8 KV heads x head_dim 128 x 2 bytes); a page "
          "holds page bytes / row tokens of other rows");
ABSL_FLAG(int64_t, max_sessions, kDefaults.max_sessions, "Most open KV-cache sessions");
ABSL_FLAG(int64_t, max_session_tokens, kDefaults.max_session_tokens,
          "Most tokens one session may hold per layer");
ABSL_FLAG(double, session_ttl_s, kDefaults.session_ttl_s,
          "Idle seconds after which a session is closed and its pages freed");
ABSL_FLAG(std::string, replica_id, kDefaults.replica_id,
          "This process's replica id, the prefix of its session ids ([A-Za-z0-9_-]{1,64}); "
          "empty: random per start");
ABSL_FLAG(int64_t, max_step_delay_us, kDefaults.max_step_delay_us,
          "Longest a session step waits for others to batch with while the step pipeline is "
          "busy, microseconds; 0: none, a step goes into the next launch the pipeline can take "
          "(an idle pipeline takes it at once either way)");
ABSL_FLAG(int32_t, max_small_step_launches, kDefaults.max_small_step_launches,
          "Most launches of a few session steps (8 tokens or fewer) in flight at once; more such "
          "steps gather until one finishes and go as one launch, while larger launches (a "
          "BatchStep's chunks, prefill) still take any free step lane. 0: as many as the lanes");
ABSL_FLAG(int64_t, small_step_cap_min_steps, kDefaults.small_step_cap_min_steps,
          "--max_small_step_launches holds only while at least this many session steps are "
          "queued or running (many callers stepping at once); 0: it always holds");
ABSL_FLAG(bool, allow_shared_memory, kDefaults.allow_shared_memory,
          "Serve same-host clients through shared memory (the SharedMemory service and "
          "Tensor.region): a Unix socket (--shm_socket) takes their sealed memfds");
ABSL_FLAG(std::string, shm_socket, kDefaults.shm_socket,
          "Path of the region socket with --allow_shared_memory; empty: $TMPDIR (or /tmp)"
          "/attnd-<pid>.regions.sock. Clients find it with ListRegions");
ABSL_FLAG(int64_t, shm_max_regions_per_client, kDefaults.shm_max_regions_per_client,
          "Most shared-memory regions per client identity");
ABSL_FLAG(int64_t, shm_max_bytes_per_client, kDefaults.shm_max_bytes_per_client,
          "Most bytes of shared-memory regions mapped per client identity");
ABSL_FLAG(int64_t, shm_max_registered_bytes, kDefaults.shm_max_registered_bytes,
          "CUDA backend: most bytes of host regions page-locked for direct GPU copies at once, "
          "over all clients (resident, never swapped); regions past it are copied through pinned "
          "staging. 0: never (always staged)");
ABSL_FLAG(int, tcp_read_chunk_bytes, kDefaults.tcp_read_chunk_bytes,
          "Size of gRPC's TCP reads (reads grow up to 8x it); 0: gRPC's default (8 KiB, adaptive)");
ABSL_FLAG(bool, attend_wire_path, kDefaults.attend_wire_path,
          "Attend's tensors go between gRPC's slices and the backend's buffers with one host copy; "
          "false: through whole protobuf messages (two copies each way), for measuring it");
ABSL_FLAG(bool, malloc_keep_freed, true,
          "Keep memory freed by large messages in the allocator for the next call (glibc: mmap "
          "threshold 32 MiB, trim threshold 1 GiB) instead of giving it back to the kernel and "
          "faulting it in again; RSS then stays at its high-water mark");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "Extra gRPC server channel arguments, name=integer, comma-separated (e.g. "
          "grpc.http2.max_frame_size=1048576); for measuring transport settings");

namespace {

// glibc gives a freed block of 128 KiB or more back to the kernel (munmap, or a heap trim) and
// the next message of that size faults its pages in again: about a third of an Echo of 768 KB
// at 4 callers went to page faults on the 2-core host. Messages up to 32 MiB now come from
// memory that stays mapped.
void KeepFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// --grpc_arg as (name, value) pairs; exits 64 on a malformed entry.
std::vector<std::pair<std::string, int>> GrpcArgsFromFlag() {
  std::vector<std::pair<std::string, int>> out;
  for (const std::string& entry : absl::GetFlag(FLAGS_grpc_arg)) {
    const size_t eq = entry.find('=');
    int value = 0;
    if (eq == std::string::npos || !absl::SimpleAtoi(entry.substr(eq + 1), &value)) {
      std::cerr << "attnd: --grpc_arg entries are name=integer, got '" << entry << "'" << std::endl;
      std::exit(64);
    }
    out.emplace_back(entry.substr(0, eq), value);
  }
  return out;
}

attn::ServerOptions OptionsFromFlags() {
  attn::ServerOptions o;
  o.listen = absl::GetFlag(FLAGS_listen);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  o.gather_when_idle = absl::GetFlag(FLAGS_gather_when_idle);
  o.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  o.max_tensor_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  o.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  o.streams = absl::GetFlag(FLAGS_streams);
  o.step_lanes = absl::GetFlag(FLAGS_step_lanes);
  o.step_append_in_kernel = absl::GetFlag(FLAGS_step_append_in_kernel);
  o.step_fused_combine = absl::GetFlag(FLAGS_step_fused_combine);
  o.step_output_to_host = absl::GetFlag(FLAGS_step_output_to_host);
  o.step_idle_poll_us = absl::GetFlag(FLAGS_step_idle_poll_us);
  o.step_poll_when_busy = absl::GetFlag(FLAGS_step_poll_when_busy);
  o.batch_step_chunk = absl::GetFlag(FLAGS_batch_step_chunk);
  o.device_pool_bytes = absl::GetFlag(FLAGS_device_pool_bytes);
  o.pinned_pool_bytes = absl::GetFlag(FLAGS_pinned_pool_bytes);
  o.fp8_attention = absl::GetFlag(FLAGS_fp8_attention);
  o.drain_grace_s = absl::GetFlag(FLAGS_drain_grace_s);
  o.drain_quiet_ms = absl::GetFlag(FLAGS_drain_quiet_ms);
  o.drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  o.handoff_peers = absl::GetFlag(FLAGS_handoff_peers);
  o.handoff_tls_server_name = absl::GetFlag(FLAGS_handoff_tls_server_name);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  o.max_pending_per_client = absl::GetFlag(FLAGS_max_pending_per_client);
  o.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  o.kv_page_tokens = absl::GetFlag(FLAGS_kv_page_tokens);
  o.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  o.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  o.session_ttl_s = absl::GetFlag(FLAGS_session_ttl_s);
  o.replica_id = absl::GetFlag(FLAGS_replica_id);
  o.max_step_delay_us = absl::GetFlag(FLAGS_max_step_delay_us);
  o.max_small_step_launches = absl::GetFlag(FLAGS_max_small_step_launches);
  o.small_step_cap_min_steps = absl::GetFlag(FLAGS_small_step_cap_min_steps);
  o.grpc_args = GrpcArgsFromFlag();
  o.tcp_read_chunk_bytes = absl::GetFlag(FLAGS_tcp_read_chunk_bytes);
  o.attend_wire_path = absl::GetFlag(FLAGS_attend_wire_path);
  o.allow_shared_memory = absl::GetFlag(FLAGS_allow_shared_memory);
  o.shm_socket = absl::GetFlag(FLAGS_shm_socket);
  o.shm_max_regions_per_client = absl::GetFlag(FLAGS_shm_max_regions_per_client);
  o.shm_max_bytes_per_client = absl::GetFlag(FLAGS_shm_max_bytes_per_client);
  o.shm_max_registered_bytes = absl::GetFlag(FLAGS_shm_max_registered_bytes);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  attn::util::SetUsageConfigForMain("server/attnd_main.cc", std::string("attnd ") + attn::kVersion);
  absl::SetProgramUsageMessage("attnd: attention compute service (attn.v1 over gRPC)");
  std::vector<std::string> args = attn::util::NormalizeFlagNames(argc, argv);
  std::vector<char*> argp = attn::util::ArgvOf(args);
  absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  // The distribution's abseil is built with its debug checks: every absl::Mutex lock (gRPC's
  // included) would consult a process-wide deadlock graph under a global lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Signals are taken by one thread with sigtimedwait, so that no handler runs inside gRPC.
  // A non-interactive shell starts background jobs with SIGINT ignored; attnd wants it anyway (a
  // terminal's Ctrl-C reaches the whole foreground process group, scripts/run.sh included).
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (absl::GetFlag(FLAGS_malloc_keep_freed)) KeepFreedMemory();
  std::cerr << "attnd " << attn::kVersion << " starting" << std::endl;
  auto server = attn::AttnServer::Create(OptionsFromFlags());
  if (!server.ok()) {
    std::cerr << "attnd: " << server.status() << std::endl;
    return 1;
  }
  // The first SIGINT/SIGTERM drains (on its own thread: Drain blocks until open calls are
  // done); a second one during the drain exits at once with 128 + the signal number, leaving
  // open calls unanswered (the operator asked twice).
  std::atomic<bool> done{false};
  std::thread drainer;
  std::thread signal_thread([&signals, &done, &drainer, s = server->get()] {
    bool draining = false;
    while (!done.load()) {
      const timespec poll = {0, 100'000'000};
      const int sig = sigtimedwait(&signals, nullptr, &poll);
      if (sig < 0) continue;  // the poll timed out (or EINTR): look at done again
      if (!draining) {
        draining = true;
        std::cerr << "attnd: received " << strsignal(sig)
                  << "; draining (send SIGINT or SIGTERM again to exit at once)" << std::endl;
        drainer = std::thread([s] { s->Drain(); });
      } else {
        std::cerr << "attnd: received " << strsignal(sig)
                  << " again while draining; exiting at once, open calls unanswered (once the "
                     "session being handed off, if any, has moved or stayed)"
                  << std::endl;
        s->StopHandoff();
        std::_Exit(128 + sig);
      }
    }
  });
  (*server)->Wait();
  done = true;
  signal_thread.join();
  if (drainer.joinable()) drainer.join();
  server->reset();
  std::cerr << "attnd: exiting" << std::endl;
  return 0;
}
