// The CPU thread pool on its own: every item of every call runs exactly once, with that call's
// function, including when calls follow each other faster than the workers wake up.
#include "attn/kernels/cpu_thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>
#include <vector>

namespace attn::kernels::cpu {
namespace {

TEST(CpuThreadPoolTest, EveryItemOnceWithItsOwnCallsFunction) {
  auto pool = CpuThreadPool::Create(4);
  ASSERT_EQ(pool->NumWorkers(), 4);
  constexpr int kCalls = 20000;
  std::vector<std::atomic<int>> runs(8);
  int wrong_call = 0;
  std::atomic<int> wrong_worker{0};
  for (int call = 0; call < kCalls; ++call) {
    // Tiny calls (2-8 items) finish before late workers wake: the case where a late worker could
    // run the next call's items with a stale function.
    const int64_t n = 2 + call % 7;
    for (auto& r : runs) r.store(0);
    std::atomic<int> seen_call{call};
    pool->ParallelFor(n, [&, call](int64_t item, int worker) {
      if (seen_call.load() != call) ++wrong_worker;
      if (worker < 0 || worker >= 4) ++wrong_worker;
      runs[static_cast<size_t>(item)].fetch_add(1);
    });
    seen_call.store(-1);  // a late run of this call's function after return is caught next time
    for (int64_t i = 0; i < 8; ++i) {
      if (runs[static_cast<size_t>(i)].load() != (i < n ? 1 : 0)) ++wrong_call;
    }
  }
  EXPECT_EQ(wrong_call, 0) << "items run zero or several times";
  EXPECT_EQ(wrong_worker.load(), 0) << "a function ran outside its own call or with a bad worker";
}

TEST(CpuThreadPoolTest, CallsFromSeveralThreadsEachGetAllTheirItems) {
  auto pool = CpuThreadPool::Create(3);
  constexpr int kCallers = 4, kCalls = 500, kItems = 16;
  std::vector<std::atomic<int64_t>> per_caller(kCallers);
  std::vector<std::thread> callers;
  for (int t = 0; t < kCallers; ++t) {
    callers.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        pool->ParallelFor(kItems, [&](int64_t, int) { per_caller[size_t(t)].fetch_add(1); });
      }
    });
  }
  for (auto& t : callers) t.join();
  for (int t = 0; t < kCallers; ++t) EXPECT_EQ(per_caller[size_t(t)].load(), kCalls * kItems);
}

TEST(CpuThreadPoolTest, SingleWorkerPoolRunsOnTheCaller) {
  auto pool = CpuThreadPool::Create(1);
  const auto caller = std::this_thread::get_id();
  int ran = 0;
  pool->ParallelFor(5, [&](int64_t, int worker) {
    EXPECT_EQ(worker, 0);
    EXPECT_EQ(std::this_thread::get_id(), caller);
    ++ran;
  });
  EXPECT_EQ(ran, 5);
}

TEST(CpuThreadPoolTest, TryParallelForDeclinesWhileAnotherCallRuns) {
  auto pool = CpuThreadPool::Create(3);
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::thread holder([&] {
    pool->ParallelFor(1, [&](int64_t, int) {
      entered.set_value();
      released.wait();
    });
  });
  entered.get_future().wait();
  int ran = 0;
  EXPECT_FALSE(pool->TryParallelFor(10, [&](int64_t, int) { ++ran; }));
  EXPECT_EQ(ran, 0) << "a declined call must run nothing";
  release.set_value();
  holder.join();
  std::atomic<int> items{0};
  EXPECT_TRUE(pool->TryParallelFor(100, [&](int64_t, int) { items.fetch_add(1); }));
  EXPECT_EQ(items.load(), 100);
}

}  // namespace
}  // namespace attn::kernels::cpu
