// attn-engine-bench: the serving engine without the network. Closed-loop callers submit Attend
// jobs straight to the batcher and the CUDA backend (validation, pinned staging, batching,
// stream lanes, completion), the path a gRPC handler takes after its request is decoded. Each
// comparison runs its two configurations in one process on the same inputs and prints both with
// their ratio: what batching and several streams buy the engine itself, apart from the transport.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "rpc/attend_validation.h"
#include "attn/util/usage.h"
#include "attn/kernels/dtype_convert.h"
#include "engine/batcher.h"
#include "backends/cuda_backend.h"
#include "common/status_util.h"

ABSL_FLAG(std::string, compare, "batching",
          "batching: max_batch_tokens 16384 vs one request per launch; "
          "streams: --streams 4 vs 1");
ABSL_FLAG(int, seq, 128, "Query and key tokens per request");
ABSL_FLAG(int, heads, 16, "Query heads");
ABSL_FLAG(int, kv_heads, 16, "Key/value heads");
ABSL_FLAG(int, head_dim, 128, "Head dim");
ABSL_FLAG(int, concurrency, 64, "Callers, each with one request in flight");
ABSL_FLAG(int, streams, 2, "CUDA streams for the batching comparison");
ABSL_FLAG(double, duration_s, 5, "Measured seconds per configuration");
ABSL_FLAG(double, warmup_s, 1, "Unmeasured seconds before each configuration");

namespace attn {
namespace {

using Seconds = std::chrono::duration<double>;

struct Config {
  std::string label;
  int streams = 2;
  int64_t max_batch_tokens = 16384;
};

// Per-request figures are means over the measured requests; a launch's kernel and transfer time
// is shared among its requests.
struct Result {
  double requests_per_s = 0;
  double gb_per_s = 0;  // request bytes in and out
  double kernel_us = 0;
  double transfer_us = 0;
  double host_copy_us = 0;
  double queue_us = 0;
  double requests_per_launch = 0;
  double gpu_busy = 0;  // kernel and copy time of all launches / wall time
  int64_t errors = 0;
};

v1::AttendRequest MakeRequest(std::mt19937_64& rng) {
  const int s = absl::GetFlag(FLAGS_seq), d = absl::GetFlag(FLAGS_head_dim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  v1::AttendRequest r;
  const int heads[3] = {absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_kv_heads),
                        absl::GetFlag(FLAGS_kv_heads)};
  v1::Tensor* tensors[3] = {r.mutable_q(), r.mutable_k(), r.mutable_v()};
  for (int i = 0; i < 3; ++i) {
    tensors[i]->set_dtype(v1::DTYPE_BFLOAT16);
    for (int64_t dim : {int64_t{s}, int64_t{heads[i]}, int64_t{d}}) tensors[i]->add_shape(dim);
    std::string* data = tensors[i]->mutable_data();
    data->resize(size_t(s) * heads[i] * d * 2);
    uint16_t* p = reinterpret_cast<uint16_t*>(data->data());
    for (size_t e = 0; e < data->size() / 2; ++e) {
      p[e] = kernels::cpu::FloatToBf16Bits(normal(rng));
    }
  }
  return r;
}

// One caller: submits, waits for the answer, submits again, until told to stop.
class Caller {
 public:
  Caller(const v1::AttendRequest* request, Batcher* batcher, Backend* backend,
         const RequestLimits* limits)
      : request_(request), batcher_(batcher), backend_(backend), limits_(limits) {}

  void Loop(const std::atomic<bool>& stop, const std::atomic<bool>& measuring) {
    while (!stop.load()) {
      v1::AttendResponse response;
      const absl::Status st = RunOne(&response);
      if (!measuring.load()) continue;
      if (!st.ok()) {
        ++errors;
        continue;
      }
      ++completed;
      const v1::ServerTiming& t = response.timing();
      kernel_us += t.compute_us() / t.batch_requests();
      transfer_us += t.transfer_us() / t.batch_requests();
      host_copy_us += t.host_copy_us();
      queue_us += t.queue_us();
      per_launch += t.batch_requests();
    }
  }

  int64_t completed = 0, errors = 0;
  double kernel_us = 0, transfer_us = 0, host_copy_us = 0, queue_us = 0, per_launch = 0;

 private:
  absl::Status RunOne(v1::AttendResponse* response) {
    auto job = ValidateAttendRequest(*request_, *limits_);
    if (!job.ok()) return job.status();
    (*job)->arrival = Clock::now();
    (*job)->bytes = AttendJobBytes(**job, *request_);
    if (absl::Status st = backend_->Prepare(**job); !st.ok()) return st;
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
    absl::Status result;
    AttendJob* raw = job->get();
    (*job)->done = [&, raw](absl::Status st) {
      v1::ServerTiming* t = response->mutable_timing();
      t->set_compute_us(raw->compute_us);
      t->set_transfer_us(raw->transfer_us);
      t->set_host_copy_us(raw->host_copy_us);
      t->set_queue_us(raw->queue_us);
      t->set_batch_requests(raw->batch_requests);
      std::lock_guard<std::mutex> lock(mu);
      result = std::move(st);
      finished = true;
      cv.notify_one();
    };
    if (absl::Status st = batcher_->Submit(*job); !st.ok()) return st;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return finished; });
    return result;
  }

  const v1::AttendRequest* request_;
  Batcher* batcher_;
  Backend* backend_;
  const RequestLimits* limits_;
};

absl::StatusOr<Result> Measure(const Config& config,
                               const std::vector<v1::AttendRequest>& requests) {
  CudaBackend::Options bo;
  bo.streams = config.streams;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::Create(bo));
  Batcher::Options o;
  o.max_batch_tokens = config.max_batch_tokens;
  ASSIGN_OR_RETURN(std::unique_ptr<Batcher> batcher,
                   Batcher::Create(o, backend.get(), nullptr, nullptr));
  RequestLimits limits;
  limits.head_dims = backend->Info().head_dims;

  std::vector<std::unique_ptr<Caller>> callers;
  for (int c = 0; c < absl::GetFlag(FLAGS_concurrency); ++c) {
    callers.push_back(std::make_unique<Caller>(&requests[c % requests.size()], batcher.get(),
                                               backend.get(), &limits));
  }
  std::atomic<bool> stop{false}, measuring{false};
  std::vector<std::thread> threads;
  for (auto& c : callers) threads.emplace_back([&, c = c.get()] { c->Loop(stop, measuring); });
  std::this_thread::sleep_for(Seconds(absl::GetFlag(FLAGS_warmup_s)));
  measuring = true;
  const auto start = Clock::now();
  std::this_thread::sleep_for(Seconds(absl::GetFlag(FLAGS_duration_s)));
  measuring = false;
  const double elapsed = Seconds(Clock::now() - start).count();
  stop = true;
  for (auto& t : threads) t.join();
  batcher->Drain();

  Result r;
  int64_t completed = 0;
  for (const auto& c : callers) {
    completed += c->completed;
    r.errors += c->errors;
    r.kernel_us += c->kernel_us;
    r.transfer_us += c->transfer_us;
    r.host_copy_us += c->host_copy_us;
    r.queue_us += c->queue_us;
    r.requests_per_launch += c->per_launch;
  }
  const v1::AttendRequest& q = requests.front();
  // q, k and v in, o out
  const double bytes = double(q.q().data().size() * 2 + q.k().data().size() * 2);
  r.requests_per_s = completed / elapsed;
  r.gb_per_s = r.requests_per_s * bytes * 1e-9;
  r.gpu_busy = (r.kernel_us + r.transfer_us) * 1e-6 / elapsed;
  if (completed > 0) {
    for (double* v : {&r.kernel_us, &r.transfer_us, &r.host_copy_us, &r.queue_us,
                      &r.requests_per_launch}) {
      *v /= completed;
    }
  }
  return r;
}

int Main() {
  const std::string compare = absl::GetFlag(FLAGS_compare);
  std::vector<Config> configs;
  if (compare == "batching") {
    const int streams = absl::GetFlag(FLAGS_streams);
    configs = {{"batching on (max_batch_tokens 16384)", streams, 16384},
               {"one request per launch", streams, absl::GetFlag(FLAGS_seq)}};
  } else if (compare == "streams") {
    configs = {{"--streams 4", 4, 16384}, {"--streams 1", 1, 16384}};
  } else {
    std::fprintf(stderr, "--compare must be batching or streams\n");
    return 2;
  }
  std::mt19937_64 rng(std::random_device{}());
  std::vector<v1::AttendRequest> requests;
  for (int i = 0; i < 4; ++i) requests.push_back(MakeRequest(rng));

  std::printf("engine only (no gRPC): s=%d, heads %d/%d, d=%d, bf16, %d callers\n",
              absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_heads),
              absl::GetFlag(FLAGS_kv_heads), absl::GetFlag(FLAGS_head_dim),
              absl::GetFlag(FLAGS_concurrency));
  std::printf("%-38s %9s %7s %10s %12s %12s %10s %10s %9s %6s\n", "configuration", "req/s",
              "GB/s", "kernel us", "transfer us", "host copy us", "queue us", "req/launch",
              "GPU busy", "errors");
  std::vector<Result> results;
  for (const Config& c : configs) {
    auto r = Measure(c, requests);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.label.c_str(), std::string(r.status().message()).c_str());
      return 1;
    }
    std::printf("%-38s %9.1f %7.2f %10.2f %12.2f %12.1f %10.1f %10.2f %8.0f%% %6lld\n",
                c.label.c_str(), r->requests_per_s, r->gb_per_s, r->kernel_us, r->transfer_us,
                r->host_copy_us, r->queue_us, r->requests_per_launch, 100 * r->gpu_busy,
                static_cast<long long>(r->errors));
    results.push_back(*r);
  }
  std::printf("ratio (first / second): %.2fx\n",
              results[0].requests_per_s / std::max(results[1].requests_per_s, 1e-9));
  return 0;
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  attn::util::SetUsageConfigForMain("server/engine_bench.cc", "attn-engine-bench (attnd tools)");
  absl::SetProgramUsageMessage(
      "attn-engine-bench: batcher and CUDA backend without the network; "
      "--compare batching|streams");
  absl::ParseCommandLine(argc, argv);
  return attn::Main();
}
