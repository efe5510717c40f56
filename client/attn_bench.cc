// attn-bench: a load generator for attnd (in the spirit of Triton's perf_analyzer).
//
//   attn-bench --target HOST:PORT --concurrency 1,4,16,64 --duration_s 10 --warmup_s 2 \
//              --seq 128 --heads 16 --head-dim 128 --dtype bf16|fp16|fp32|fp8 [--kv_dtype fp8]
//              [--mode unary|stream|echo]
//              [--rate R] [--compare_echo] [--lb round_robin] [--csv out.csv] [--json out.json]
//              [--client_coding wire|protobuf]
//
// For each concurrency level (closed loop: each worker sends its next request when the last one
// is answered) or at a fixed request rate (open loop, latency counted from the scheduled send
// time), it prints throughput, latency percentiles and the server-side split of the time taken
// from the responses. --mode=echo sends the same bytes each way through the Echo RPC, which
// does no work: the transport's own ceiling. --compare_echo runs, at each concurrency level, the
// chosen mode and then Echo with the same bytes in the same process, and prints the ratios
// (req/s and p50 of the mode over Echo's).
//
// --client_coding: how unary Attend and Echo calls are coded on this side. wire (the default):
// the client library's raw calls (ClientOptions::wire_coding), whose tensors go out as slices over
// the request's buffers and whose o comes back with one copy into the result, as a program using
// Client::Attend gets them. protobuf: the generated stub with a request message built once, which
// protobuf serializes into fresh slices on every call, and a response parsed into strings. Stream
// mode likewise (wire: Client::OpenRawAttendStream); decode mode has --step_coding instead.
//
// --mode=decode drives KV-cache sessions: --sessions S (a comma-separated sweep, instead of
// --concurrency) sessions of --layers L layers, each prefilled with --cache_tokens tokens per layer
// (not timed), then decoded one token per layer per call: through Step (one caller per session) or,
// with --batch_step N, through BatchStep (ceil(S/N) callers, each sending one step of each of its
// N sessions per call, its sessions on one replica). --target may name many replicas (a DNS name
// with many addresses, ipv4:H1:P1,H2:P2): sessions are placed by the client library on the replica
// with the most free KV pages. Every --decode_window tokens a session is truncated back to
// --cache_tokens (not timed), so the cache length holds however long the run. Per level it prints
// the decode run (a row per --step_coding: stub, the default, sends request messages built once
// through the generated stub; wire and protobuf go through the client library's Step/BatchStep
// with ClientOptions::wire_coding on and off; shm and gpu put every tensor in a host or GPU region
// of the caller's) and Echo of the same bytes (each call's serialized request out, its o and lse
// bytes back; for shm and gpu, calls of the same tensor-free size) at the same concurrency, with
//   steps/s    (session, layer) steps per second; tokens/s = steps/s / L (a token has passed every
//              layer); p50/p99 per call; queue_us/compute_us the server's timing (mean per call);
//   cache      mean cache length after a step; KV_GB/s the K and V bytes the steps read per second
//              (cache length x KV heads x head dim x 2 x dtype size, summed over the steps);
//   steps/echo and p50/echo the decode row over the Echo row.
// A server that cannot serve sessions answers CreateSession (or Step) with UNIMPLEMENTED: attn-bench
// prints that status and exits 1.
//
// --rate in stream mode: each of the `concurrency` streams writes on its own schedule
// (rate/concurrency per stream, staggered); a write whose slot is not free yet (--stream_depth
// in flight) waits for one, and its latency still counts from the scheduled time.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <limits>
#include <cmath>
#include <iostream>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "attn/client/client.h"
#include "attn/client/tcp_ceiling.h"
#include "attn/client/wire_coding.h"
#include "bench_region.h"
#include "attn/util/flag_names.h"
#include "attn/util/usage.h"
#include "bench_decode.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attnd address, host:port");
ABSL_FLAG(std::string, lb, "",
          "gRPC load-balancing policy of each channel: round_robin spreads calls over every "
          "address of --target (dns:///headless-service:50051, ipv4:H1:P1,H2:P2); '' = gRPC's "
          "default (pick_first)");
ABSL_FLAG(bool, compare_echo, false,
          "At each concurrency level also run Echo with the same bytes and print the ratio of "
          "--mode to Echo (req/s and p50)");
ABSL_FLAG(std::string, mode, "unary",
          "unary (Attend), stream (AttendStream), echo, or decode (KV-cache sessions through Step or "
          "BatchStep, with Echo of the same bytes)");
ABSL_FLAG(std::string, sessions, "1", "decode: comma-separated numbers of concurrent sessions to sweep");
ABSL_FLAG(int, layers, 1, "decode: layers per session (each step is one layer's)");
ABSL_FLAG(int64_t, cache_tokens, 1024, "decode: tokens per layer prefilled before the measured run (not timed)");
ABSL_FLAG(int, prefill_chunk, 1024, "decode: tokens per prefill step");
ABSL_FLAG(int, batch_step, 0,
          "decode: 0 sends Step (one caller per session); N > 0 sends BatchStep with one step of each "
          "of up to N sessions per call");
ABSL_FLAG(int, decode_window, 64,
          "decode: decode tokens a session gains before it is truncated back to --cache_tokens (not "
          "timed)");
ABSL_FLAG(bool, lse, false, "decode: ask for the log-sum-exp too");
ABSL_FLAG(std::string, step_coding, "stub",
          "decode: comma-separated codings of the decode calls, one row each on the same sessions: "
          "stub (request messages built once, the generated stub), wire and protobuf (the client "
          "library's Step/BatchStep with ClientOptions::wire_coding on and off), shm and gpu "
          "(every tensor in a host or GPU region of the caller's; attnd --allow_shared_memory)");
ABSL_FLAG(std::string, transport, "grpc",
          "unary mode: grpc (tensors in the messages), shm (each worker's q, k, v and o in a "
          "host shared-memory region of its own) or cuda-ipc (in GPU memory of device 0 shared "
          "with attnd by a CUDA IPC handle, written once); shm and cuda-ipc need attnd's "
          "--allow_shared_memory and this host");
ABSL_FLAG(bool, shm_write_inputs, true,
          "--transport shm: copy q, k and v into the region before every call, as a client that "
          "produces them must");
ABSL_FLAG(std::string, client_coding, "wire",
          "unary, stream and echo modes: wire (the client library's raw calls: tensors sent from the "
          "caller's buffers, o copied once into the result) or protobuf (the generated stub with "
          "a request message built once)");
ABSL_FLAG(std::string, concurrency, "1", "Comma-separated concurrency levels to sweep");
ABSL_FLAG(double, rate, 0, "Fixed request rate, requests/s (open loop); 0: closed loop");
ABSL_FLAG(double, duration_s, 10, "Measured seconds per level");
ABSL_FLAG(double, warmup_s, 2, "Unmeasured seconds before each level");
ABSL_FLAG(int64_t, max_requests, 0, "Stop a level after this many measured requests (0: none)");
ABSL_FLAG(int, stream_depth, 4, "stream mode: requests in flight per stream");
ABSL_FLAG(int, seq, 128, "Query tokens per sequence");
ABSL_FLAG(int, kv_seq, 0, "Key tokens per sequence (0: --seq)");
ABSL_FLAG(int, batch, 1, "Sequences per request");
ABSL_FLAG(int, heads, 16, "Query heads");
ABSL_FLAG(int, kv_heads, 0, "KV heads (0: --heads)");
ABSL_FLAG(int, head_dim, 128, "Head dimension");
ABSL_FLAG(std::string, dtype, "bf16",
          "bf16, fp16, fp32, or fp8 (Attend with q, k and v as E4M3 codes, descales 1/448 per "
          "tensor, o in bf16)");
ABSL_FLAG(std::string, kv_dtype, "",
          "decode: the sessions' KV cache dtype: fp8 (E4M3, the server quantizing each step's "
          "k_new/v_new in --dtype) or empty (--dtype); unary and stream: fp8 sends k and v as E4M3 "
          "codes (q in --dtype)");
ABSL_FLAG(bool, causal, false, "Causal mask");
ABSL_FLAG(int, channels, 0, "Clients shared by the workers (0: one per worker)");
ABSL_FLAG(int, connections, 1,
          "HTTP/2 connections of each client (ClientOptions::connections; 0: the library's "
          "default, min(4, hardware threads)); with --channels 1 all workers share one client "
          "and its connections");
ABSL_FLAG(int, tcp_read_chunk_bytes, 0,
          "ClientOptions::tcp_read_chunk_bytes: size of gRPC's TCP reads; 0: gRPC's default");
ABSL_FLAG(std::vector<std::string>, channel_arg, {},
          "Extra gRPC channel arguments of the clients, name=integer, comma-separated (e.g. "
          "grpc.http2.max_frame_size=1048576)");
ABSL_FLAG(std::string, csv, "", "Append one row per level to this CSV file");
ABSL_FLAG(std::string, json, "", "Write all levels to this JSON file");
ABSL_FLAG(std::string, label, "", "Free text stored with each row (e.g. server flags)");
ABSL_FLAG(double, tcp_ceiling_s, 2,
          "After each level, measure raw TCP on loopback in this process with the same request "
          "and response bytes and the same concurrency (attn-tcp-ceiling) for this many seconds, "
          "and print its GB/s and the level's share of it (columns tcp_GB/s, x_tcp); 0: off");

namespace {

using Clock = std::chrono::steady_clock;
using attn::client::Client;

struct Sample {
  double latency_us;
  double queue_us, transfer_us, compute_us;
  int32_t batch_requests;
};

struct LevelResult {
  std::string mode;
  int concurrency = 0;
  double offered_rate = 0;
  int64_t requests = 0;
  int64_t errors = 0;
  std::string first_error;
  double seconds = 0;
  double request_bytes = 0;
  double response_bytes = 0;
  double tokens_per_request = 0;
  std::vector<Sample> samples;
  // --compare_echo: this level's req/s and p50 over those of Echo at the same concurrency
  // (NaN when not measured).
  double echo_rps_ratio = std::numeric_limits<double>::quiet_NaN();
  double echo_p50_ratio = std::numeric_limits<double>::quiet_NaN();
  // --tcp_ceiling_s: raw TCP loopback GB/s with the same bytes and concurrency (NaN: not run).
  double tcp_gbps = std::numeric_limits<double>::quiet_NaN();

  double Throughput() const { return requests / seconds; }
  double GigabytesPerSecond() const { return Throughput() * (request_bytes + response_bytes) / 1e9; }
  double Percentile(double p) const {
    if (samples.empty()) return 0;
    std::vector<double> l;
    for (const auto& s : samples) l.push_back(s.latency_us);
    const size_t k = std::min(l.size() - 1, static_cast<size_t>(p * l.size()));
    std::nth_element(l.begin(), l.begin() + k, l.end());
    return l[k];
  }
  double Mean(double Sample::*field) const {
    if (samples.empty()) return 0;
    double s = 0;
    for (const auto& x : samples) s += x.*field;
    return s / samples.size();
  }
  double MeanBatch() const {
    if (samples.empty()) return 0;
    double s = 0;
    for (const auto& x : samples) s += x.batch_requests;
    return s / samples.size();
  }
};

// The request every worker sends (random data drawn once): as tensors for the client library's
// wire coding, as messages for the generated stubs.
struct Payload {
  attn::client::Tensor q, k, v;
  attn::client::AttendOptions options;
  attn::v1::AttendRequest attend;
  attn::v1::EchoRequest echo;
  double tokens = 0;
};

bool WireCoding() { return absl::GetFlag(FLAGS_client_coding) == "wire"; }

Payload BuildPayload() {
  auto dtype = attn::client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    std::cerr << dtype.status() << std::endl;
    std::exit(64);
  }
  const int s_q = absl::GetFlag(FLAGS_seq), b = absl::GetFlag(FLAGS_batch);
  const int s_k = absl::GetFlag(FLAGS_kv_seq) > 0 ? absl::GetFlag(FLAGS_kv_seq) : s_q;
  const int h = absl::GetFlag(FLAGS_heads);
  const int h_kv = absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads) : h;
  const int d = absl::GetFlag(FLAGS_head_dim);
  // FP8 (--dtype=fp8: q, k and v; --kv_dtype=fp8: k and v): the E4M3 codes of values in [-1, 1)
  // times 448, with one descale of 1/448 per tensor; o in bf16 when q is FP8.
  const bool fp8_q = *dtype == attn::client::DType::kFloat8E4M3;
  const bool fp8_kv = fp8_q || absl::GetFlag(FLAGS_kv_dtype) == "fp8";
  constexpr float kFp8Descale = 1.0f / 448.0f;
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> dist(-1, 1);
  auto random = [&](int64_t tokens, int heads, bool fp8) {
    std::vector<float> v(size_t(tokens) * heads * d);
    for (float& x : v) x = fp8 ? dist(rng) / kFp8Descale : dist(rng);
    return attn::client::Tensor::FromFloats(fp8 ? attn::client::DType::kFloat8E4M3 : *dtype,
                                            {tokens, heads, d}, v);
  };
  attn::client::AttendOptions o;
  for (int i = 0; i <= b; ++i) {
    o.cu_seqlens_q.push_back(i * s_q);
    o.cu_seqlens_k.push_back(i * s_k);
  }
  o.causal = absl::GetFlag(FLAGS_causal);
  o.timeout = std::chrono::milliseconds(120000);
  Payload p;
  p.q = random(int64_t(b) * s_q, h, fp8_q);
  p.k = random(int64_t(b) * s_k, h_kv, fp8_kv);
  p.v = random(int64_t(b) * s_k, h_kv, fp8_kv);
  if (fp8_q) {
    o.q_descale = {kFp8Descale};
    o.o_dtype = attn::client::DType::kBFloat16;
  }
  if (fp8_kv) o.k_descale = o.v_descale = {kFp8Descale};
  p.options = o;
  p.attend = Client::BuildAttendRequest(p.q, p.k, p.v, o);
  p.tokens = double(b) * s_q;
  // Echo: the serialized Attend request out, an output-sized payload back.
  p.attend.SerializeToString(p.echo.mutable_payload());
  p.echo.set_response_bytes(static_cast<int64_t>(p.attend.q().data().size()));
  return p;
}

// --channel_arg as (name, value) pairs; exits 64 on a malformed entry.
std::vector<std::pair<std::string, int>> ChannelArgs() {
  std::vector<std::pair<std::string, int>> out;
  for (const std::string& entry : absl::GetFlag(FLAGS_channel_arg)) {
    const size_t eq = entry.find('=');
    int value = 0;
    if (eq == std::string::npos || !absl::SimpleAtoi(entry.substr(eq + 1), &value)) {
      std::cerr << "attn-bench: --channel_arg entries are name=integer, got '" << entry << "'"
                << std::endl;
      std::exit(64);
    }
    out.emplace_back(entry.substr(0, eq), value);
  }
  return out;
}

std::vector<std::unique_ptr<Client>> MakeClients(int n) {
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < n; ++i) {
    attn::client::ClientOptions o;
    o.target = absl::GetFlag(FLAGS_target);
    o.max_message_bytes = 1ll << 30;
    o.unique_channel = true;
    o.lb_policy = absl::GetFlag(FLAGS_lb);
    o.connections = absl::GetFlag(FLAGS_connections);
    o.channel_args = ChannelArgs();
    o.tcp_read_chunk_bytes = absl::GetFlag(FLAGS_tcp_read_chunk_bytes);
    o.wire_coding = WireCoding();
    auto c = Client::Create(o);
    if (!c.ok()) {
      std::cerr << c.status() << std::endl;
      std::exit(1);
    }
    clients.push_back(std::move(*c));
  }
  return clients;
}

// Collects samples from the workers of one level.
class Recorder {
 public:
  Recorder(Clock::time_point measure_from, Clock::time_point end, int64_t max_requests)
      : from_(measure_from), end_(end), max_(max_requests) {}
  bool Running() const { return Clock::now() < end_ && !(max_ > 0 && measured_.load() >= max_); }
  void Record(Clock::time_point sent, Clock::time_point done, const attn::v1::ServerTiming* t,
              const grpc::Status& st) {
    if (sent < from_ || done > end_) return;
    ++measured_;
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      ++errors_;
      if (first_error_.empty()) first_error_ = st.error_message();
      return;
    }
    Sample s{std::chrono::duration<double, std::micro>(done - sent).count(), 0, 0, 0, 0};
    if (t) {
      s.queue_us = t->queue_us();
      s.transfer_us = t->transfer_us();
      s.compute_us = t->compute_us();
      s.batch_requests = t->batch_requests();
    }
    samples_.push_back(s);
  }
  void Record(Clock::time_point sent, Clock::time_point done, const attn::v1::ServerTiming* t,
              const absl::Status& st) {
    Record(sent, done, t,
           grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message())));
  }
  void RecordStreamError(const grpc::Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_;
    if (first_error_.empty()) first_error_ = "stream: " + st.error_message();
  }
  void Into(LevelResult* r) {
    std::lock_guard<std::mutex> lock(mu_);
    r->samples = std::move(samples_);
    r->requests = static_cast<int64_t>(r->samples.size());
    r->errors = errors_;
    r->first_error = first_error_;
  }

 private:
  const Clock::time_point from_, end_;
  const int64_t max_;
  std::atomic<int64_t> measured_{0};
  std::mutex mu_;
  std::vector<Sample> samples_;
  int64_t errors_ = 0;
  std::string first_error_;
};

// One closed- or open-loop worker on unary calls (Attend or Echo). region: --transport shm.
void UnaryWorker(Client* client, const Payload& p, bool echo, Recorder* rec, double interval_s,
                 Clock::time_point start, attn::client::BenchRegion* region) {
  const attn::v1::AttendRequest& attend = region != nullptr ? region->request() : p.attend;
  const bool write_inputs = region != nullptr && absl::GetFlag(FLAGS_shm_write_inputs);
  attn::v1::AttendResponse attend_response;
  attn::v1::EchoResponse echo_response;
  attn::client::AttendResult result;
  std::string payload;
  for (int64_t k = 0; rec->Running(); ++k) {
    Clock::time_point sent = Clock::now();
    if (interval_s > 0) {  // open loop: send at the scheduled time, count latency from it
      sent = start + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(k * interval_s));
      std::this_thread::sleep_until(sent);
      if (!rec->Running()) break;
    }
    if (write_inputs) region->WriteInputs();
    if (region == nullptr && WireCoding()) {  // the client library's raw calls
      if (echo) {  // into the worker's string, reused from call to call
        const absl::Status st = client->Echo(p.echo.payload(), p.echo.response_bytes(), &payload);
        rec->Record(sent, Clock::now(), nullptr, st);
      } else {  // into the worker's result, whose buffers are reused from call to call
        const absl::Status st = client->Attend(p.q, p.k, p.v, p.options, &result);
        rec->Record(sent, Clock::now(), st.ok() ? &result.timing : nullptr, st);
      }
      continue;
    }
    grpc::ClientContext ctx;
    client->PrepareContext(&ctx, std::chrono::milliseconds(120000));
    grpc::Status st = echo ? client->stub()->Echo(&ctx, p.echo, &echo_response)
                           : client->stub()->Attend(&ctx, attend, &attend_response);
    rec->Record(sent, Clock::now(), echo || !st.ok() ? nullptr : &attend_response.timing(), st);
  }
}

// AttendStream's two codings for StreamLoop: Write(id) sends request id (false once the stream is
// broken); Read(&item) takes the next response (false at the stream's end); Finish() ends it.
struct StreamItem {
  uint64_t id = 0;
  grpc::Status status;
  const attn::v1::ServerTiming* timing = nullptr;  // valid until the next Read
};

// The generated stub: the request message built once and serialized by protobuf on every write,
// responses parsed into messages.
class StubStreamCoding {
 public:
  StubStreamCoding(Client* client, const Payload& p, grpc::ClientContext* ctx)
      : request_(p.attend), stream_(client->stub()->AttendStream(ctx)) {}
  bool Write(uint64_t id) {
    request_.set_request_id(id);
    return stream_->Write(request_);
  }
  bool Read(StreamItem* item) {
    if (!stream_->Read(&response_)) return false;
    item->id = response_.request_id();
    item->status = response_.status_code() == 0
                       ? grpc::Status::OK
                       : grpc::Status(static_cast<grpc::StatusCode>(response_.status_code()),
                                      response_.status_message());
    item->timing = &response_.timing();
    return true;
  }
  void WritesDone() { stream_->WritesDone(); }
  grpc::Status Finish() { return stream_->Finish(); }

 private:
  attn::v1::AttendRequest request_;
  attn::v1::AttendResponse response_;
  std::unique_ptr<grpc::ClientReaderWriter<attn::v1::AttendRequest, attn::v1::AttendResponse>> stream_;
};

// The client library's wire coding over a raw stream: each request's tensors go out as slices
// over the payload's buffers, and each response's o is read into one result (one copy), as
// Client::Attend does for a unary call.
class WireStreamCoding {
 public:
  WireStreamCoding(Client* client, const Payload& p, grpc::ClientContext* ctx)
      : p_(p), stream_(client->OpenRawAttendStream(ctx)) {}
  // The slices of the last writes may still be held by gRPC: the stream goes first.
  ~WireStreamCoding() {
    stream_.reset();
    borrowed_.Wait();
  }
  bool Write(uint64_t id) {
    grpc::ByteBuffer request = attn::client::EncodeAttendRequest(p_.q, p_.k, p_.v, p_.options,
                                                                 &borrowed_, id);
    return stream_->Write(request);
  }
  bool Read(StreamItem* item) {
    grpc::ByteBuffer buffer;
    if (!stream_->Read(&buffer)) return false;
    attn::client::ReceivedBytes bytes;
    attn::client::DecodedAttendResponse decoded;
    absl::Status st = bytes.Take(&buffer);
    if (st.ok()) st = attn::client::DecodeAttendResponse(bytes.pieces, &decoded);
    if (st.ok() && decoded.header.status_code() != 0) {
      st = absl::Status(static_cast<absl::StatusCode>(decoded.header.status_code()),
                        decoded.header.status_message());
    }
    if (st.ok()) st = attn::client::ReadAttendResult(decoded, &result_);
    item->id = decoded.header.request_id();
    item->status = grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
    result_.timing = decoded.header.timing();
    item->timing = &result_.timing;
    return true;
  }
  void WritesDone() { stream_->WritesDone(); }
  grpc::Status Finish() { return stream_->Finish(); }

 private:
  const Payload& p_;
  attn::client::BorrowedSlices borrowed_;
  attn::client::AttendResult result_;  // its buffers reused from response to response
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
};

// One AttendStream with up to `depth` requests in flight; latency per item. interval_s > 0:
// open loop, request k is due at start + k * interval_s and its latency counts from then (also
// when it had to wait for a free slot).
template <typename Coding>
void StreamWorker(Client* client, const Payload& p, Recorder* rec, int depth, double interval_s,
                  Clock::time_point start) {
  grpc::ClientContext ctx;
  client->PrepareContext(&ctx, std::chrono::milliseconds(0));
  Coding stream(client, p, &ctx);
  std::mutex mu;
  std::condition_variable slot_free;
  std::vector<Clock::time_point> sent_at;
  int in_flight = 0;
  bool reader_done = false;
  std::thread reader([&] {
    StreamItem item;
    while (stream.Read(&item)) {
      Clock::time_point sent{};
      bool known;
      {
        std::lock_guard<std::mutex> lock(mu);
        known = item.id < sent_at.size();
        if (known) sent = sent_at[item.id];
      }
      if (known) {
        rec->Record(sent, Clock::now(), item.status.ok() ? item.timing : nullptr, item.status);
      } else {  // a response that names no request sent (a malformed one): counted, not timed
        rec->RecordStreamError(item.status.ok()
                                   ? grpc::Status(grpc::StatusCode::INTERNAL, "unknown request_id")
                                   : item.status);
      }
      std::lock_guard<std::mutex> lock(mu);
      --in_flight;
      slot_free.notify_one();
    }
    std::lock_guard<std::mutex> lock(mu);
    reader_done = true;
    slot_free.notify_one();
  });
  for (uint64_t id = 0; rec->Running(); ++id) {
    Clock::time_point due{};
    if (interval_s > 0) {
      due = start + std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(double(id) * interval_s));
      // Sleep in short steps so that the end of the level is noticed.
      while (rec->Running() && Clock::now() < due) {
        std::this_thread::sleep_until(std::min(due, Clock::now() + std::chrono::milliseconds(50)));
      }
      if (!rec->Running()) break;
    }
    {
      // Blocks (no spinning) until a response frees a slot or the level's time is up.
      std::unique_lock<std::mutex> lock(mu);
      slot_free.wait_for(lock, std::chrono::milliseconds(50),
                         [&] { return in_flight < depth || reader_done; });
      if (reader_done) break;
      if (in_flight >= depth) {
        --id;  // the same request (and schedule slot) again
        continue;
      }
      sent_at.push_back(interval_s > 0 ? due : Clock::now());
      ++in_flight;
    }
    if (!stream.Write(id)) break;
  }
  stream.WritesDone();
  reader.join();
  const grpc::Status st = stream.Finish();
  if (!st.ok()) rec->RecordStreamError(st);
}

// --transport shm: one region client per client (each holds a region socket connection) and one
// region per worker; dropped (and so unregistered by attnd) at the end of the level.
struct WorkerRegions {
  std::vector<std::unique_ptr<attn::client::RegionClient>> clients;
  std::vector<std::unique_ptr<attn::client::BenchRegion>> regions;
};

WorkerRegions MakeRegions(const std::vector<std::unique_ptr<Client>>& clients, int workers,
                          const Payload& p, const std::string& transport) {
  const auto kind = transport == "shm" ? attn::client::BenchRegion::Kind::kHost
                                       : attn::client::BenchRegion::Kind::kGpu;
  WorkerRegions w;
  for (const auto& c : clients) {
    auto rc = attn::client::RegionClient::Connect(c.get());
    if (!rc.ok()) {
      std::cerr << "attn-bench: --transport shm: " << rc.status() << std::endl;
      std::exit(1);
    }
    w.clients.push_back(std::move(*rc));
  }
  static int level = 0;  // region names unique per level, as the last level's may linger
  ++level;
  for (int i = 0; i < workers; ++i) {
    const std::string name = "bench-" + std::to_string(level) + "-" + std::to_string(i);
    auto r = attn::client::BenchRegion::Create(w.clients[i % w.clients.size()].get(), kind, name,
                                               &p.attend);
    if (!r.ok()) {
      std::cerr << "attn-bench: --transport shm: region " << name << ": " << r.status()
                << std::endl;
      std::exit(1);
    }
    w.regions.push_back(std::move(*r));
  }
  return w;
}

// Before measuring through regions: one call inline and one through the region must give the
// same o, else the level's numbers would mean nothing (exits 1).
void CheckRegionAnswer(Client* client, const Payload& p, attn::client::BenchRegion* region) {
  attn::v1::AttendResponse inline_response, region_response;
  grpc::ClientContext a, b;
  client->PrepareContext(&a, std::chrono::milliseconds(120000));
  client->PrepareContext(&b, std::chrono::milliseconds(120000));
  grpc::Status st = client->stub()->Attend(&a, p.attend, &inline_response);
  if (st.ok()) st = client->stub()->Attend(&b, region->request(), &region_response);
  if (!st.ok()) {
    std::cerr << "attn-bench: region check: " << st.error_message() << std::endl;
    std::exit(1);
  }
  auto o = region->ReadOutput();
  if (!o.ok() || *o != inline_response.o().data()) {
    std::cerr << "attn-bench: region check: o in the region differs from the inline answer"
              << (o.ok() ? "" : " (" + std::string(o.status().message()) + ")") << std::endl;
    std::exit(1);
  }
}

LevelResult RunLevel(const Payload& p, const std::string& mode, int concurrency) {
  const int channels = absl::GetFlag(FLAGS_channels) > 0 ? absl::GetFlag(FLAGS_channels) : concurrency;
  auto clients = MakeClients(std::min(channels, concurrency));
  const std::string transport = absl::GetFlag(FLAGS_transport);
  const bool shm = transport != "grpc" && mode == "unary";
  auto regions = shm ? MakeRegions(clients, concurrency, p, transport) : WorkerRegions{};
  if (shm) CheckRegionAnswer(clients.front().get(), p, regions.regions.front().get());
  // The level's clock starts once its regions are set up (a second or more for 16 GPU regions
  // of 67 MB), so that neither warm-up nor measurement pays for that.
  const auto start = Clock::now();
  const auto measure_from = start + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(absl::GetFlag(FLAGS_warmup_s)));
  const auto end = measure_from + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(absl::GetFlag(FLAGS_duration_s)));
  Recorder rec(measure_from, end, absl::GetFlag(FLAGS_max_requests));
  const double rate = absl::GetFlag(FLAGS_rate);
  const double interval = rate > 0 ? concurrency / rate : 0;
  std::vector<std::thread> workers;
  for (int i = 0; i < concurrency; ++i) {
    Client* c = clients[i % clients.size()].get();
    // Spread the open-loop schedules of the workers evenly.
    const auto worker_start = start + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(interval * i / concurrency));
    if (mode == "stream") {
      workers.emplace_back(WireCoding() ? StreamWorker<WireStreamCoding> : StreamWorker<StubStreamCoding>,
                           c, std::cref(p), &rec, absl::GetFlag(FLAGS_stream_depth), interval,
                           worker_start);
    } else {
      workers.emplace_back(UnaryWorker, c, std::cref(p), mode == "echo", &rec, interval, worker_start,
                           shm ? regions.regions[i].get() : nullptr);
    }
  }
  for (auto& w : workers) w.join();
  const double measured_s =
      std::chrono::duration<double>(std::min(Clock::now(), end) - measure_from).count();
  LevelResult r;
  r.mode = shm ? transport : mode;
  r.concurrency = concurrency;
  r.offered_rate = rate;
  r.seconds = std::max(measured_s, 1e-6);
  r.tokens_per_request = p.tokens;
  if (shm) {  // the tensor bytes, which the region carries instead of the messages
    r.request_bytes = static_cast<double>(p.attend.ByteSizeLong());
    r.response_bytes = static_cast<double>(p.attend.q().data().size());
  } else if (mode == "echo") {
    r.request_bytes = static_cast<double>(p.echo.ByteSizeLong());
    r.response_bytes = static_cast<double>(p.echo.response_bytes());
  } else {
    r.request_bytes = static_cast<double>(p.attend.ByteSizeLong());
    r.response_bytes = static_cast<double>(p.attend.q().data().size());
  }
  rec.Into(&r);
  return r;
}

void PrintHeader() {
  std::printf("%-6s %5s %9s %7s %10s %10s %9s %9s %9s %9s %10s %10s %10s %7s", "mode", "conc",
              "requests", "errors", "req/s", "tokens/s", "GB/s", "p50_ms", "p90_ms", "p99_ms",
              "queue_us", "xfer_us", "compute_us", "batch");
  if (absl::GetFlag(FLAGS_compare_echo)) std::printf(" %9s %9s", "rps/echo", "p50/echo");
  if (absl::GetFlag(FLAGS_tcp_ceiling_s) > 0) std::printf(" %9s %7s", "tcp_GB/s", "x_tcp");
  std::printf("\n");
}

void PrintRow(const LevelResult& r) {
  const double gbps = r.Throughput() * (r.request_bytes + r.response_bytes) / 1e9;
  std::printf("%-6s %5d %9lld %7lld %10.1f %10.0f %9.3f %9.3f %9.3f %9.3f %10.1f %10.1f %10.1f %7.2f",
              r.mode.c_str(), r.concurrency, static_cast<long long>(r.requests),
              static_cast<long long>(r.errors), r.Throughput(), r.Throughput() * r.tokens_per_request,
              gbps, r.Percentile(0.5) / 1e3, r.Percentile(0.9) / 1e3, r.Percentile(0.99) / 1e3,
              r.Mean(&Sample::queue_us), r.Mean(&Sample::transfer_us), r.Mean(&Sample::compute_us),
              r.MeanBatch());
  if (absl::GetFlag(FLAGS_compare_echo)) {
    if (std::isnan(r.echo_rps_ratio)) {
      std::printf(" %9s %9s", "-", "-");
    } else {
      std::printf(" %9.3f %9.3f", r.echo_rps_ratio, r.echo_p50_ratio);
    }
  }
  if (absl::GetFlag(FLAGS_tcp_ceiling_s) > 0) {
    if (std::isnan(r.tcp_gbps)) {
      std::printf(" %9s %7s", "-", "-");
    } else {
      std::printf(" %9.3f %7.3f", r.tcp_gbps, r.GigabytesPerSecond() / r.tcp_gbps);
    }
  }
  std::printf("\n");
  if (r.errors > 0) std::printf("       first error: %s\n", r.first_error.c_str());
  std::fflush(stdout);
}

// A ratio for the CSV: empty when not measured (or not finite).
std::string Ratio(double v) {
  if (!std::isfinite(v)) return "";
  std::ostringstream s;
  s << v;
  return s.str();
}

// Fills the --compare_echo ratios of r (a level of the chosen mode) from echo (Echo at the same
// concurrency). A ratio is left NaN when Echo measured nothing.
void SetEchoRatios(LevelResult* r, const LevelResult& echo) {
  if (echo.requests > 0 && echo.Throughput() > 0) r->echo_rps_ratio = r->Throughput() / echo.Throughput();
  if (echo.requests > 0 && echo.Percentile(0.5) > 0 && r->requests > 0) {
    r->echo_p50_ratio = r->Percentile(0.5) / echo.Percentile(0.5);
  }
}

// Raw TCP on loopback with r's request and response bytes at r's concurrency, in GB/s (NaN when
// --tcp_ceiling_s is 0 or the measurement fails, which is reported).
double TcpCeiling(const LevelResult& r) {
  const double seconds = absl::GetFlag(FLAGS_tcp_ceiling_s);
  if (seconds <= 0 || r.request_bytes <= 0) return std::numeric_limits<double>::quiet_NaN();
  attn::client::TcpCeilingOptions o;
  o.request_bytes = static_cast<size_t>(r.request_bytes);
  o.response_bytes = std::max<size_t>(static_cast<size_t>(r.response_bytes), 1);
  o.connections = r.concurrency;
  o.seconds = seconds;
  auto t = attn::client::MeasureTcpCeiling(o);
  if (!t.ok()) {
    std::cerr << "attn-bench: tcp ceiling: " << t.status() << std::endl;
    return std::numeric_limits<double>::quiet_NaN();
  }
  return t->GigabytesPerSecond(o);
}

std::string CsvRow(const LevelResult& r, const std::string& label) {
  std::ostringstream s;
  s << r.mode << "," << r.concurrency << "," << r.offered_rate << "," << r.requests << ","
    << r.errors << "," << r.Throughput() << "," << r.Throughput() * r.tokens_per_request << ","
    << r.Throughput() * (r.request_bytes + r.response_bytes) / 1e9 << ","
    << r.Percentile(0.5) / 1e3 << "," << r.Percentile(0.9) / 1e3 << ","
    << r.Percentile(0.99) / 1e3 << "," << r.Mean(&Sample::queue_us) << ","
    << r.Mean(&Sample::transfer_us) << "," << r.Mean(&Sample::compute_us) << ","
    << r.MeanBatch() << "," << Ratio(r.echo_rps_ratio) << "," << Ratio(r.echo_p50_ratio) << ",\""
    << label << "\"," << Ratio(r.tcp_gbps);
  return s.str();
}

std::string JsonLevel(const LevelResult& r, const std::string& label) {
  std::ostringstream s;
  s << "{\"mode\":\"" << r.mode << "\",\"concurrency\":" << r.concurrency
    << ",\"rate\":" << r.offered_rate << ",\"requests\":" << r.requests
    << ",\"errors\":" << r.errors << ",\"requests_per_s\":" << r.Throughput()
    << ",\"tokens_per_s\":" << r.Throughput() * r.tokens_per_request
    << ",\"bytes_per_s\":" << r.Throughput() * (r.request_bytes + r.response_bytes)
    << ",\"p50_ms\":" << r.Percentile(0.5) / 1e3 << ",\"p90_ms\":" << r.Percentile(0.9) / 1e3
    << ",\"p99_ms\":" << r.Percentile(0.99) / 1e3
    << ",\"server_queue_us\":" << r.Mean(&Sample::queue_us)
    << ",\"server_transfer_us\":" << r.Mean(&Sample::transfer_us)
    << ",\"server_compute_us\":" << r.Mean(&Sample::compute_us)
    << ",\"batch_requests\":" << r.MeanBatch();
  if (!std::isnan(r.echo_rps_ratio)) {
    s << ",\"echo_rps_ratio\":" << r.echo_rps_ratio << ",\"echo_p50_ratio\":" << r.echo_p50_ratio;
  }
  if (!std::isnan(r.tcp_gbps)) s << ",\"tcp_gb_per_s\":" << r.tcp_gbps;
  s << ",\"label\":\"" << label << "\"}";
  return s.str();
}

// Flags that mean nothing in decode mode: an error rather than silently ignored (when set to other
// than their default; this Abseil does not say whether a flag was given).
bool RejectFlagsOfOtherModes() {
  for (const char* name : {"concurrency", "rate", "stream_depth", "seq", "kv_seq", "batch", "causal", "compare_echo"}) {
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f != nullptr && f->CurrentValue() != f->DefaultValue()) {
      std::cerr << "attn-bench: --" << name << " does not apply to --mode=decode (it takes --sessions, "
                << "--layers, --cache_tokens, --batch_step; Echo rows are always printed)" << std::endl;
      return true;
    }
  }
  return false;
}

int Decode() {
  if (RejectFlagsOfOtherModes()) return 64;
  attn::client::DecodeBenchOptions o;
  auto dtype = attn::client::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok() || *dtype == attn::client::DType::kFloat32 ||
      *dtype == attn::client::DType::kFloat8E4M3) {
    std::cerr << "attn-bench: decode: --dtype must be bf16 or fp16 (the steps' q; --kv_dtype=fp8 "
                 "for an FP8 cache)" << std::endl;
    return 64;
  }
  o.dtype = *dtype;
  const std::string kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  if (!kv_dtype.empty() && kv_dtype != "fp8") {
    std::cerr << "attn-bench: decode: --kv_dtype must be fp8 or empty, got '" << kv_dtype << "'"
              << std::endl;
    return 64;
  }
  o.kv_fp8 = kv_dtype == "fp8";
  o.target = absl::GetFlag(FLAGS_target);
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_sessions), ',')) {
    int s = 0;
    if (!absl::SimpleAtoi(part, &s) || s < 1) {
      std::cerr << "attn-bench: bad --sessions entry '" << part << "'" << std::endl;
      return 64;
    }
    o.sessions.push_back(s);
  }
  o.layers = absl::GetFlag(FLAGS_layers);
  o.heads = absl::GetFlag(FLAGS_heads);
  o.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  o.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.cache_tokens = absl::GetFlag(FLAGS_cache_tokens);
  o.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  o.batch_step = absl::GetFlag(FLAGS_batch_step);
  o.decode_window = absl::GetFlag(FLAGS_decode_window);
  o.lse = absl::GetFlag(FLAGS_lse);
  o.codings.clear();
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_step_coding), ',')) {
    if (part != "stub" && part != "wire" && part != "protobuf" && part != "shm" && part != "gpu") {
      std::cerr << "attn-bench: bad --step_coding entry '" << part
                << "' (stub, wire, protobuf, shm or gpu)" << std::endl;
      return 64;
    }
    o.codings.emplace_back(part);
  }
  o.duration_s = absl::GetFlag(FLAGS_duration_s);
  o.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  o.max_calls = absl::GetFlag(FLAGS_max_requests);
  o.channels = absl::GetFlag(FLAGS_channels);
  o.csv = absl::GetFlag(FLAGS_csv);
  o.json = absl::GetFlag(FLAGS_json);
  o.label = absl::GetFlag(FLAGS_label);
  if (o.layers < 1 || o.heads < 1 || o.kv_heads < 1 || o.head_dim < 1 || o.cache_tokens < 0 ||
      o.prefill_chunk < 1 || o.batch_step < 0 || o.decode_window < 1) {
    std::cerr << "attn-bench: decode: --layers, --heads, --kv_heads, --head_dim, --prefill_chunk and "
                 "--decode_window must be positive, --cache_tokens and --batch_step >= 0" << std::endl;
    return 64;
  }
  return attn::client::RunDecodeBench(o);
}

}  // namespace

int main(int argc, char** argv) {
  attn::util::SetUsageConfigForMain("client/attn_bench.cc", "attn-bench (attnd tools)");
  absl::SetProgramUsageMessage("attn-bench: load generator for attnd (see the file's header)");
  std::vector<std::string> args = attn::util::NormalizeFlagNames(argc, argv);
  std::vector<char*> argp = attn::util::ArgvOf(args);
  absl::ParseCommandLine(static_cast<int>(argp.size()), argp.data());
  // The distribution's abseil is built with its debug checks: every absl::Mutex lock (gRPC's
  // included) would consult a process-wide deadlock graph under a global lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "unary" && mode != "stream" && mode != "echo" && mode != "decode") {
    std::cerr << "attn-bench: --mode must be unary, stream, echo or decode" << std::endl;
    return 64;
  }
  const std::string coding = absl::GetFlag(FLAGS_client_coding);
  if (coding != "wire" && coding != "protobuf") {
    std::cerr << "attn-bench: --client_coding must be wire or protobuf" << std::endl;
    return 64;
  }
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "grpc" && transport != "shm" && transport != "cuda-ipc") {
    std::cerr << "attn-bench: --transport must be grpc, shm or cuda-ipc" << std::endl;
    return 64;
  }
  if (transport != "grpc" && mode != "unary") {
    std::cerr << "attn-bench: --transport " << transport << " needs --mode unary" << std::endl;
    return 64;
  }
  if (transport == "cuda-ipc" && !attn::client::BenchGpuRegionsAvailable()) {
    std::cerr << "attn-bench: this attn-bench was built without CUDA: no --transport cuda-ipc"
              << std::endl;
    return 64;
  }
  if (mode == "decode") return Decode();
  const std::string kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  if (!kv_dtype.empty() && kv_dtype != "fp8") {
    std::cerr << "attn-bench: --kv_dtype must be fp8 or empty, got '" << kv_dtype << "'" << std::endl;
    return 64;
  }
  if ((!kv_dtype.empty() || absl::GetFlag(FLAGS_dtype) == "fp8") && transport != "grpc") {
    std::cerr << "attn-bench: FP8 tensors travel in the request (--transport grpc)" << std::endl;
    return 64;
  }
  std::vector<int> levels;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_concurrency), ',')) {
    int c = 0;
    if (!absl::SimpleAtoi(part, &c) || c < 1) {
      std::cerr << "attn-bench: bad --concurrency entry '" << part << "'" << std::endl;
      return 64;
    }
    levels.push_back(c);
  }
  const Payload payload = BuildPayload();
  const std::string label = absl::GetFlag(FLAGS_label);
  std::printf("attn-bench: %s to %s, request %.2f MB (%g query tokens), response %.2f MB, "
              "client coding %s\n",
              mode.c_str(), absl::GetFlag(FLAGS_target).c_str(),
              payload.attend.ByteSizeLong() / 1e6, payload.tokens,
              payload.attend.q().data().size() / 1e6,
              (mode == "unary" && transport == "grpc") || mode == "echo" || mode == "stream"
                  ? coding.c_str()
                  : "protobuf (stub)");
  PrintHeader();
  const bool compare_echo = absl::GetFlag(FLAGS_compare_echo) && mode != "echo";
  if (absl::GetFlag(FLAGS_compare_echo) && mode == "echo") {
    std::cerr << "attn-bench: --compare_echo with --mode=echo compares Echo with itself; ignored"
              << std::endl;
  }
  std::vector<LevelResult> results;
  int64_t errors = 0;
  for (int c : levels) {
    LevelResult r = RunLevel(payload, mode, c);
    errors += r.errors;
    if (r.mode == "unary" || r.mode == "stream" || r.mode == "echo") r.tcp_gbps = TcpCeiling(r);
    if (compare_echo) {
      // The same bytes through Echo at the same concurrency (and --rate), right after.
      LevelResult echo = RunLevel(payload, "echo", c);
      errors += echo.errors;
      echo.tcp_gbps = r.tcp_gbps;  // the same bytes each way
      SetEchoRatios(&r, echo);
      PrintRow(r);
      PrintRow(echo);
      results.push_back(std::move(r));
      results.push_back(std::move(echo));
    } else {
      PrintRow(r);
      results.push_back(std::move(r));
    }
  }
  if (const std::string csv = absl::GetFlag(FLAGS_csv); !csv.empty()) {
    const std::string header =
        "mode,concurrency,rate,requests,errors,requests_per_s,tokens_per_s,gb_per_s,p50_ms,"
        "p90_ms,p99_ms,server_queue_us,server_transfer_us,server_compute_us,batch_requests,"
        "echo_rps_ratio,echo_p50_ratio,label,tcp_gb_per_s";
    std::string first_line;
    const bool fresh = !std::getline(std::ifstream(csv) >> std::ws, first_line);
    if (!fresh && first_line != header) {
      std::cerr << "attn-bench: " << csv << " has another header (an older attn-bench?); "
                << "appending rows with the columns " << header << std::endl;
    }
    std::ofstream out(csv, std::ios::app);
    if (fresh) out << header << "\n";
    for (const auto& r : results) out << CsvRow(r, label) << "\n";
  }
  if (const std::string json = absl::GetFlag(FLAGS_json); !json.empty()) {
    std::ofstream out(json);
    out << "[";
    for (size_t i = 0; i < results.size(); ++i) out << (i ? ",\n" : "\n") << JsonLevel(results[i], label);
    out << "\n]\n";
  }
  return errors > 0 ? 1 : 0;
}
