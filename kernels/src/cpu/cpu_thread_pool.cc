#include "attn/kernels/cpu_thread_pool.h"

namespace attn::kernels::cpu {

std::unique_ptr<CpuThreadPool> CpuThreadPool::Create(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = 1;
  return std::unique_ptr<CpuThreadPool>(new CpuThreadPool(num_threads));
}

CpuThreadPool::CpuThreadPool(int num_threads) {
  for (int w = 1; w < num_threads; ++w) threads_.emplace_back([this, w] { WorkerLoop(w); });
}

CpuThreadPool::~CpuThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CpuThreadPool::Drain(const std::function<void(int64_t, int)>& fn, int64_t n, int worker) {
  for (int64_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) fn(i, worker);
}

void CpuThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int)>* fn;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
    }
    Drain(*fn, n, worker);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--unfinished_workers_ == 0) done_cv_.notify_all();
    }
  }
}

void CpuThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  RunLocked(n, fn);
}

bool CpuThreadPool::TryParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn) {
  std::unique_lock<std::mutex> call_lock(call_mu_, std::try_to_lock);
  if (!call_lock.owns_lock()) return false;
  if (n > 0) RunLocked(n, fn);
  return true;
}

void CpuThreadPool::RunLocked(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (threads_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    unfinished_workers_ = static_cast<int>(threads_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  Drain(fn, n, 0);
  // Every worker checks in for every call, even one that wakes after the items ran out: one that
  // came late to this call must not find the next call's state half written.
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return unfinished_workers_ == 0; });
  fn_ = nullptr;
}

}  // namespace attn::kernels::cpu
