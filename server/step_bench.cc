// attn-step-bench: the host work of the step path per BatchStep call, without a network and
// without a device: what attnd's handler, the step pipeline and the answer's encoding cost in CPU
// time around each launch. A BatchStep of --steps decode steps (q [1, heads, head_dim], k_new and
// v_new [1, kv_heads, head_dim], bf16) over sessions holding --cache_tokens tokens, each phase
// timed on one thread, repeated for --seconds:
//   decode    the received slices into each step's header and the pieces of its tensors
//             (DecodeBatchStepRequest);
//   jobs      each step's session looked up, the step validated into its StepJob, its response's
//             header, its layer taken (what the handler does per item);
//   pipeline  the batch through the step pipeline (plan: pages and the page table; stage: the
//             tables and the tensors, straight from the slices, into the launch's staging;
//             finish: commit, outputs handed on, each caller told) on a device that does nothing
//             (its copies and kernels are the device's time, not the host's);
//   encode    the BatchStepResponse's slices, every o sent from the launch's output.
// Prints the median of each, their sum, and the calls per second one core sustains at that cost.
//   attn-step-bench [--steps 64] [--heads 32] [--kv_heads 8] [--head_dim 128]
//                   [--cache_tokens 4096] [--page_tokens 16] [--seconds 3] [--kv_fp8]
// --kv_fp8: sessions with an FP8 cache (the pipeline stages their 16-bit k_new/v_new as sent; the
// device quantizes them as it appends, which this null device does not).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "rpc/response_encoder.h"
#include "rpc/step_request_decoder.h"
#include "rpc/step_validation.h"
#include "sessions/session_manager.h"
#include "sessions/step_pipeline.h"

ABSL_FLAG(int, steps, 64, "Decode steps per BatchStep call (one per session)");
ABSL_FLAG(int, heads, 32, "Query heads");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, head_dim, 128, "Head dimension (bf16)");
ABSL_FLAG(int64_t, cache_tokens, 4096, "Tokens each session holds before the step");
ABSL_FLAG(int, page_tokens, 16, "Tokens per page of a 2 KiB row (attnd's --kv_page_tokens)");
ABSL_FLAG(int, slice_bytes, 64 << 10, "Size of the slices the request arrives in");
ABSL_FLAG(double, seconds, 3.0, "Measured seconds");
ABSL_FLAG(bool, kv_fp8, false,
          "Sessions with an FP8 (E4M3) cache: the pipeline quantizes k_new/v_new as it stages them");

namespace attn {
namespace {

using Clock = std::chrono::steady_clock;

// A device whose copies and kernels take no host time: staging in host memory, nothing run.
class NullStepDevice : public StepDevice {
 public:
  explicit NullStepDevice(int64_t pages, int64_t page_bytes) {
    kv_.num_pages = pages;
    kv_.page_bytes = page_bytes;
  }
  int Lanes() const override { return 1; }
  KvRegion kv_region() const override { return kv_; }
  absl::StatusOr<char*> InputStaging(int, size_t bytes) override {
    if (staging_.size() < bytes) staging_.resize(bytes);
    return staging_.data();
  }
  // One buffer reused while no answer holds it (the CUDA device's come from its pinned pool).
  absl::StatusOr<OutputBytes> OutputStaging(size_t bytes) override {
    if (out_.empty() || out_.size < bytes || out_.owner.use_count() > 1) {
      out_ = OutputBytes::Allocate(bytes);
    }
    return out_;
  }
  absl::Status Launch(int, const StepLaunch&) override { return absl::OkStatus(); }
  absl::StatusOr<StepLaunchTimes> Wait(int, const StepLaunch&) override {
    return StepLaunchTimes{};
  }

 private:
  KvRegion kv_;
  std::vector<char> staging_;
  OutputBytes out_;
};

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t x = rng() & 0x3f3f3f3f3f3f3f3full;  // small bf16 values
    std::memcpy(&s[i], &x, 8);
  }
  return s;
}

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

int Run() {
  const int n = absl::GetFlag(FLAGS_steps), heads = absl::GetFlag(FLAGS_heads);
  const int kv_heads = absl::GetFlag(FLAGS_kv_heads), d = absl::GetFlag(FLAGS_head_dim);
  const int64_t cache = absl::GetFlag(FLAGS_cache_tokens);
  const int64_t page_bytes = int64_t{absl::GetFlag(FLAGS_page_tokens)} * 2048;
  const bool fp8 = absl::GetFlag(FLAGS_kv_fp8);
  const int64_t row = int64_t{kv_heads} * d * (fp8 ? 1 : 2);
  const int64_t pages_per_session = (cache + 64 + page_bytes / row) / (page_bytes / row) + 1;
  const int64_t pages = pages_per_session * n + 16;
  auto pool = KvPagePool::Create({pages, page_bytes, 0});
  if (!pool.ok()) return 1;
  SessionManager::Options mo;
  mo.replica_id = "bench";
  mo.max_sessions = n;
  mo.head_dims = {d};
  auto manager = SessionManager::Create(mo, pool->get(), nullptr);
  NullStepDevice device(pages, page_bytes);
  auto pipeline = StepPipeline::Create({}, &device);
  if (!manager.ok() || !pipeline.ok()) return 1;

  // n sessions, each holding `cache` tokens (pages taken as steps take them; nothing computed).
  std::vector<std::shared_ptr<Session>> sessions;
  SessionManager::CreateParams p;
  p.num_layers = 1;
  p.num_kv_heads = kv_heads;
  p.head_dim = d;
  if (fp8) {
    p.cache_dtype = kernels::DType::kFloat8E4M3;
    p.k_scales.assign(static_cast<size_t>(kv_heads), 1.0f / 448);
    p.v_scales = p.k_scales;
  }
  for (int i = 0; i < n; ++i) {
    auto s = (*manager)->CreateSession(p, "");
    if (!s.ok()) {
      std::fprintf(stderr, "attn-step-bench: %s\n", s.status().ToString().c_str());
      return 1;
    }
    (*s)->AcquireLayer(0, [] {});
    auto a = (*s)->BeginAppend(0, cache);
    if (!a.ok()) return 1;
    (*s)->CommitAppend(std::move(*a));
    (*s)->ReleaseLayer(0);
    sessions.push_back(*s);
  }
  std::mt19937_64 rng(7);
  v1::BatchStepRequest request;
  for (int i = 0; i < n; ++i) {
    v1::StepRequest* step = request.add_steps();
    step->set_session_id(sessions[i]->id());
    const std::pair<v1::Tensor*, int> tensors[] = {
        {step->mutable_q(), heads},
        {step->mutable_k_new(), kv_heads},
        {step->mutable_v_new(), kv_heads}};
    for (const auto& [t, h] : tensors) {
      t->set_dtype(v1::DTYPE_BFLOAT16);
      for (int64_t s : {int64_t{1}, int64_t(h), int64_t(d)}) t->add_shape(s);
      t->set_data(RandomBytes(rng, size_t(h) * d * 2));
    }
  }
  const std::string bytes = request.SerializeAsString();
  std::vector<grpc::Slice> received;
  const size_t slice = static_cast<size_t>(absl::GetFlag(FLAGS_slice_bytes));
  for (size_t at = 0; at < bytes.size(); at += slice) {
    received.emplace_back(bytes.data() + at, std::min(slice, bytes.size() - at));
  }
  RequestLimits limits;
  limits.head_dims = {d};

  std::vector<double> t_decode, t_jobs, t_pipeline, t_encode;
  const auto end = Clock::now() + std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds));
  while (t_decode.size() < 20 || Clock::now() < end) {
    const auto t0 = Clock::now();
    std::vector<std::string_view> pieces;
    for (const grpc::Slice& s : received) {
      pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    // The headers on a call's arena, as attnd's BatchStep has them.
    google::protobuf::Arena arena(StepCallArenaOptions());
    std::vector<DecodedStepRequest> decoded;
    if (!DecodeBatchStepRequest(pieces, &decoded, &arena).ok()) return 1;
    const auto t1 = Clock::now();
    std::vector<v1::StepResponse> responses(decoded.size());
    std::vector<OutputBytes> o(decoded.size());
    std::atomic<size_t> left{decoded.size()};
    std::promise<void> all_done, finished;
    JobBatch batch;
    for (size_t i = 0; i < decoded.size(); ++i) {
      auto s = (*manager)->Find(decoded[i].header().session_id(), "");
      if (!s.ok()) return 1;
      auto job = ValidateStepRequest(decoded[i].header(), *s, limits, StepRegions{},
                                     &decoded[i].data);
      if (!job.ok()) {
        std::fprintf(stderr, "attn-step-bench: %s\n", job.status().ToString().c_str());
        return 1;
      }
      PrepareStepResponse(**job, decoded[i].header(), &responses[i]);
      StepJob* raw = job->get();
      (*job)->done = [&, i, raw](absl::Status st) {
        raw->session->ReleaseLayer(raw->layer);
        if (st.ok()) {
          responses[i].set_cached_tokens(raw->cached_tokens);
          o[i] = std::move(raw->o);
        }
        if (left.fetch_sub(1) == 1) all_done.set_value();
      };
      (*job)->session->AcquireLayer((*job)->layer, [] {});
      batch.push_back(std::move(*job));
    }
    const auto t2 = Clock::now();
    (*pipeline)->RunBatch(std::move(batch), [&](const BatchReport&) { finished.set_value(); });
    finished.get_future().wait();
    all_done.get_future().wait();
    const auto t3 = Clock::now();
    std::vector<EncodedStepResult> results(decoded.size());
    for (size_t i = 0; i < results.size(); ++i) {
      results[i].response = &responses[i];
      results[i].o = std::move(o[i]);
    }
    const grpc::ByteBuffer answer = EncodeBatchStepResponse(results);
    const auto t4 = Clock::now();
    t_decode.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    t_jobs.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    t_pipeline.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
    t_encode.push_back(std::chrono::duration<double, std::micro>(t4 - t3).count());
    // Back to `cache` tokens (not timed).
    for (auto& s : sessions) (void)s->Truncate(1);
  }
  const double dec = Median(t_decode), jobs = Median(t_jobs), pipe = Median(t_pipeline),
               enc = Median(t_encode);
  const double total = dec + jobs + pipe + enc;
  std::printf("BatchStep of %d decode steps, %d/%d heads x %d bf16%s, cache %lld tokens, %lld-byte "
              "pages, %zu calls, one thread, median us per call\n",
              n, heads, kv_heads, d, fp8 ? " (FP8 cache)" : "", static_cast<long long>(cache),
              static_cast<long long>(page_bytes), t_decode.size());
  std::printf("%9s %9s %9s %9s %9s %10s %11s\n", "decode", "jobs", "pipeline", "encode", "total",
              "us/step", "calls/s/core");
  std::printf("%9.1f %9.1f %9.1f %9.1f %9.1f %10.2f %11.0f\n", dec, jobs, pipe, enc, total,
              total / n, 1e6 / total);
  return 0;
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attn::Run();
}
