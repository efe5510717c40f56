// Throughput of the dtype conversions on the host paths of attnd (Google Benchmark): float32 to
// and from float16/bfloat16 over whole tensors, as the CUDA backend stages float32 requests
// (StageTensor/UnstageTensor in server/backends/cuda_backend.cc), and row by row as the CPU backend loads
// its inputs and stores its output (LoadRow/StoreRow).
//
//   build/kernels/bench/dtype_convert_bench                       # all, 4 Ki..16 Mi elements
//   build/kernels/bench/dtype_convert_bench --benchmark_filter=Bf16
//
// bytes_per_second counts the bytes read plus the bytes written.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "attn/kernels/dtype_convert.h"

namespace {

using attn::kernels::DType;
namespace cpu = attn::kernels::cpu;

std::vector<float> RandomFloats(size_t n) {
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint16_t> RandomBits(size_t n, bool bf16) {
  const std::vector<float> f = RandomFloats(n);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16 ? cpu::FloatToBf16Bits(f[i]) : cpu::FloatToHalfBits(f[i]);
  return v;
}

template <bool kBf16>
void BM_FloatTo16(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<float> in = RandomFloats(n);
  std::vector<uint16_t> out(n);
  for (auto _ : state) {
    for (size_t i = 0; i < n; ++i) {
      out[i] = kBf16 ? cpu::FloatToBf16Bits(in[i]) : cpu::FloatToHalfBits(in[i]);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * n);
  state.SetBytesProcessed(int64_t(state.iterations()) * n * (4 + 2));
}

template <bool kBf16>
void BM_16ToFloat(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const std::vector<uint16_t> in = RandomBits(n, kBf16);
  std::vector<float> out(n);
  for (auto _ : state) {
    for (size_t i = 0; i < n; ++i) {
      out[i] = kBf16 ? cpu::Bf16BitsToFloat(in[i]) : cpu::HalfBitsToFloat(in[i]);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * n);
  state.SetBytesProcessed(int64_t(state.iterations()) * n * (2 + 4));
}

// The CPU backend's row path: a [rows, head_dim] tensor loaded (with the softmax scale folded
// in) and stored back row by row, head_dim = state.range(1).
template <DType kType>
void BM_LoadStoreRows(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int d = static_cast<int>(state.range(1));
  const int64_t rows = n / d;
  const size_t elem = kType == DType::kFloat32 ? 4 : 2;
  std::vector<char> in(n * elem), out(n * elem);
  {
    const std::vector<float> f = RandomFloats(n);
    for (int64_t r = 0; r < rows; ++r) cpu::StoreRow(kType, f.data() + r * d, d, in.data(), r * d);
  }
  std::vector<float> row(d);
  for (auto _ : state) {
    for (int64_t r = 0; r < rows; ++r) {
      cpu::LoadRow(kType, in.data(), r * d, d, row.data(), 0.125f);
      cpu::StoreRow(kType, row.data(), d, out.data(), r * d);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * rows * d);
  state.SetBytesProcessed(int64_t(state.iterations()) * rows * d * elem * 2);
}

constexpr int64_t kMin = 1 << 12, kMax = 1 << 24;

BENCHMARK(BM_FloatTo16<false>)->Name("FloatToHalf")->RangeMultiplier(16)->Range(kMin, kMax);
BENCHMARK(BM_FloatTo16<true>)->Name("FloatToBf16")->RangeMultiplier(16)->Range(kMin, kMax);
BENCHMARK(BM_16ToFloat<false>)->Name("HalfToFloat")->RangeMultiplier(16)->Range(kMin, kMax);
BENCHMARK(BM_16ToFloat<true>)->Name("Bf16ToFloat")->RangeMultiplier(16)->Range(kMin, kMax);
BENCHMARK(BM_LoadStoreRows<DType::kFloat16>)
    ->Name("LoadStoreRowsHalf")
    ->ArgsProduct({{1 << 20}, {64, 128}});
BENCHMARK(BM_LoadStoreRows<DType::kBFloat16>)
    ->Name("LoadStoreRowsBf16")
    ->ArgsProduct({{1 << 20}, {64, 128}});
BENCHMARK(BM_LoadStoreRows<DType::kFloat32>)
    ->Name("LoadStoreRowsFloat")
    ->ArgsProduct({{1 << 20}, {64, 128}});

}  // namespace

BENCHMARK_MAIN();
