// The step pipeline over the CPU step device, with a device in front of it that refuses launches
// larger than a bound (as a device pool too small for them does) or fails them: a batch is split
// into launches that fit, each step computing exactly what it computes in one launch; a step that
// fits no launch fails alone with RESOURCE_EXHAUSTED; a failed launch leaves every cache as it was.
#include "sessions/step_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <atomic>
#include <cmath>
#include <deque>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "backends/cpu_backend.h"
#include "common/status_util.h"
#include "backends/cpu_step_device.h"
#include "sessions/fp8_quantize.h"
#include "sessions/session_manager.h"
#include "attn/kernels/dtype_convert.h"

namespace attn {
namespace {

constexpr int64_t kPageBytes = 2048;
constexpr int64_t kPages = 256;

// The CPU device, refusing launches of more than max_members steps and, when told to, failing
// the next launch in Wait (a device error after the work was enqueued). With lanes > 0 (set
// before the pipeline is made) it has that many lanes, each with its staging, their launches
// run one at a time on the CPU device.
class BoundedDevice : public StepDevice {
 public:
  explicit BoundedDevice(StepDevice* inner) : inner_(inner) {}
  int Lanes() const override { return lanes > 0 ? lanes : inner_->Lanes(); }
  KvRegion kv_region() const override { return inner_->kv_region(); }
  absl::StatusOr<char*> InputStaging(int lane, size_t bytes) override {
    if (lanes == 0) return inner_->InputStaging(lane, bytes);
    std::vector<char>& staging = staging_[lane];
    if (staging.size() < bytes) staging.resize(bytes);
    return staging.data();
  }
  absl::StatusOr<OutputBytes> OutputStaging(size_t bytes) override {
    return inner_->OutputStaging(bytes);
  }
  absl::Status Launch(int lane, const StepLaunch& launch) override {
    if (static_cast<int>(launch.members.size()) > max_members.load()) {
      return absl::ResourceExhaustedError("device pool exhausted (test)");
    }
    {
      std::unique_lock<std::mutex> lock(gate_mu_);
      lane_threads.insert(std::this_thread::get_id());
      poll_waits.push_back(launch.poll_wait);
      gate_cv_.wait(lock, [&] { return open; });
    }
    launches.fetch_add(1);
    if (lanes == 0) return inner_->Launch(lane, launch);
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(inner_->Launch(lane, launch));
    ASSIGN_OR_RETURN(times_[lane], inner_->Wait(lane, launch));
    return absl::OkStatus();
  }
  absl::StatusOr<StepLaunchTimes> Wait(int lane, const StepLaunch& launch) override {
    if (fail_next.exchange(false)) return absl::InternalError("the launch failed (test)");
    if (lanes > 0) return times_[lane];
    return inner_->Wait(lane, launch);
  }
  // Launches wait until open (set under gate_mu_, then Open()); the threads they ran on.
  void Open() {
    {
      std::lock_guard<std::mutex> lock(gate_mu_);
      open = true;
    }
    gate_cv_.notify_all();
  }
  bool open = true;
  std::set<std::thread::id> lane_threads;  // under gate_mu_
  std::vector<bool> poll_waits;            // each launch's, in the order they came; likewise
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;

  int lanes = 0;
  std::atomic<int> max_members{1 << 20};
  std::atomic<bool> fail_next{false};
  std::atomic<int> launches{0};

 private:
  StepDevice* const inner_;
  std::mutex mu_;  // the CPU device runs one launch at a time
  std::vector<char> staging_[8];
  StepLaunchTimes times_[8];
};

class StepPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = *CpuBackend::Create({.threads = 2});
    CpuStepDevice::Options so;
    so.kv_cache_bytes = 2 * kPages * kPageBytes;
    so.kv_page_bytes = kPageBytes;
    cpu_ = *CpuStepDevice::Create(so, backend_->thread_pool());
    device_ = std::make_unique<BoundedDevice>(cpu_.get());
    pipeline_ = *StepPipeline::Create({}, device_.get());
    pool_ = *KvPagePool::Create({kPages, kPageBytes, 77});
    SessionManager::Options mo;
    mo.replica_id = "pipeline";
    mo.head_dims = {64};
    manager_ = *SessionManager::Create(mo, pool_.get(), nullptr);
  }

  std::shared_ptr<Session> NewSession() {
    SessionManager::CreateParams p;
    p.num_layers = 1;
    p.num_kv_heads = 2;
    p.head_dim = 64;
    return *manager_->CreateSession(p, "");
  }

  // A step of `tokens` tokens of random bf16 (seeded) for session s, 4 query heads.
  std::unique_ptr<StepJob> Step(std::shared_ptr<Session> s, int tokens, uint64_t seed) {
    auto job = std::make_unique<StepJob>();
    job->total_q = tokens;
    job->key.wire_dtype = kernels::DType::kBFloat16;
    job->key.num_heads = 4;
    job->key.num_kv_heads = 2;
    job->key.head_dim = 64;
    job->key.causal = true;
    job->key.softmax_scale = 0.125f;
    job->key.page_tokens = s->shape().page_tokens;
    job->key.decode = tokens == 1;
    std::mt19937_64 rng(seed);
    auto& data = inputs_.emplace_back();
    data.resize(size_t(tokens) * 64 * 2 * (4 + 2 + 2));
    for (char& c : data) c = static_cast<char>(rng() % 64);  // small bf16 values: no overflow
    const size_t q = size_t(tokens) * 4 * 64 * 2, kv = size_t(tokens) * 2 * 64 * 2;
    job->q_bytes = {data.data(), q};
    job->k_bytes = {data.data() + q, kv};
    job->v_bytes = {data.data() + q + kv, kv};
    job->session = std::move(s);
    return job;
  }

  // A one-token step of s holding its layer, whose done() says on which thread it ran.
  std::unique_ptr<StepJob> ToldStep(std::shared_ptr<Session> s, uint64_t seed,
                                    std::promise<std::thread::id>* told) {
    Session* session = s.get();
    std::unique_ptr<StepJob> job = Step(std::move(s), 1, seed);
    job->done = [told, session](absl::Status st) {
      EXPECT_TRUE(st.ok()) << st;
      session->ReleaseLayer(0);
      told->set_value(std::this_thread::get_id());
    };
    EXPECT_TRUE(session->AcquireLayer(0, [] {}));
    return job;
  }

  // Steps of a caller whose answers did not come within 5 s (late) or were errors (failed).
  struct CallerCounts {
    std::atomic<int> failed{0}, late{0};
  };
  // A caller's steps (of one session), each a batch of its own, each sent once the one before is
  // answered, after a pause of 400 us (longer than a lane's idle poll) or, with random_pauses,
  // of 0, 50 or 400 us. Stops at the first step not answered in time.
  void LoneStepsOneAfterAnother(std::vector<std::unique_ptr<StepJob>> jobs, bool random_pauses,
                                int seed, CallerCounts* counts) {
    std::mt19937 rng(seed);
    for (std::unique_ptr<StepJob>& job : jobs) {
      Session* session = job->session.get();
      // Shared with the job: a launch never run still finds it when the pipeline stops.
      auto done = std::make_shared<std::promise<absl::Status>>();
      job->done = [done, session](absl::Status st) {
        session->ReleaseLayer(0);
        done->set_value(std::move(st));
      };
      if (!session->AcquireLayer(0, [] {})) {
        counts->failed.fetch_add(1);
        return;
      }
      RunAlone(std::move(job));
      std::future<absl::Status> f = done->get_future();
      if (f.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
        counts->late.fetch_add(1);
        return;
      }
      if (!f.get().ok()) counts->failed.fetch_add(1);
      const int pause = random_pauses ? std::array<int, 3>{0, 50, 400}[rng() % 3] : 400;
      std::this_thread::sleep_for(std::chrono::microseconds(pause));
    }
  }

  // One job as a batch of its own, into the pipeline.
  void RunAlone(std::unique_ptr<StepJob> job) {
    JobBatch batch;
    batch.push_back(std::move(job));
    pipeline_->RunBatch(std::move(batch), [](const BatchReport&) {});
  }

  // The one thread the device's launches ran on (a pipeline of one lane).
  std::thread::id LaneThread() {
    std::lock_guard<std::mutex> lock(device_->gate_mu_);
    EXPECT_EQ(device_->lane_threads.size(), 1u);
    return device_->lane_threads.empty() ? std::thread::id() : *device_->lane_threads.begin();
  }

  // Runs jobs as one batch (each holds its layer for it); returns each step's status and o.
  std::vector<std::pair<absl::Status, std::string>> Run(std::vector<std::unique_ptr<StepJob>> jobs) {
    std::vector<std::pair<absl::Status, std::string>> out(jobs.size());
    std::atomic<size_t> left{jobs.size()};
    std::promise<void> all_done, finished;
    JobBatch batch;
    for (size_t i = 0; i < jobs.size(); ++i) {
      EXPECT_TRUE(jobs[i]->session->AcquireLayer(0, [] {}));
      const StepJob* raw = jobs[i].get();
      jobs[i]->done = [&, i, raw](absl::Status st) {
        if (st.ok()) out[i].second.assign(raw->o.data, raw->o.size);
        out[i].first = std::move(st);
        raw->session->ReleaseLayer(0);
        if (left.fetch_sub(1) == 1) all_done.set_value();
      };
      batch.push_back(std::move(jobs[i]));
    }
    pipeline_->RunBatch(std::move(batch), [&](const BatchReport&) { finished.set_value(); });
    finished.get_future().wait();
    all_done.get_future().wait();
    return out;
  }

  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<CpuStepDevice> cpu_;
  std::unique_ptr<BoundedDevice> device_;
  std::unique_ptr<KvPagePool> pool_;
  std::unique_ptr<SessionManager> manager_;
  std::deque<std::string> inputs_;
  // Destroyed first: its completion threads may still be releasing finished jobs, whose sessions
  // give their pages back to pool_.
  std::unique_ptr<StepPipeline> pipeline_;
};

TEST_F(StepPipelineTest, ALaunchTheDeviceHasNoRoomForIsSplitAndComputesTheSame) {
  constexpr int kSteps = 9;
  // The same histories twice: prefilled alike, then one batch of decode steps in one launch and
  // in launches of at most 2.
  std::vector<std::shared_ptr<Session>> one, split;
  for (int i = 0; i < kSteps; ++i) {
    one.push_back(NewSession());
    split.push_back(NewSession());
  }
  for (auto* set : {&one, &split}) {
    std::vector<std::unique_ptr<StepJob>> prefill;
    for (int i = 0; i < kSteps; ++i) prefill.push_back(Step((*set)[i], 5 + i, 100 + i));
    for (const auto& [st, o] : Run(std::move(prefill))) ASSERT_TRUE(st.ok()) << st;
  }
  std::vector<std::unique_ptr<StepJob>> a, b;
  for (int i = 0; i < kSteps; ++i) {
    a.push_back(Step(one[i], 1, 200 + i));
    b.push_back(Step(split[i], 1, 200 + i));
  }
  const auto together = Run(std::move(a));
  device_->max_members = 2;
  const int before = device_->launches.load();
  const auto apart = Run(std::move(b));
  EXPECT_GE(device_->launches.load() - before, (kSteps + 1) / 2);
  for (int i = 0; i < kSteps; ++i) {
    ASSERT_TRUE(together[i].first.ok()) << together[i].first;
    ASSERT_TRUE(apart[i].first.ok()) << "step " << i << ": " << apart[i].first;
    EXPECT_EQ(apart[i].second, together[i].second) << "step " << i;
    EXPECT_EQ(split[i]->CachedTokens(0), one[i]->CachedTokens(0));
  }
}

TEST_F(StepPipelineTest, AStepThatFitsNoLaunchFailsAloneAndChangesNothing) {
  auto s = NewSession(), t = NewSession();
  std::vector<std::unique_ptr<StepJob>> prefill;
  prefill.push_back(Step(s, 7, 1));
  prefill.push_back(Step(t, 7, 2));
  for (const auto& [st, o] : Run(std::move(prefill))) ASSERT_TRUE(st.ok()) << st;
  const int64_t free_pages = pool_->FreePages();
  device_->max_members = 0;
  std::vector<std::unique_ptr<StepJob>> jobs;
  jobs.push_back(Step(s, 3, 3));
  jobs.push_back(Step(t, 20, 4));  // would take new pages
  for (const auto& [st, o] : Run(std::move(jobs))) {
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  }
  EXPECT_EQ(pool_->FreePages(), free_pages) << "a refused step kept pages";
  EXPECT_EQ(s->CachedTokens(0), 7);
  EXPECT_EQ(t->CachedTokens(0), 7);
  // A launch that fails on the device gives every page back too.
  device_->max_members = 1 << 20;
  device_->fail_next = true;
  std::vector<std::unique_ptr<StepJob>> failing;
  failing.push_back(Step(s, 30, 5));
  failing.push_back(Step(t, 1, 6));
  for (const auto& [st, o] : Run(std::move(failing))) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  }
  EXPECT_EQ(pool_->FreePages(), free_pages);
  EXPECT_EQ(s->CachedTokens(0), 7);
  // And the sessions go on.
  std::vector<std::unique_ptr<StepJob>> next;
  next.push_back(Step(s, 1, 7));
  for (const auto& [st, o] : Run(std::move(next))) EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(s->CachedTokens(0), 8);
}

// Lanes that poll for work while idle (as GPU lanes do), every idle lane or one at a time while
// no other is at work: launches queued from one caller after pauses longer than the poll (every
// lane asleep), then from several callers at once, right after one another or after pauses, all
// run; none waits for a wake-up that never comes.
TEST_F(StepPipelineTest, IdleLanesThatPollTakeEveryLaunch) {
  device_->lanes = 3;
  constexpr int kSteps = 60;
  for (const bool poll_when_busy : {true, false}) {
    StepPipeline::Options options;
    options.idle_poll = std::chrono::microseconds(200);
    options.poll_when_busy = poll_when_busy;
    pipeline_ = *StepPipeline::Create(options, device_.get());
    for (const int callers : {1, 4}) {
      std::vector<std::shared_ptr<Session>> sessions;
      std::vector<std::vector<std::unique_ptr<StepJob>>> jobs(callers);
      for (int c = 0; c < callers; ++c) {
        sessions.push_back(NewSession());
        for (int i = 0; i < kSteps; ++i) jobs[c].push_back(Step(sessions[c], 1, 1000 * c + i));
      }
      CallerCounts counts;
      std::vector<std::thread> threads;
      for (int c = 0; c < callers; ++c) {
        // One caller pauses longer than the poll; several pause at random, some not at all.
        threads.emplace_back([&, c] {
          LoneStepsOneAfterAnother(std::move(jobs[c]), callers > 1, c, &counts);
        });
      }
      for (auto& t : threads) t.join();
      ASSERT_EQ(counts.late.load(), 0) << callers << " callers, poll_when_busy " << poll_when_busy
                                       << ": a launch stayed queued, every lane asleep";
      EXPECT_EQ(counts.failed.load(), 0);
      for (const auto& s : sessions) EXPECT_EQ(s->CachedTokens(0), kSteps);
    }
  }
}

// A lone launch tells its caller on the lane; one that ends while another batch waits for the
// lane hands its callers to the completion pool, and the lane takes the waiting batch at once.
TEST_F(StepPipelineTest, ALaunchWithBatchesWaitingTellsItsCallersOffTheLane) {
  device_->lanes = 1;
  pipeline_ = *StepPipeline::Create({}, device_.get());
  std::vector<std::shared_ptr<Session>> sessions;
  for (int i = 0; i < 3; ++i) sessions.push_back(NewSession());
  std::vector<std::promise<std::thread::id>> told(3);
  auto submit = [&](int i) { RunAlone(ToldStep(sessions[i], 50 + i, &told[i])); };
  {
    std::lock_guard<std::mutex> lock(device_->gate_mu_);
    device_->open = false;  // the first launch waits until the other two are queued
  }
  for (int i = 0; i < 3; ++i) submit(i);
  device_->Open();
  std::vector<std::thread::id> threads;
  for (auto& t : told) threads.push_back(t.get_future().get());
  const std::thread::id lane = LaneThread();
  EXPECT_NE(threads[0], lane) << "the first launch ended with two batches waiting";
  EXPECT_NE(threads[1], lane) << "the second launch ended with one batch waiting";
  EXPECT_EQ(threads[2], lane) << "the last launch ended with none waiting";
  for (const auto& s : sessions) EXPECT_EQ(s->CachedTokens(0), 1);
}

// A launch may be polled for only while no other lane is at work (a lone caller's latency);
// one that starts beside another lane's is waited for asleep, unless the pipeline is told to
// poll while busy.
TEST_F(StepPipelineTest, OnlyALaunchAloneOnTheDeviceIsPolledFor) {
  device_->lanes = 2;
  for (const bool poll_when_busy : {false, true}) {
    StepPipeline::Options options;
    options.poll_when_busy = poll_when_busy;
    pipeline_ = *StepPipeline::Create(options, device_.get());
    std::vector<std::shared_ptr<Session>> sessions;
    for (int i = 0; i < 3; ++i) sessions.push_back(NewSession());
    std::vector<std::promise<std::thread::id>> told(3);
    auto submit = [&](int i) { RunAlone(ToldStep(sessions[i], 90 + i, &told[i])); };
    auto launches_at_gate = [&](size_t n) {  // waits until n launches are held at the gate
      for (;;) {
        {
          std::lock_guard<std::mutex> lock(device_->gate_mu_);
          if (device_->poll_waits.size() >= n) return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    };
    {
      std::lock_guard<std::mutex> lock(device_->gate_mu_);
      device_->open = false;
      device_->poll_waits.clear();
    }
    submit(0);
    launches_at_gate(1);  // lane one is at work on it
    submit(1);
    launches_at_gate(2);
    device_->Open();
    told[0].get_future().wait();
    told[1].get_future().wait();
    submit(2);  // alone again
    told[2].get_future().wait();
    std::lock_guard<std::mutex> lock(device_->gate_mu_);
    EXPECT_EQ(device_->poll_waits, (std::vector<bool>{true, poll_when_busy, true}))
        << "poll_when_busy " << poll_when_busy;
  }
}

// With no batch waiting, one call's steps are told on the lane, several calls' off it (their
// answers sent in parallel).
TEST_F(StepPipelineTest, SeveralCallsOfOneLaunchAreToldOffTheLane) {
  device_->lanes = 1;
  pipeline_ = *StepPipeline::Create({}, device_.get());
  for (const bool one_call : {true, false}) {
    std::vector<std::shared_ptr<Session>> sessions;
    for (int i = 0; i < 3; ++i) sessions.push_back(NewSession());
    std::vector<std::promise<std::thread::id>> told(3);
    auto call = std::make_shared<int>(0);  // what a BatchStep's steps hold in common
    JobBatch batch;
    for (int i = 0; i < 3; ++i) {
      std::unique_ptr<StepJob> job = ToldStep(sessions[i], 70 + i, &told[i]);
      if (one_call) job->input_hold = call;
      batch.push_back(std::move(job));
    }
    pipeline_->RunBatch(std::move(batch), [](const BatchReport&) {});
    std::vector<std::thread::id> threads;
    for (auto& t : told) threads.push_back(t.get_future().get());
    const std::thread::id lane = LaneThread();
    for (const std::thread::id& t : threads) {
      if (one_call) {
        EXPECT_EQ(t, lane) << "one call's steps";
      } else {
        EXPECT_NE(t, lane) << "three calls' steps";
      }
    }
  }
}

// The FP8 cache's quantization of 16-bit k_new/v_new: for every bf16 and every fp16 bit pattern
// over several scales (subnormal, normal, saturating and NaN results), the same codes as the
// kernels library's FloatToE4m3Bits of the float32 quotient, and the saturations counted.
TEST(Fp8QuantizeTest, EveryBf16AndFp16ValueQuantizesAsTheReference) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  for (const kernels::DType dtype : {kernels::DType::kBFloat16, kernels::DType::kFloat16}) {
    for (const float scale : {1.0f, 1.0f / 448, 3.7e-3f, 0.75f, 1e-20f, 1e20f}) {
      // Two heads: the scale of head 1 is twice head 0's.
      const std::vector<float> scales = {scale, 2 * scale};
      std::vector<uint8_t> got(2 * all.size(), 0xAA);
      std::vector<uint16_t> rows(2 * all.size());
      std::copy(all.begin(), all.end(), rows.begin());
      std::copy(all.begin(), all.end(), rows.begin() + all.size());
      const int64_t saturated =
          QuantizeE4m3Rows(dtype, rows.data(), 1, 2, 65536, scales, got.data());
      int64_t want_saturated = 0;
      int64_t mismatches = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        const float x = dtype == kernels::DType::kBFloat16
                            ? kernels::cpu::Bf16BitsToFloat(rows[i])
                            : kernels::cpu::HalfBitsToFloat(rows[i]);
        const float q = x / scales[i / all.size()];
        want_saturated += std::fabs(q) > 448.0f;
        if (got[i] != kernels::cpu::FloatToE4m3Bits(q) && mismatches++ < 5) {
          ADD_FAILURE() << kernels::DTypeName(dtype) << " bits " << rows[i] << " / " << scale
                        << ": code " << int(got[i]) << ", want "
                        << int(kernels::cpu::FloatToE4m3Bits(q));
        }
      }
      EXPECT_EQ(mismatches, 0);
      EXPECT_EQ(saturated, want_saturated) << kernels::DTypeName(dtype) << " / " << scale;
    }
  }
}

}  // namespace
}  // namespace attn
