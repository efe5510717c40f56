// Timing for the coding benchmarks: the median of repeated runs, robust to the odd slow one.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace attn::util {

// Median seconds of fn over about `seconds` of repeats (at least 5).
inline double MedianSeconds(const std::function<void()>& fn, double seconds) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> t;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (t.size() < 5 || Clock::now() < end) {
    const auto start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

}  // namespace attn::util
