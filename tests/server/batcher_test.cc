// Batcher unit tests against a fake backend: packing, delay, limits, deadlines, cancellation,
// priority, draining and the routing of results.
#include "engine/batcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <cstring>
#include <thread>

#include "rpc/attend_validation.h"
#include "sessions/step_job.h"

namespace attn {
namespace {

using namespace std::chrono_literals;

// A runner (the backend's or the step pipeline's part) that records every batch; can hold
// batches back until released.
class FakeBackend : public BatchRunner {
 public:
  explicit FakeBackend(int max_in_flight = 1) : max_in_flight_(max_in_flight) {}
  int MaxInFlightBatches() const override { return max_in_flight_; }

  ~FakeBackend() override {
    for (auto& t : workers_) t.join();
  }

  // The id of each job it may see (the request's request_id), set by the test.
  void SetIds(std::mutex* mu, std::map<const Job*, uint64_t>* ids) {
    ids_mu_ = mu;
    ids_ = ids;
  }

  // Like the real backends, returns at once and completes the batch on another thread.
  void RunBatch(JobBatch batch, std::function<void(const BatchReport&)> on_finished) override {
    std::lock_guard<std::mutex> lock(workers_mu_);
    workers_.emplace_back([this, b = std::move(batch), f = std::move(on_finished)]() mutable {
      Run(std::move(b), std::move(f));
    });
  }

  void Run(JobBatch batch, std::function<void(const BatchReport&)> on_finished) {
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(*ids_mu_);
      for (auto& job : batch) ids.push_back(ids_->at(job.get()));
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      batches_.push_back(ids);
      cv_.notify_all();
      cv_.wait(lock, [&] { return !hold_; });
    }
    BatchReport report;
    report.requests = static_cast<int32_t>(batch.size());
    // Like the CUDA backend, which completes its jobs on other threads after it reports the
    // batch finished.
    if (finish_before_done_) {
      on_finished(report);
      std::unique_lock<std::mutex> lock(mu_);
      ++finished_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return !hold_done_; });
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      // The answer names the request it belongs to: its id + 1000 as the output.
      const uint64_t answer = ids[i] + 1000;
      batch[i]->o = OutputBytes::Allocate(sizeof answer);
      std::memcpy(batch[i]->o.data, &answer, sizeof answer);
      batch[i]->done(absl::OkStatus());
    }
    if (!finish_before_done_) on_finished(report);
  }

  void FinishBeforeDone(bool hold_done) {
    std::lock_guard<std::mutex> lock(mu_);
    finish_before_done_ = true;
    hold_done_ = hold_done;
    cv_.notify_all();
  }
  bool WaitForFinished(int n, std::chrono::milliseconds timeout = 5000ms) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finished_ >= n; });
  }

  void Hold(bool hold) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = hold;
    cv_.notify_all();
  }
  // Waits until n batches have been started.
  bool WaitForBatches(size_t n, std::chrono::milliseconds timeout = 5000ms) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return batches_.size() >= n; });
  }
  std::vector<std::vector<uint64_t>> Batches() {
    std::lock_guard<std::mutex> lock(mu_);
    return batches_;
  }

 private:
  const int max_in_flight_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;
  bool finish_before_done_ = false;
  bool hold_done_ = false;
  int finished_ = 0;
  std::vector<std::vector<uint64_t>> batches_;
  std::mutex* ids_mu_ = nullptr;
  std::map<const Job*, uint64_t>* ids_ = nullptr;
  std::mutex workers_mu_;
  std::vector<std::thread> workers_;
};

// A request that lives as long as the test, and what its job answered.
struct Call {
  v1::AttendRequest request;
  uint64_t answer = 0;  // the job's output
  std::promise<absl::Status> result;
  std::future<absl::Status> future = result.get_future();
  std::atomic<int> done_calls{0};
};

class BatcherTest : public ::testing::Test {
 protected:
  void Make(Batcher::Options options, int max_in_flight = 1, int step_max_in_flight = 1) {
    backend_ = std::make_unique<FakeBackend>(max_in_flight);
    steps_ = std::make_unique<FakeBackend>(step_max_in_flight);
    backend_->SetIds(&ids_mu_, &ids_);
    steps_->SetIds(&ids_mu_, &ids_);
    auto b = Batcher::Create(options, backend_.get(), steps_.get(), nullptr);
    ASSERT_TRUE(b.ok()) << b.status();
    batcher_ = std::move(*b);
  }

  // Submits a request of `tokens` query tokens; heads selects the batch key.
  absl::Status Submit(uint64_t id, int tokens, int heads = 1, bool high = false,
                      Clock::time_point deadline = Clock::time_point::max(),
                      std::function<bool()> cancelled = nullptr) {
    return SubmitEdited(id, tokens, heads, [&](v1::AttendRequest& r, AttendJob* job) {
      if (job == nullptr) {
        r.set_priority(high ? v1::PRIORITY_HIGH : v1::PRIORITY_NORMAL);
        return;
      }
      job->deadline = deadline;
      job->is_cancelled = std::move(cancelled);
    });
  }

  // edit is called with the request before validation (job null), then with the job.
  absl::Status SubmitEdited(uint64_t id, int tokens, int heads,
                            const std::function<void(v1::AttendRequest&, AttendJob*)>& edit) {
    auto call = std::make_unique<Call>();
    for (v1::Tensor* t : {call->request.mutable_q(), call->request.mutable_k(),
                          call->request.mutable_v()}) {
      t->set_dtype(v1::DTYPE_BFLOAT16);
      t->add_shape(tokens);
      t->add_shape(heads);
      t->add_shape(64);
      t->mutable_data()->resize(size_t(tokens) * heads * 64 * 2);
    }
    call->request.set_request_id(id);
    edit(call->request, nullptr);
    RequestLimits limits;
    limits.head_dims = {64};
    auto job = ValidateAttendRequest(call->request, limits);
    EXPECT_TRUE(job.ok()) << job.status();
    if (!job.ok()) return job.status();
    (*job)->bytes = AttendJobBytes(**job, call->request);
    (*job)->arrival = Clock::now();
    edit(call->request, job->get());
    std::unique_ptr<Job> owned = std::move(*job);
    return SubmitJob(id, std::move(call), std::move(owned));
  }

  // Submits a session step of one token (the step runner's), id as its name.
  absl::Status SubmitStep(uint64_t id, int tokens = 1) {
    auto job = std::make_unique<StepJob>();
    job->total_q = tokens;
    job->key.num_heads = 1;
    job->key.page_tokens = 16;
    job->key.decode = true;
    job->arrival = Clock::now();
    std::unique_ptr<Job> owned = std::move(job);
    return SubmitJob(id, std::make_unique<Call>(), std::move(owned));
  }

  absl::Status SubmitJob(uint64_t id, std::unique_ptr<Call> call, std::unique_ptr<Job> job) {
    Call* raw = call.get();
    const Job* job_raw = job.get();
    job->done = [raw, job_raw](absl::Status st) {
      if (!job_raw->o.empty()) std::memcpy(&raw->answer, job_raw->o.data, sizeof raw->answer);
      if (raw->done_calls.fetch_add(1) == 0) raw->result.set_value(st);
    };
    {
      std::lock_guard<std::mutex> lock(ids_mu_);
      ids_[job.get()] = id;
    }
    absl::Status st = batcher_->Submit(job);
    calls_[id] = std::move(call);
    return st;
  }

  absl::Status ResultOf(uint64_t id) {
    auto& f = calls_.at(id)->future;
    if (f.wait_for(5s) != std::future_status::ready) return absl::UnknownError("never completed");
    return f.get();
  }

  // Declared first: the fakes and the batcher read the ids, and their threads answer the calls
  // (a promise's set_value may still be running when its future is ready), until they are gone.
  std::mutex ids_mu_;
  std::map<const Job*, uint64_t> ids_;
  std::map<uint64_t, std::unique_ptr<Call>> calls_;
  std::unique_ptr<FakeBackend> backend_;
  std::unique_ptr<FakeBackend> steps_;
  std::unique_ptr<Batcher> batcher_;
};

// Requests that arrive while the backend is busy gather into its next batch.
TEST_F(BatcherTest, PacksRequestsThatArriveWhileTheBackendIsBusy) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 200000, .max_queue_size = 100});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(100, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(Submit(i, 10).ok());
  backend_->Hold(false);
  for (uint64_t i = 0; i < 5; ++i) EXPECT_TRUE(ResultOf(i).ok());
  const auto batches = backend_->Batches();
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0], (std::vector<uint64_t>{100}));
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{0, 1, 2, 3, 4}));
}

// A request that finds the backend idle goes at once, however long the delay: waiting would only
// delay it.
TEST_F(BatcherTest, LoneRequestOnAnIdleBackendGoesAtOnce) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 10'000'000, .max_queue_size = 100});
  for (uint64_t i = 1; i <= 3; ++i) {
    const auto start = Clock::now();
    ASSERT_TRUE(Submit(i, 10).ok());
    EXPECT_TRUE(ResultOf(i).ok());
    EXPECT_LT(Clock::now() - start, 1s) << "request " << i << " waited for company";
  }
  EXPECT_EQ(backend_->Batches().size(), 3u);
}

// With gather_when_idle, a lone request waits about the delay even on an idle backend.
TEST_F(BatcherTest, GatherWhenIdleMakesALoneRequestWaitTheDelay) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 50000, .gather_when_idle = true,
        .max_queue_size = 100});
  const auto start = Clock::now();
  ASSERT_TRUE(Submit(1, 10).ok());
  EXPECT_TRUE(ResultOf(1).ok());
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, 50ms);
  EXPECT_LT(waited, 1s);
}

// While the backend is busy (a batch running, a slot free), a request waits for company at most
// max_queue_delay_us; it goes sooner when the backend goes idle.
TEST_F(BatcherTest, WhileBusyARequestWaitsAtMostTheDelayOrUntilIdle) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 200'000, .max_queue_size = 100}, 2);
  backend_->Hold(true);
  ASSERT_TRUE(Submit(1, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  const auto start = Clock::now();
  ASSERT_TRUE(Submit(2, 10).ok());
  EXPECT_FALSE(backend_->WaitForBatches(2, 100ms)) << "request 2 did not wait while busy";
  ASSERT_TRUE(backend_->WaitForBatches(2, 2000ms)) << "request 2 waited past the delay";
  EXPECT_GE(Clock::now() - start, 150ms);
  backend_->Hold(false);
  EXPECT_TRUE(ResultOf(1).ok());
  EXPECT_TRUE(ResultOf(2).ok());
  // Request 11 waits behind the still running batches; once they end, the idle backend takes it
  // at once, long before its 10 s delay.
  batcher_.reset();
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 10'000'000, .max_queue_size = 100}, 2);
  backend_->Hold(true);
  ASSERT_TRUE(Submit(10, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  ASSERT_TRUE(Submit(11, 10).ok());
  EXPECT_FALSE(backend_->WaitForBatches(2, 100ms));
  const auto released = Clock::now();
  backend_->Hold(false);
  EXPECT_TRUE(ResultOf(10).ok());
  EXPECT_TRUE(ResultOf(11).ok());
  EXPECT_LT(Clock::now() - released, 2s) << "request 11 was not sent when the backend went idle";
}

// Session steps go to the step runner: at once while it can take a launch, and those that
// arrive while it cannot form its next launch.
TEST_F(BatcherTest, SessionStepsGoAtOnceAndGatherWhileTheRunnerIsBusy) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 10'000'000, .max_queue_size = 100});
  steps_->Hold(true);
  const auto start = Clock::now();
  ASSERT_TRUE(SubmitStep(1).ok());
  ASSERT_TRUE(steps_->WaitForBatches(1, 2000ms)) << "a lone step waited for company";
  EXPECT_LT(Clock::now() - start, 1s);
  for (uint64_t i = 2; i <= 4; ++i) ASSERT_TRUE(SubmitStep(i).ok());
  steps_->Hold(false);
  for (uint64_t i = 1; i <= 4; ++i) EXPECT_TRUE(ResultOf(i).ok());
  const auto batches = steps_->Batches();
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0], (std::vector<uint64_t>{1}));
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{2, 3, 4}));
  EXPECT_TRUE(backend_->Batches().empty()) << "a step reached the Attend runner";
  // With max_step_delay_us set, a step that arrives while the runner is busy (a slot free)
  // waits for company up to it.
  batcher_.reset();
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 0, .max_step_delay_us = 300'000,
        .max_queue_size = 100},
       1, 2);
  steps_->Hold(true);
  ASSERT_TRUE(SubmitStep(5).ok());
  ASSERT_TRUE(steps_->WaitForBatches(1));
  const auto t0 = Clock::now();
  ASSERT_TRUE(SubmitStep(6).ok());
  ASSERT_TRUE(steps_->WaitForBatches(2, 2000ms));
  EXPECT_GE(Clock::now() - t0, 250ms);
  steps_->Hold(false);
  EXPECT_TRUE(ResultOf(5).ok());
  EXPECT_TRUE(ResultOf(6).ok());
}

// With max_small_step_launches, decode steps beyond that many small launches in flight gather
// (even though the runner has free lanes) until one of them finishes; steps with more tokens
// ready than a small launch holds take a free lane at once.
TEST_F(BatcherTest, SmallStepLaunchesBeyondTheirCapGatherUntilOneFinishes) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 0, .max_small_step_launches = 1,
        .small_step_tokens = 8, .max_queue_size = 100},
       1, 3);
  steps_->Hold(true);
  ASSERT_TRUE(SubmitStep(1).ok());
  ASSERT_TRUE(steps_->WaitForBatches(1, 2000ms)) << "a lone step waited";
  ASSERT_TRUE(SubmitStep(2).ok());
  EXPECT_FALSE(steps_->WaitForBatches(2, 200ms)) << "a second small launch went beside the first";
  ASSERT_TRUE(SubmitStep(3, 16).ok());  // 17 tokens ready: not a small launch
  ASSERT_TRUE(steps_->WaitForBatches(2, 2000ms)) << "a large launch waited for a small one";
  ASSERT_TRUE(SubmitStep(4).ok());
  ASSERT_TRUE(SubmitStep(5).ok());
  EXPECT_FALSE(steps_->WaitForBatches(3, 200ms));
  steps_->Hold(false);
  for (uint64_t i = 1; i <= 5; ++i) EXPECT_TRUE(ResultOf(i).ok()) << i;
  const auto batches = steps_->Batches();
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0], (std::vector<uint64_t>{1}));
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{4, 5}));
  // Off (0): each small step takes a free lane.
  batcher_.reset();
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 0, .max_queue_size = 100}, 1, 3);
  steps_->Hold(true);
  for (uint64_t i = 6; i <= 8; ++i) {
    ASSERT_TRUE(SubmitStep(i).ok());
    ASSERT_TRUE(steps_->WaitForBatches(i - 5, 2000ms)) << "step " << i << " waited for a lane";
  }
  steps_->Hold(false);
  for (uint64_t i = 6; i <= 8; ++i) EXPECT_TRUE(ResultOf(i).ok()) << i;
  EXPECT_FALSE(Batcher::Create({.max_small_step_launches = -1}, backend_.get(), steps_.get(),
                               nullptr)
                   .ok());
}

// With small_step_cap_min_steps, the cap on small launches holds only while that many steps are
// queued or in launches: a few callers' steps take free lanes, many callers' gather.
TEST_F(BatcherTest, SmallStepCapHoldsOnlyFromItsNumberOfSteps) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 0, .max_small_step_launches = 1,
        .small_step_tokens = 8, .small_step_cap_min_steps = 3, .max_queue_size = 100},
       1, 4);
  steps_->Hold(true);
  ASSERT_TRUE(SubmitStep(1).ok());
  ASSERT_TRUE(steps_->WaitForBatches(1, 2000ms));
  ASSERT_TRUE(SubmitStep(2).ok());  // 2 steps in the batcher: below 3, the cap does not hold
  ASSERT_TRUE(steps_->WaitForBatches(2, 2000ms)) << "a second small launch waited below the bound";
  ASSERT_TRUE(SubmitStep(3).ok());  // 3 steps: it holds
  EXPECT_FALSE(steps_->WaitForBatches(3, 200ms)) << "a small launch went beside two at the bound";
  ASSERT_TRUE(SubmitStep(4).ok());
  EXPECT_FALSE(steps_->WaitForBatches(3, 200ms));
  steps_->Hold(false);
  for (uint64_t i = 1; i <= 4; ++i) EXPECT_TRUE(ResultOf(i).ok()) << i;
  const auto batches = steps_->Batches();
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0], (std::vector<uint64_t>{1}));
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{2}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{3, 4}));
  EXPECT_FALSE(Batcher::Create({.small_step_cap_min_steps = -1}, backend_.get(), steps_.get(),
                               nullptr)
                   .ok());
}

// A job the backend runs by a launch of its own (runs_alone) neither waits for company (nor
// behind a job that does) nor joins another's batch; the jobs around it still batch together.
TEST_F(BatcherTest, JobThatRunsAloneGoesAtOnceByItself) {
  // Room for three batches in flight: the busy one, job 3's, and room to spare.
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 10'000'000, .max_queue_size = 100}, 3);
  auto alone = [](v1::AttendRequest&, AttendJob* job) {
    if (job != nullptr) job->runs_alone = true;
  };
  const auto start = Clock::now();
  ASSERT_TRUE(SubmitEdited(1, 10, 1, alone).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1, 2000ms)) << "a job that runs alone waited for company";
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_TRUE(ResultOf(1).ok());
  backend_->Hold(true);
  ASSERT_TRUE(Submit(50, 10).ok());  // keeps the backend busy
  ASSERT_TRUE(backend_->WaitForBatches(2, 2000ms));
  ASSERT_TRUE(Submit(2, 10).ok());
  ASSERT_TRUE(SubmitEdited(3, 10, 1, alone).ok());
  ASSERT_TRUE(backend_->WaitForBatches(3, 2000ms)) << "job 3 waited behind job 2";
  ASSERT_TRUE(Submit(4, 10).ok());
  batcher_->StartDraining();  // flushes what waits for company
  backend_->Hold(false);
  for (uint64_t i = 2; i <= 4; ++i) EXPECT_TRUE(ResultOf(i).ok());
  const auto batches = backend_->Batches();
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_EQ(batches[0], (std::vector<uint64_t>{1}));
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{50}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{3}));
  EXPECT_EQ(batches[3], (std::vector<uint64_t>{2, 4}));
}

TEST_F(BatcherTest, FullBatchGoesAtOnceAndRespectsTokenLimit) {
  // 30 tokens per batch at most: jobs of 10 tokens go in threes, without waiting the delay.
  Make({.max_batch_tokens = 30, .max_queue_delay_us = 10'000'000, .max_queue_size = 100});
  backend_->Hold(true);
  for (uint64_t i = 0; i < 7; ++i) ASSERT_TRUE(Submit(i, 10).ok());
  const auto start = Clock::now();
  backend_->Hold(false);
  for (uint64_t i = 0; i < 6; ++i) EXPECT_TRUE(ResultOf(i).ok());
  EXPECT_LT(Clock::now() - start, 2s) << "full batches must not wait for the delay";
  const auto batches = backend_->Batches();
  ASSERT_GE(batches.size(), 2u);
  for (const auto& b : batches) EXPECT_LE(b.size(), 3u);
  batcher_->Drain();  // the last job of 10 tokens is flushed by draining
  EXPECT_TRUE(ResultOf(6).ok());
}

TEST_F(BatcherTest, DifferentKeysGoToDifferentBatches) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 100000, .max_queue_size = 100});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(0, 10).ok());  // keeps the backend busy while the others gather
  ASSERT_TRUE(backend_->WaitForBatches(1));
  ASSERT_TRUE(Submit(1, 10, /*heads=*/1).ok());
  ASSERT_TRUE(Submit(2, 10, /*heads=*/2).ok());
  ASSERT_TRUE(Submit(3, 10, /*heads=*/1).ok());
  backend_->Hold(false);
  for (uint64_t i = 1; i <= 3; ++i) EXPECT_TRUE(ResultOf(i).ok());
  const auto batches = backend_->Batches();
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[1], (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(batches[2], (std::vector<uint64_t>{2}));
}

TEST_F(BatcherTest, EveryFieldOfTheKeySeparatesBatches) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 100000, .max_queue_size = 100});
  using Edit = std::function<void(v1::AttendRequest&, AttendJob*)>;
  const std::vector<Edit> edits = {
      [](v1::AttendRequest&, AttendJob*) {},  // the plain request
      [](v1::AttendRequest& r, AttendJob* job) {
        if (job) return;
        for (auto* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
          t->set_dtype(v1::DTYPE_FLOAT16);
        }
      },
      [](v1::AttendRequest& r, AttendJob* job) {
        if (!job) r.set_causal(true);
      },
      [](v1::AttendRequest& r, AttendJob* job) {
        if (!job) r.mutable_window()->set_left(3);
      },
      [](v1::AttendRequest& r, AttendJob* job) {
        if (!job) r.set_softmax_scale(0.5f);
      },
      [](v1::AttendRequest&, AttendJob* job) {
        if (job) job->key.staged_dtype = kernels::DType::kFloat16;
      },
  };
  // Two requests of each kind, interleaved, while the backend is busy: each kind must make one
  // batch of its own two.
  backend_->Hold(true);
  ASSERT_TRUE(Submit(9999, 5, 7).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  for (int round = 0; round < 2; ++round) {
    for (size_t e = 0; e < edits.size(); ++e) {
      ASSERT_TRUE(SubmitEdited(e * 10 + round, 5, 1, edits[e]).ok()) << e;
    }
  }
  backend_->Hold(false);
  for (const auto& [id, call] : calls_) EXPECT_TRUE(ResultOf(id).ok()) << id;
  auto batches = backend_->Batches();
  ASSERT_EQ(batches.front(), (std::vector<uint64_t>{9999}));
  batches.erase(batches.begin());
  std::sort(batches.begin(), batches.end());
  ASSERT_EQ(batches.size(), edits.size());
  for (size_t e = 0; e < edits.size(); ++e) {
    EXPECT_EQ(batches[e], (std::vector<uint64_t>{e * 10, e * 10 + 1}));
  }
}

TEST_F(BatcherTest, FullQueueIsResourceExhaustedAtOnce) {
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 3});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(0, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));  // job 0 is running, the queue is empty
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(Submit(i, 10).ok());
  const absl::Status st = Submit(4, 10);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("max_queue_size"), std::string::npos);
  EXPECT_EQ(calls_.at(4)->done_calls.load(), 0) << "a refused job must not be completed";
  backend_->Hold(false);
  for (uint64_t i = 0; i <= 3; ++i) EXPECT_TRUE(ResultOf(i).ok());
}

TEST_F(BatcherTest, InflightBytesBound) {
  // Each job of 10 tokens x 64 bf16 holds q, k, v and o: 4 * 1280 bytes.
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 100,
        .max_inflight_bytes = 3 * 4 * 1280});
  backend_->Hold(true);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(Submit(i, 10).ok());
  const absl::Status st = Submit(3, 10);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("max_inflight_bytes"), std::string::npos);
  backend_->Hold(false);
  for (uint64_t i = 0; i < 3; ++i) EXPECT_TRUE(ResultOf(i).ok());
  EXPECT_EQ(batcher_->InflightBytes(), 0);
  EXPECT_TRUE(Submit(4, 10).ok()) << "bytes are given back when requests complete";
  EXPECT_TRUE(ResultOf(4).ok());
}

TEST_F(BatcherTest, ExpiredDeadlineInQueueIsNotComputed) {
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 100});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(0, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  ASSERT_TRUE(Submit(1, 10, 1, false, Clock::now() + 30ms).ok());
  EXPECT_EQ(ResultOf(1).code(), absl::StatusCode::kDeadlineExceeded);
  backend_->Hold(false);
  EXPECT_TRUE(ResultOf(0).ok());
  batcher_->Drain();
  for (const auto& b : backend_->Batches()) {
    EXPECT_EQ(std::count(b.begin(), b.end(), 1u), 0) << "expired job reached the backend";
  }
}

TEST_F(BatcherTest, CancelledRequestIsDropped) {
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 100});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(0, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  std::atomic<bool> cancelled{false};
  ASSERT_TRUE(Submit(1, 10, 1, false, Clock::time_point::max(), [&] { return cancelled.load(); }).ok());
  cancelled = true;
  EXPECT_EQ(ResultOf(1).code(), absl::StatusCode::kCancelled);
  backend_->Hold(false);
  EXPECT_TRUE(ResultOf(0).ok());
  batcher_->Drain();
  EXPECT_EQ(backend_->Batches().size(), 1u);
}

TEST_F(BatcherTest, ExpiredAndCancelledInQueueIsDeadlineExceeded) {
  // gRPC cancels a call whose deadline passed; the caller must still learn it was the deadline.
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 100});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(0, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  const auto deadline = Clock::now() + 30ms;
  ASSERT_TRUE(Submit(1, 10, 1, false, deadline, [deadline] { return Clock::now() >= deadline; })
                  .ok());
  EXPECT_EQ(ResultOf(1).code(), absl::StatusCode::kDeadlineExceeded);
  backend_->Hold(false);
  EXPECT_TRUE(ResultOf(0).ok());
}

TEST_F(BatcherTest, JobIsPendingUntilItsDoneReturnsAndDrainWaitsForIt) {
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 100});
  backend_->FinishBeforeDone(/*hold_done=*/true);
  ASSERT_TRUE(Submit(0, 10).ok());
  ASSERT_TRUE(backend_->WaitForFinished(1));  // the batch is reported finished, done not run
  EXPECT_EQ(batcher_->Pending(), 1);
  EXPECT_GT(batcher_->InflightBytes(), 0);
  auto drained = std::async(std::launch::async, [&] { batcher_->Drain(); });
  EXPECT_EQ(drained.wait_for(100ms), std::future_status::timeout)
      << "Drain returned while a request was still being completed";
  backend_->FinishBeforeDone(/*hold_done=*/false);
  EXPECT_EQ(drained.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(ResultOf(0).ok());
  EXPECT_EQ(batcher_->Pending(), 0);
  EXPECT_EQ(batcher_->InflightBytes(), 0);
}

TEST_F(BatcherTest, HighPriorityGoesFirst) {
  Make({.max_batch_tokens = 10, .max_queue_delay_us = 0, .max_queue_size = 100});
  backend_->Hold(true);
  ASSERT_TRUE(Submit(0, 10).ok());
  ASSERT_TRUE(backend_->WaitForBatches(1));
  ASSERT_TRUE(Submit(1, 10).ok());
  ASSERT_TRUE(Submit(2, 10).ok());
  ASSERT_TRUE(Submit(3, 10, 1, /*high=*/true).ok());
  backend_->Hold(false);
  for (uint64_t i = 0; i <= 3; ++i) EXPECT_TRUE(ResultOf(i).ok());
  const auto batches = backend_->Batches();
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_EQ(batches[1], std::vector<uint64_t>{3});
  EXPECT_EQ(batches[2], std::vector<uint64_t>{1});
  EXPECT_EQ(batches[3], std::vector<uint64_t>{2});
}

TEST_F(BatcherTest, EveryResultReachesItsOwnRequestExactlyOnce) {
  Make({.max_batch_tokens = 64, .max_queue_delay_us = 2000, .max_queue_size = 10000}, 3);
  constexpr int kThreads = 4, kPerThread = 100;
  std::vector<std::thread> threads;
  std::mutex mu;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        std::lock_guard<std::mutex> lock(mu);  // calls_ is a plain map
        ASSERT_TRUE(Submit(t * kPerThread + i, 1 + (i % 7), 1 + (i % 2)).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  for (uint64_t id = 0; id < kThreads * kPerThread; ++id) {
    EXPECT_TRUE(ResultOf(id).ok());
    EXPECT_EQ(calls_.at(id)->answer, id + 1000);
  }
  batcher_->Drain();
  for (auto& [id, call] : calls_) EXPECT_EQ(call->done_calls.load(), 1) << id;
  EXPECT_EQ(batcher_->Pending(), 0);
}

// The start of a drain: queued jobs go without waiting out the delay, and a job submitted then
// (a session step that waited for its layer, its call accepted before the drain) is taken and
// goes at once too; only Drain refuses.
TEST_F(BatcherTest, StartDrainingDispatchesAtOnceAndStillTakesJobs) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 60'000'000, .max_queue_size = 100}, 2);
  backend_->Hold(true);
  ASSERT_TRUE(Submit(99, 10).ok());  // busy: job 0 would wait a minute for company
  ASSERT_TRUE(backend_->WaitForBatches(1));
  ASSERT_TRUE(Submit(0, 10).ok());
  EXPECT_FALSE(backend_->WaitForBatches(2, 100ms));
  batcher_->StartDraining();
  EXPECT_TRUE(backend_->WaitForBatches(2, 2000ms)) << "the drain did not send job 0 at once";
  backend_->Hold(false);
  EXPECT_TRUE(ResultOf(0).ok());
  ASSERT_TRUE(Submit(1, 10).ok());
  EXPECT_TRUE(ResultOf(1).ok());
  batcher_->Drain();
  EXPECT_EQ(Submit(2, 10).code(), absl::StatusCode::kUnavailable);
}

TEST_F(BatcherTest, DrainFinishesQueuedWorkThenRefuses) {
  Make({.max_batch_tokens = 1000, .max_queue_delay_us = 10'000'000, .max_queue_size = 100});
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(Submit(i, 10).ok());
  batcher_->Drain();
  for (uint64_t i = 0; i < 3; ++i) EXPECT_TRUE(ResultOf(i).ok());
  EXPECT_EQ(Submit(9, 10).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attn
