// A fixed pool of worker threads for the CPU backend. Created once by its owner (the server's
// CpuBackend, or a test) and passed to each call; kernels never create threads themselves.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace attn::kernels::cpu {

class CpuThreadPool {
 public:
  // num_threads workers in all, the calling thread of ParallelFor counted as one; 0 means
  // std::thread::hardware_concurrency().
  static std::unique_ptr<CpuThreadPool> Create(int num_threads);
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  int NumWorkers() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs fn(item, worker) for every item in [0, n), spread over the workers with dynamic
  // scheduling; worker is in [0, NumWorkers()). Returns when all items are done. Calls from
  // several threads are serialized.
  void ParallelFor(int64_t n, const std::function<void(int64_t item, int worker)>& fn);
  // The same when no other call is in progress; otherwise returns false at once, having run
  // nothing (for callers that would rather do the work themselves than wait their turn).
  bool TryParallelFor(int64_t n, const std::function<void(int64_t item, int worker)>& fn);

 private:
  explicit CpuThreadPool(int num_threads);
  void RunLocked(int64_t n, const std::function<void(int64_t, int)>& fn);  // call_mu_ held
  void WorkerLoop(int worker);
  void Drain(const std::function<void(int64_t, int)>& fn, int64_t n, int worker);

  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  uint64_t generation_ = 0;
  int unfinished_workers_ = 0;  // workers yet to finish the current call
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace attn::kernels::cpu
