#include "bench_decode.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef ATTN_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/str_cat.h"
#include "attn/client/host_region.h"
#include "attn/client/region_client.h"
#include "attn/client/session.h"

namespace attn::client {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct CallSample {
  // Client latency and the server's timing of the call's first step (ServerTiming): queue,
  // kernel, device copies, and arrival to response ready (the rest of total_us is host work).
  double latency_us, queue_us = 0, compute_us = 0, transfer_us = 0, total_us = 0;
};

// One row: a decode run or its Echo twin.
struct Row {
  std::string mode;  // "step", "batch_step" (each maybe with "/wire" or "/protobuf") or "echo"
  int sessions = 0, callers = 0;
  double steps_per_call = 0;  // mean items of a call
  int64_t calls = 0, steps = 0, errors = 0;
  std::string first_error;
  double seconds = 1;
  double kv_bytes = 0;       // K and V bytes the measured steps read (decode rows)
  double cached_tokens = 0;  // sum over the measured steps of the cache length after the step
  double request_bytes = 0, response_bytes = 0;  // per call
  std::vector<CallSample> samples;
  double echo_steps_ratio = kNaN, echo_p50_ratio = kNaN;

  bool decode() const { return mode.rfind("echo", 0) != 0; }
  double StepsPerS() const { return steps / seconds; }
  double CallsPerS() const { return calls / seconds; }
  double MeanCache() const { return steps > 0 ? cached_tokens / steps : 0; }
  double KvBytesPerS() const { return kv_bytes / seconds; }
  double Percentile(double p) const {
    if (samples.empty()) return 0;
    std::vector<double> l;
    for (const auto& s : samples) l.push_back(s.latency_us);
    const size_t k = std::min(l.size() - 1, static_cast<size_t>(p * l.size()));
    std::nth_element(l.begin(), l.begin() + k, l.end());
    return l[k];
  }
  double Mean(double CallSample::*field) const {
    double s = 0;
    for (const auto& x : samples) s += x.*field;
    return samples.empty() ? 0 : s / samples.size();
  }
};

// The outcome of one call, as the recorder takes it.
struct CallOutcome {
  int ok_steps = 0, failed_steps = 0;
  double kv_bytes = 0, cached_tokens = 0;
  const v1::ServerTiming* timing = nullptr;  // of the call's first successful step
  std::string error;                         // the first failure's message
};

class Recorder {
 public:
  Recorder(Clock::time_point from, Clock::time_point end, int64_t max_calls)
      : from_(from), end_(end), max_(max_calls) {}
  bool Running() const { return Clock::now() < end_ && !(max_ > 0 && measured_.load() >= max_); }
  void Record(Clock::time_point sent, Clock::time_point done, const CallOutcome& c) {
    if (sent < from_ || done > end_) return;
    ++measured_;
    std::lock_guard<std::mutex> lock(mu_);
    row_.steps += c.ok_steps;
    row_.errors += c.failed_steps;
    if (!c.error.empty() && row_.first_error.empty()) row_.first_error = c.error;
    if (c.ok_steps == 0) return;
    ++row_.calls;
    row_.kv_bytes += c.kv_bytes;
    row_.cached_tokens += c.cached_tokens;
    CallSample s{std::chrono::duration<double, std::micro>(done - sent).count()};
    if (c.timing) {
      s.queue_us = c.timing->queue_us();
      s.compute_us = c.timing->compute_us();
      s.transfer_us = c.timing->transfer_us();
      s.total_us = c.timing->total_us();
    }
    row_.samples.push_back(s);
  }
  // A failure outside the measured calls (a truncate between them): counted, not timed.
  void RecordError(const std::string& error) {
    std::lock_guard<std::mutex> lock(mu_);
    ++row_.errors;
    if (row_.first_error.empty()) row_.first_error = error;
  }
  Row Take(double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    row_.seconds = std::max(seconds, 1e-6);
    return std::move(row_);
  }

 private:
  const Clock::time_point from_, end_;
  const int64_t max_;
  std::atomic<int64_t> measured_{0};
  std::mutex mu_;
  Row row_;
};

// A caller's decode calls through same-host regions (codings shm and gpu): one region holding,
// per layer and session, the step's q, k_new and v_new and room for its o (and lse), and the
// requests (built once) that name those slices instead of carrying bytes. shm: a host memfd
// region whose inputs the caller writes before each call (the one copy a client that produces
// them on the host pays); gpu: GPU memory of device 0 shared by a CUDA IPC handle, written once
// (a model's tensors already live there).
struct RegionCoding {
  std::unique_ptr<RegionClient> regions;
  std::unique_ptr<HostRegion> host;
  void* device = nullptr;
  std::string name;
  std::vector<v1::StepRequest> step;        // per layer (Step mode)
  std::vector<v1::BatchStepRequest> batch;  // per layer (BatchStep mode)
  std::vector<v1::EchoRequest> echo;        // per layer: a call of the same (tensor-free) size
  // Per layer, where each session's inputs go in the region, and the bytes written there.
  std::vector<std::vector<std::pair<uint64_t, std::string>>> writes;

  ~RegionCoding() {
#ifdef ATTN_BENCH_CUDA
    if (device != nullptr) {
      if (regions) (void)regions->Unregister(name);  // attnd closes its import before the free
      cudaFree(device);
    }
#endif
  }
  // Copies the inputs of layer's call into a host region (nothing for a GPU region).
  void WriteInputs(int layer) {
    if (!host) return;
    for (const auto& [at, bytes] : writes[layer]) std::memcpy(host->data() + at, bytes.data(), bytes.size());
  }
};

bool RegionCodingName(const std::string& coding) { return coding == "shm" || coding == "gpu"; }

// One caller: its sessions (all on one replica), the requests it sends per layer, prebuilt.
struct Caller {
  std::shared_ptr<SessionClient> sessions;
  std::shared_ptr<Client> client;  // the replica holding the sessions
  std::vector<std::string> ids;
  std::vector<v1::StepRequest> step;        // per layer (Step mode)
  std::vector<v1::BatchStepRequest> batch;  // per layer (BatchStep mode)
  std::vector<v1::EchoRequest> echo;        // per layer: the same bytes through Echo
  // Per layer, the steps of one call (the same as step and batch), for the library's codings.
  std::vector<std::vector<StepInput>> inputs;
  // The replica again, through the library's wire coding and its protobuf coding.
  std::shared_ptr<Client> wire, protobuf;
  std::map<std::string, std::unique_ptr<RegionCoding>> region;  // by coding (shm, gpu)
  absl::Status status;                      // of the setup
};

class DecodeBench {
 public:
  explicit DecodeBench(const DecodeBenchOptions& o) : o_(o) {}
  int Run();

 private:
  Tensor Random(int64_t tokens, int heads) {
    std::uniform_real_distribution<float> dist(-1, 1);
    std::vector<float> v(size_t(tokens) * heads * o_.head_dim);
    for (float& x : v) x = dist(rng_);
    return Tensor::FromFloats(o_.dtype, {tokens, heads, o_.head_dim}, v);
  }
  double KvBytesPerToken() const {
    return 2.0 * o_.kv_heads * o_.head_dim * DTypeBytes(o_.kv_fp8 ? DType::kFloat8E4M3 : o_.dtype);
  }
  StepInput DecodeInput(const std::string& id, int layer);
  absl::Status Setup(Caller& c, int first, int count);
  absl::Status Prefill(Client& client, const std::string& id);
  // The chunk of n tokens at `done`: random once, then the same for every session and layer (what
  // the cache holds does not change a decode step's cost, and drawing 6M numbers per chunk under
  // one lock made the prefill of 256 sessions take minutes).
  StepInput PrefillChunk(int64_t done, int64_t n);
  void BuildRequests(Caller& c);
  // The region of coding (shm or gpu) for c's calls, and their requests.
  absl::Status SetupRegion(Caller& c, int index, const std::string& coding);
  // A Step (one) or BatchStep (many) call of `items` steps.
  CallOutcome Tally(const grpc::Status& st, int items, const v1::StepResponse* one,
                    const v1::BatchStepResponse* many);
  // The same for a call through the client library.
  CallOutcome TallyResults(const absl::StatusOr<std::vector<absl::StatusOr<StepResult>>>& results,
                           int items);
  // One decode call of the caller's layer `layer` coded as `coding` (DecodeBenchOptions::codings).
  // What a call's outcome points into (its timing), kept until it is recorded.
  struct Answers {
    v1::StepResponse one;
    v1::BatchStepResponse many;
    std::vector<absl::StatusOr<StepResult>> results;
  };
  CallOutcome DecodeCall(Caller& c, int layer, const std::string& coding, Answers* answers);
  void DecodeLoop(Caller& c, Recorder& rec, const std::string& coding);
  // Echo of each call's bytes: inline (coding empty) or those of coding's region requests.
  void EchoLoop(Caller& c, Recorder& rec, const std::string& coding);
  // coding: the decode row's (empty for the Echo row).
  Row Measure(std::vector<Caller>& callers, bool echo, const std::string& coding);
  bool RunLevel(int sessions, std::vector<Row>* rows);
  void CloseAll(std::vector<Caller>& callers);

  const DecodeBenchOptions o_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_{42};
  std::map<int64_t, StepInput> prefill_chunks_;  // by first token; guarded by rng_mu_
  double request_bytes_ = 0, response_bytes_ = 0;
};

StepInput DecodeBench::DecodeInput(const std::string& id, int layer) {
  std::lock_guard<std::mutex> lock(rng_mu_);
  StepInput in;
  in.session_id = id;
  in.layer = layer;
  in.q = Random(1, o_.heads);
  in.k_new = Random(1, o_.kv_heads);
  in.v_new = Random(1, o_.kv_heads);
  in.options.return_lse = o_.lse;
  return in;
}

StepInput DecodeBench::PrefillChunk(int64_t done, int64_t n) {
  std::lock_guard<std::mutex> lock(rng_mu_);
  auto it = prefill_chunks_.find(done);
  if (it == prefill_chunks_.end()) {
    StepInput in;
    in.q = Random(n, o_.heads);
    in.k_new = Random(n, o_.kv_heads);
    in.v_new = Random(n, o_.kv_heads);
    it = prefill_chunks_.emplace(done, std::move(in)).first;
  }
  return it->second;
}

absl::Status DecodeBench::Prefill(Client& client, const std::string& id) {
  for (int layer = 0; layer < o_.layers; ++layer) {
    for (int64_t done = 0; done < o_.cache_tokens; done += o_.prefill_chunk) {
      const int64_t n = std::min<int64_t>(o_.prefill_chunk, o_.cache_tokens - done);
      StepInput in = PrefillChunk(done, n);
      in.session_id = id;
      in.layer = layer;
      auto r = attn::client::Step(client, in, std::chrono::milliseconds(600000));
      if (!r.ok()) {
        return absl::Status(r.status().code(), absl::StrCat("prefill of session ", id, " layer ", layer, " at token ",
                                                            done, ": ", r.status().message()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeBench::Setup(Caller& c, int first, int count) {
  SessionSpec spec;
  spec.num_layers = o_.layers;
  spec.num_kv_heads = o_.kv_heads;
  spec.head_dim = o_.head_dim;
  spec.dtype = o_.dtype;
  if (o_.kv_fp8) {
    spec.cache_dtype = DType::kFloat8E4M3;
    spec.k_scales.assign(static_cast<size_t>(o_.kv_heads), kFp8BenchScale);
    spec.v_scales = spec.k_scales;
  }
  for (int i = 0; i < count; ++i) {
    // The first where the client library places it; a caller's others beside it, so that one
    // BatchStep carries them all.
    absl::StatusOr<SessionInfo> s = c.client ? CreateSession(*c.client, spec) : c.sessions->CreateSession(spec);
    if (!s.ok()) {
      return absl::Status(s.status().code(), absl::StrCat("CreateSession (session ", first + i, ") on ",
                                                          o_.target, ": ", s.status().message()));
    }
    c.ids.push_back(s->session_id);
    if (!c.client) {
      auto client = c.sessions->ClientFor(s->session_id);
      if (!client.ok()) return client.status();
      c.client = *client;
      for (const bool wire : {true, false}) {
        ClientOptions co;
        co.target = s->endpoint;
        co.max_message_bytes = 1ll << 30;
        co.unique_channel = true;
        co.connections = 1;
        co.wire_coding = wire;
        auto coded = Client::Create(co);
        if (!coded.ok()) return coded.status();
        (wire ? c.wire : c.protobuf) = std::move(*coded);
      }
    }
    if (absl::Status st = Prefill(*c.client, s->session_id); !st.ok()) return st;
  }
  BuildRequests(c);
  for (const std::string& coding : o_.codings) {
    if (!RegionCodingName(coding)) continue;
    if (absl::Status st = SetupRegion(c, first, coding); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status DecodeBench::SetupRegion(Caller& c, int index, const std::string& coding) {
  auto r = std::make_unique<RegionCoding>();
  auto regions = RegionClient::Connect(c.client.get());
  if (!regions.ok()) {
    return absl::Status(regions.status().code(),
                        absl::StrCat("--step_coding ", coding, " needs attnd --allow_shared_memory: ",
                                     regions.status().message()));
  }
  r->regions = std::move(*regions);
  r->name = absl::StrCat("decode-", coding, "-", index);
  // Each step's slices, 256-byte aligned (steps over GPU regions run in place when aligned).
  const size_t n = c.ids.size();
  const uint64_t elem = DTypeBytes(o_.dtype);
  const uint64_t q = uint64_t(o_.heads) * o_.head_dim * elem;
  const uint64_t kv = uint64_t(o_.kv_heads) * o_.head_dim * elem;
  const uint64_t lse = o_.lse ? 4 * uint64_t(o_.heads) : 0;
  auto align = [](uint64_t b) { return (b + 255) / 256 * 256; };
  const uint64_t per_step = align(q) + 2 * align(kv) + align(q) + align(lse);
  const uint64_t bytes = per_step * n * o_.layers;
  std::string initial(bytes, '\0');  // the inputs as first written (a GPU region's for good)
  r->writes.resize(o_.layers);
  for (int layer = 0; layer < o_.layers; ++layer) {
    v1::BatchStepRequest batch;
    for (size_t j = 0; j < n; ++j) {
      const StepInput& in = c.inputs[layer][j];
      const uint64_t at = per_step * (uint64_t(layer) * n + j);
      const uint64_t k_at = at + align(q), v_at = k_at + align(kv), o_at = v_at + align(kv);
      v1::StepRequest step = BuildStepRequest(in);
      std::string* q_bytes = step.mutable_q()->mutable_data();
      std::string* k_bytes = step.mutable_k_new()->mutable_data();
      std::string* v_bytes = step.mutable_v_new()->mutable_data();
      for (const auto& [offset, data] : {std::pair{at, q_bytes}, std::pair{k_at, k_bytes},
                                         std::pair{v_at, v_bytes}}) {
        std::memcpy(initial.data() + offset, data->data(), data->size());
        r->writes[layer].emplace_back(offset, std::move(*data));
      }
      step.mutable_q()->clear_data();
      step.mutable_k_new()->clear_data();
      step.mutable_v_new()->clear_data();
      *step.mutable_q()->mutable_region() = RegionSliceOf(r->name, at, q);
      *step.mutable_k_new()->mutable_region() = RegionSliceOf(r->name, k_at, kv);
      *step.mutable_v_new()->mutable_region() = RegionSliceOf(r->name, v_at, kv);
      *step.mutable_o_region() = RegionSliceOf(r->name, o_at, q);
      if (o_.lse) *step.mutable_lse_region() = RegionSliceOf(r->name, o_at + align(q), lse);
      *batch.add_steps() = step;
      if (o_.batch_step == 0) r->step.push_back(std::move(step));
    }
    // Echo: a call of the same size both ways (the request, and an answer of n responses
    // without data: each its o and lse shapes and slices, its timing and cached_tokens).
    v1::StepResponse answer;
    answer.mutable_o()->set_dtype(batch.steps(0).q().dtype());
    *answer.mutable_o()->mutable_shape() = batch.steps(0).q().shape();
    *answer.mutable_o()->mutable_region() = batch.steps(0).o_region();
    answer.set_cached_tokens(o_.cache_tokens + o_.decode_window);
    answer.mutable_timing()->set_queue_us(12.5);
    answer.mutable_timing()->set_compute_us(21.25);
    answer.mutable_timing()->set_total_us(80.5);
    answer.mutable_timing()->set_batch_requests(static_cast<int32_t>(n));
    v1::EchoRequest e;
    if (o_.batch_step > 0) {
      e.set_payload(batch.SerializeAsString());
      v1::BatchStepResponse all;
      for (size_t j = 0; j < n; ++j) *all.add_results()->mutable_response() = answer;
      e.set_response_bytes(static_cast<int64_t>(all.ByteSizeLong()));
      r->batch.push_back(std::move(batch));
    } else {
      e.set_payload(r->step.back().SerializeAsString());
      e.set_response_bytes(static_cast<int64_t>(answer.ByteSizeLong()));
    }
    r->echo.push_back(std::move(e));
  }
  if (coding == "shm") {
    auto host = HostRegion::Create(bytes);
    if (!host.ok()) return host.status();
    r->host = std::move(*host);
    std::memcpy(r->host->data(), initial.data(), bytes);
    auto info = r->regions->Register(r->name, *r->host);
    if (!info.ok()) return info.status();
  } else {
#ifdef ATTN_BENCH_CUDA
    if (cudaSetDevice(0) != cudaSuccess || cudaMalloc(&r->device, bytes) != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes failed"));
    }
    if (cudaMemcpy(r->device, initial.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      return absl::InternalError("cudaMemcpy into the GPU region failed");
    }
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, r->device) != cudaSuccess) {
      return absl::InternalError("cudaIpcGetMemHandle failed");
    }
    auto info = r->regions->RegisterCuda(
        r->name, std::string(reinterpret_cast<const char*>(&h), sizeof(h)), 0, bytes);
    if (!info.ok()) return info.status();
#else
    return absl::UnimplementedError("this attn-bench was built without CUDA: no --step_coding gpu");
#endif
  }
  c.region[coding] = std::move(r);
  return absl::OkStatus();
}

void DecodeBench::BuildRequests(Caller& c) {
  for (int layer = 0; layer < o_.layers; ++layer) {
    std::string payload;
    std::vector<StepInput>& inputs = c.inputs.emplace_back();
    for (const auto& id : c.ids) inputs.push_back(DecodeInput(id, layer));
    if (o_.batch_step > 0) {
      v1::BatchStepRequest b;
      for (const StepInput& in : inputs) *b.add_steps() = BuildStepRequest(in);
      b.SerializeToString(&payload);
      c.batch.push_back(std::move(b));
    } else {
      c.step.push_back(BuildStepRequest(inputs.front()));
      c.step.back().SerializeToString(&payload);
    }
    // Echo: the serialized request out, the o (and lse) bytes of its answer back.
    const double o_bytes = double(c.ids.size()) * o_.heads * o_.head_dim * DTypeBytes(o_.dtype);
    const double lse_bytes = o_.lse ? double(c.ids.size()) * o_.heads * 4 : 0;
    v1::EchoRequest e;
    e.set_response_bytes(static_cast<int64_t>(o_bytes + lse_bytes));
    *e.mutable_payload() = std::move(payload);
    c.echo.push_back(std::move(e));
  }
}

CallOutcome DecodeBench::Tally(const grpc::Status& st, int items, const v1::StepResponse* one,
                               const v1::BatchStepResponse* many) {
  CallOutcome out;
  if (!st.ok()) {
    out.failed_steps = items;
    out.error = absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())), ": ",
                             st.error_message());
    return out;
  }
  auto add = [&](const v1::StepResponse& r) {
    ++out.ok_steps;
    out.kv_bytes += double(r.cached_tokens()) * KvBytesPerToken();
    out.cached_tokens += double(r.cached_tokens());
    if (!out.timing) out.timing = &r.timing();
  };
  if (one) {
    add(*one);
    return out;
  }
  for (const auto& item : many->results()) {
    if (item.status_code() == 0) {
      add(item.response());
    } else {
      ++out.failed_steps;
      if (out.error.empty()) {
        out.error = absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(item.status_code())), ": ",
                                 item.status_message());
      }
    }
  }
  return out;
}

CallOutcome DecodeBench::TallyResults(
    const absl::StatusOr<std::vector<absl::StatusOr<StepResult>>>& results, int items) {
  CallOutcome out;
  if (!results.ok()) {
    out.failed_steps = items;
    out.error = results.status().ToString();
    return out;
  }
  for (const auto& r : *results) {
    if (r.ok()) {
      ++out.ok_steps;
      out.kv_bytes += double(r->cached_tokens) * KvBytesPerToken();
      out.cached_tokens += double(r->cached_tokens);
      if (!out.timing) out.timing = &r->timing;
    } else {
      ++out.failed_steps;
      if (out.error.empty()) out.error = r.status().ToString();
    }
  }
  return out;
}

CallOutcome DecodeBench::DecodeCall(Caller& c, int layer, const std::string& coding,
                                    Answers* answers) {
  constexpr std::chrono::milliseconds kTimeout(120000);
  const bool batch = o_.batch_step > 0;
  const int items = static_cast<int>(c.ids.size());
  if (coding == "stub") {
    grpc::ClientContext ctx;
    c.client->PrepareContext(&ctx, kTimeout);
    const grpc::Status st =
        batch ? c.client->stub()->BatchStep(&ctx, c.batch[layer], &answers->many)
              : c.client->stub()->Step(&ctx, c.step[layer], &answers->one);
    return Tally(st, items, batch ? nullptr : &answers->one, batch ? &answers->many : nullptr);
  }
  if (RegionCodingName(coding)) {
    RegionCoding& r = *c.region.at(coding);
    r.WriteInputs(layer);
    grpc::ClientContext ctx;
    c.client->PrepareContext(&ctx, kTimeout);
    const grpc::Status st = batch ? c.client->stub()->BatchStep(&ctx, r.batch[layer], &answers->many)
                                  : c.client->stub()->Step(&ctx, r.step[layer], &answers->one);
    return Tally(st, items, batch ? nullptr : &answers->one, batch ? &answers->many : nullptr);
  }
  Client& client = coding == "wire" ? *c.wire : *c.protobuf;
  std::vector<absl::StatusOr<StepResult>>& results = answers->results;
  results.clear();
  if (batch) {
    auto all = BatchStep(client, c.inputs[layer], kTimeout);
    if (!all.ok()) return TallyResults(all.status(), items);
    results = std::move(*all);
  } else {
    auto one = Step(client, c.inputs[layer].front(), kTimeout);
    if (!one.ok()) return TallyResults(one.status(), items);
    results.push_back(std::move(*one));
  }
  return TallyResults(results, items);
}

void DecodeBench::DecodeLoop(Caller& c, Recorder& rec, const std::string& coding) {
  Answers answers;
  int rounds = 0;
  for (int64_t k = 0; rec.Running(); ++k) {
    const int layer = static_cast<int>(k % o_.layers);
    const Clock::time_point sent = Clock::now();
    const CallOutcome outcome = DecodeCall(c, layer, coding, &answers);
    rec.Record(sent, Clock::now(), outcome);
    if (layer != o_.layers - 1 || ++rounds < o_.decode_window) continue;
    // Every layer has decode_window more tokens: back to cache_tokens (not timed).
    rounds = 0;
    for (const auto& id : c.ids) {
      auto t = TruncateSession(*c.client, id, o_.decode_window);
      if (!t.ok()) rec.RecordError(absl::StrCat("TruncateSession: ", t.status().ToString()));
    }
  }
}

void DecodeBench::EchoLoop(Caller& c, Recorder& rec, const std::string& coding) {
  v1::EchoResponse response;
  const std::vector<v1::EchoRequest>& echo = coding.empty() ? c.echo : c.region.at(coding)->echo;
  for (int64_t k = 0; rec.Running(); ++k) {
    const int layer = static_cast<int>(k % o_.layers);
    grpc::ClientContext ctx;
    c.client->PrepareContext(&ctx, std::chrono::milliseconds(120000));
    const Clock::time_point sent = Clock::now();
    const grpc::Status st = c.client->stub()->Echo(&ctx, echo[layer], &response);
    CallOutcome outcome;
    if (st.ok()) {
      outcome.ok_steps = static_cast<int>(c.ids.size());
    } else {
      outcome.failed_steps = static_cast<int>(c.ids.size());
      outcome.error = st.error_message();
    }
    rec.Record(sent, Clock::now(), outcome);
  }
}

Row DecodeBench::Measure(std::vector<Caller>& callers, bool echo, const std::string& coding) {
  const auto start = Clock::now();
  const auto from = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.warmup_s));
  const auto end = from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.duration_s));
  Recorder rec(from, end, o_.max_calls);
  std::vector<std::thread> threads;
  for (auto& c : callers) {
    threads.emplace_back(
        [&, echo] { echo ? EchoLoop(c, rec, coding) : DecodeLoop(c, rec, coding); });
  }
  for (auto& t : threads) t.join();
  Row r = rec.Take(std::chrono::duration<double>(std::min(Clock::now(), end) - from).count());
  r.mode = echo ? "echo" : (o_.batch_step > 0 ? "batch_step" : "step");
  if (!coding.empty() && coding != "stub") r.mode += "/" + coding;
  r.callers = static_cast<int>(callers.size());
  double items = 0, req = 0, resp = 0;
  for (const auto& c : callers) {
    items += double(c.ids.size());
    const bool region = RegionCodingName(coding);
    for (const auto& e : region ? c.region.at(coding)->echo : c.echo) {
      req += double(e.payload().size());
      resp += double(e.response_bytes());
    }
  }
  r.sessions = static_cast<int>(items);
  r.steps_per_call = items / callers.size();
  r.request_bytes = req / (callers.size() * o_.layers);
  r.response_bytes = resp / (callers.size() * o_.layers);
  return r;
}

void DecodeBench::CloseAll(std::vector<Caller>& callers) {
  for (auto& c : callers) {
    for (const auto& id : c.ids) {
      if (auto st = c.sessions->CloseSession(id); !st.ok()) {
        std::cerr << "attn-bench: closing session " << id << ": " << st.status() << std::endl;
      }
    }
  }
}

std::string Fixed(double v, int precision) {
  if (!std::isfinite(v)) return "-";
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(precision);
  s << v;
  return s.str();
}

void PrintHeader() {
  std::printf("%-19s %5s %7s %8s %9s %7s %10s %10s %8s %8s %9s %10s %8s %9s %7s %8s %10s %9s\n", "mode",
              "sess", "callers", "per_call", "calls", "errors", "steps/s", "tokens/s", "p50_ms", "p99_ms",
              "queue_us", "compute_us", "xfer_us", "server_us", "cache", "KV_GB/s", "steps/echo", "p50/echo");
}

void PrintRow(const Row& r, int layers) {
  auto server_mean = [&](double CallSample::*field, int width) {
    return r.decode() ? Fixed(r.Mean(field), width) : std::string("-");
  };
  std::printf("%-19s %5d %7d %8.1f %9lld %7lld %10.1f %10.1f %8.3f %8.3f %9s %10s %8s %9s %7s %8s %10s %9s\n",
              r.mode.c_str(), r.sessions, r.callers, r.steps_per_call, static_cast<long long>(r.calls),
              static_cast<long long>(r.errors), r.StepsPerS(), r.StepsPerS() / layers, r.Percentile(0.5) / 1e3,
              r.Percentile(0.99) / 1e3, server_mean(&CallSample::queue_us, 1).c_str(),
              server_mean(&CallSample::compute_us, 1).c_str(), server_mean(&CallSample::transfer_us, 1).c_str(),
              server_mean(&CallSample::total_us, 1).c_str(), r.decode() ? Fixed(r.MeanCache(), 0).c_str() : "-",
              r.decode() ? Fixed(r.KvBytesPerS() / 1e9, 3).c_str() : "-", Fixed(r.echo_steps_ratio, 3).c_str(),
              Fixed(r.echo_p50_ratio, 3).c_str());
  if (r.errors > 0) std::printf("           first error: %s\n", r.first_error.c_str());
  std::fflush(stdout);
}

std::string Num(double v) {
  if (!std::isfinite(v)) return "";
  std::ostringstream s;
  s.precision(10);
  s << v;
  return s.str();
}

const char* kCsvHeader =
    "mode,sessions,callers,layers,steps_per_call,cache_tokens,calls,steps,errors,calls_per_s,steps_per_s,"
    "tokens_per_s,p50_ms,p90_ms,p99_ms,server_queue_us,server_compute_us,server_transfer_us,server_total_us,"
    "mean_cache_tokens,kv_bytes_per_s,"
    "request_bytes,response_bytes,echo_steps_ratio,echo_p50_ratio,label";

std::string CsvRow(const Row& r, const DecodeBenchOptions& o) {
  std::ostringstream s;
  s.precision(10);
  s << r.mode << "," << r.sessions << "," << r.callers << "," << o.layers << "," << r.steps_per_call << ","
    << o.cache_tokens << "," << r.calls << "," << r.steps << "," << r.errors << "," << r.CallsPerS() << ","
    << r.StepsPerS() << "," << r.StepsPerS() / o.layers << "," << r.Percentile(0.5) / 1e3 << ","
    << r.Percentile(0.9) / 1e3 << "," << r.Percentile(0.99) / 1e3 << ","
    << (r.decode() ? Num(r.Mean(&CallSample::queue_us)) : "") << ","
    << (r.decode() ? Num(r.Mean(&CallSample::compute_us)) : "") << ","
    << (r.decode() ? Num(r.Mean(&CallSample::transfer_us)) : "") << ","
    << (r.decode() ? Num(r.Mean(&CallSample::total_us)) : "") << "," << (r.decode() ? Num(r.MeanCache()) : "")
    << "," << (r.decode() ? Num(r.KvBytesPerS()) : "") << "," << r.request_bytes << "," << r.response_bytes << ","
    << Num(r.echo_steps_ratio) << "," << Num(r.echo_p50_ratio) << ",\"" << o.label << "\"";
  return s.str();
}

std::string JsonRow(const Row& r, const DecodeBenchOptions& o) {
  std::ostringstream s;
  s.precision(10);
  s << "{\"mode\":\"" << r.mode << "\",\"sessions\":" << r.sessions << ",\"callers\":" << r.callers
    << ",\"layers\":" << o.layers << ",\"steps_per_call\":" << r.steps_per_call
    << ",\"cache_tokens\":" << o.cache_tokens << ",\"calls\":" << r.calls << ",\"steps\":" << r.steps
    << ",\"errors\":" << r.errors << ",\"calls_per_s\":" << r.CallsPerS() << ",\"steps_per_s\":" << r.StepsPerS()
    << ",\"tokens_per_s\":" << r.StepsPerS() / o.layers << ",\"p50_ms\":" << r.Percentile(0.5) / 1e3
    << ",\"p90_ms\":" << r.Percentile(0.9) / 1e3 << ",\"p99_ms\":" << r.Percentile(0.99) / 1e3
    << ",\"request_bytes\":" << r.request_bytes << ",\"response_bytes\":" << r.response_bytes;
  if (r.decode()) {
    s << ",\"server_queue_us\":" << r.Mean(&CallSample::queue_us)
      << ",\"server_compute_us\":" << r.Mean(&CallSample::compute_us)
      << ",\"server_transfer_us\":" << r.Mean(&CallSample::transfer_us)
      << ",\"server_total_us\":" << r.Mean(&CallSample::total_us) << ",\"mean_cache_tokens\":" << r.MeanCache()
      << ",\"kv_bytes_per_s\":" << r.KvBytesPerS();
  }
  if (std::isfinite(r.echo_steps_ratio)) {
    s << ",\"echo_steps_ratio\":" << r.echo_steps_ratio << ",\"echo_p50_ratio\":" << r.echo_p50_ratio;
  }
  s << ",\"label\":\"" << o.label << "\"}";
  return s.str();
}

bool DecodeBench::RunLevel(int sessions, std::vector<Row>* rows) {
  const int per_caller = o_.batch_step > 0 ? o_.batch_step : 1;
  const int n_callers = (sessions + per_caller - 1) / per_caller;
  const int n_channels = o_.channels > 0 ? std::min(o_.channels, n_callers) : n_callers;
  std::vector<std::shared_ptr<SessionClient>> channels;
  for (int i = 0; i < n_channels; ++i) {
    SessionClientOptions so;
    so.client.target = o_.target;
    so.client.max_message_bytes = 1ll << 30;
    so.client.unique_channel = true;  // a connection per channel, as the other modes have
    auto sc = SessionClient::Create(so);
    if (!sc.ok()) {
      std::cerr << "attn-bench: decode: " << sc.status() << std::endl;
      return false;
    }
    channels.push_back(std::move(*sc));
  }
  std::vector<Caller> callers(n_callers);
  std::vector<std::thread> setup;
  for (int i = 0; i < n_callers; ++i) {
    callers[i].sessions = channels[i % n_channels];
    const int first = i * per_caller, count = std::min(per_caller, sessions - first);
    setup.emplace_back([&, i, first, count] { callers[i].status = Setup(callers[i], first, count); });
  }
  for (auto& t : setup) t.join();
  for (const auto& c : callers) {
    if (!c.status.ok()) {
      std::cerr << "attn-bench: decode: " << absl::StatusCodeToString(c.status.code()) << ": " << c.status.message()
                << std::endl;
      CloseAll(callers);
      return false;
    }
  }
  std::vector<Row> decode;
  for (const std::string& coding : o_.codings) decode.push_back(Measure(callers, false, coding));
  // The Echo twin of the inline codings (the calls' bytes), and of each region coding (calls of
  // the same tensor-free size).
  std::map<std::string, Row> echoes;
  for (const std::string& coding : o_.codings) {
    const std::string twin = RegionCodingName(coding) ? coding : "";
    if (!echoes.count(twin)) echoes.emplace(twin, Measure(callers, true, twin));
  }
  CloseAll(callers);
  for (auto& c : callers) c.region.clear();
  for (size_t i = 0; i < decode.size(); ++i) {
    Row& d = decode[i];
    const Row& echo = echoes.at(RegionCodingName(o_.codings[i]) ? o_.codings[i] : "");
    if (echo.steps > 0 && d.steps > 0) {
      d.echo_steps_ratio = d.StepsPerS() / echo.StepsPerS();
      d.echo_p50_ratio = d.Percentile(0.5) / echo.Percentile(0.5);
    }
    PrintRow(d, o_.layers);
    rows->push_back(std::move(d));
  }
  for (auto& [twin, echo] : echoes) {
    PrintRow(echo, o_.layers);
    rows->push_back(std::move(echo));
  }
  return true;
}

int DecodeBench::Run() {
  std::printf("attn-bench: decode to %s: %d layers, %d/%d heads x %d, %s%s, cache %lld tokens (+ up to %d "
              "before truncating back), %s\n",
              o_.target.c_str(), o_.layers, o_.heads, o_.kv_heads, o_.head_dim,
              o_.dtype == DType::kFloat16 ? "fp16" : "bf16", o_.kv_fp8 ? " with an FP8 E4M3 KV cache" : "",
              static_cast<long long>(o_.cache_tokens),
              o_.decode_window,
              o_.batch_step > 0 ? absl::StrCat("BatchStep of up to ", o_.batch_step, " sessions").c_str()
                                : "Step, one caller per session");
  PrintHeader();
  std::vector<Row> rows;
  bool ok = true;
  for (int s : o_.sessions) {
    if (!RunLevel(s, &rows)) {
      ok = false;
      break;
    }
  }
  int64_t errors = 0;
  for (const auto& r : rows) errors += r.errors;
  if (!o_.csv.empty()) {
    std::string first_line;
    const bool fresh = !std::getline(std::ifstream(o_.csv) >> std::ws, first_line);
    if (!fresh && first_line != kCsvHeader) {
      std::cerr << "attn-bench: " << o_.csv << " has another header (another mode?); appending rows with the "
                << "columns " << kCsvHeader << std::endl;
    }
    std::ofstream out(o_.csv, std::ios::app);
    if (fresh) out << kCsvHeader << "\n";
    for (const auto& r : rows) out << CsvRow(r, o_) << "\n";
  }
  if (!o_.json.empty()) {
    std::ofstream out(o_.json);
    out << "[";
    for (size_t i = 0; i < rows.size(); ++i) out << (i ? ",\n" : "\n") << JsonRow(rows[i], o_);
    out << "\n]\n";
  }
  return ok && errors == 0 ? 0 : 1;
}

}  // namespace

int RunDecodeBench(const DecodeBenchOptions& options) { return DecodeBench(options).Run(); }

}  // namespace attn::client
