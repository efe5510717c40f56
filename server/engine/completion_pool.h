// A fixed set of threads that run posted tasks in order of arrival. The CUDA backend hands each
// finished request to it, so that copying results into responses and finishing the calls runs
// in parallel and off the stream lanes, which go on to the next batch at once.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attn {

class CompletionPool {
 public:
  explicit CompletionPool(int threads);
  ~CompletionPool();  // Runs every task already posted, then joins.

  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;

  void Post(std::function<void()> task);

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace attn
