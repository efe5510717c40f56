// HostCopier: every element copied or converted exactly once, on one thread or split in pieces
// over the pool, for sizes that do and do not divide into pieces, at any byte address.
#include "backends/host_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "attn/kernels/dtype_convert.h"

namespace attn {
namespace {

namespace cpu = kernels::cpu;

class HostCopyTest : public ::testing::TestWithParam<bool> {
 protected:
  // Parallel: pieces of 1000 bytes, split from 1 byte on, over 4 threads; else all inline.
  HostCopier Copier() {
    if (!GetParam()) return HostCopier(nullptr);
    return HostCopier(pool_.get(), /*parallel_min_bytes=*/1, /*chunk_bytes=*/1000);
  }
  std::vector<float> RandomFloats(size_t n) {
    std::normal_distribution<float> d(0.0f, 100.0f);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::unique_ptr<cpu::CpuThreadPool> pool_ = cpu::CpuThreadPool::Create(4);
  std::mt19937_64 rng_{std::random_device{}()};
};

TEST_P(HostCopyTest, BytesAreCopiedExactly) {
  for (size_t n : {size_t{1}, size_t{999}, size_t{1000}, size_t{123457}}) {
    std::vector<uint8_t> src(n), dst(n + 16, 0xAB);
    for (auto& b : src) b = static_cast<uint8_t>(rng_());
    const HostCopy c{src.data(), dst.data() + 8, n, ElementCast::kNone};
    Copier().Run({&c, 1});
    EXPECT_EQ(std::memcmp(src.data(), dst.data() + 8, n), 0) << n;
    for (int i = 0; i < 8; ++i) {
      ASSERT_EQ(dst[i], 0xAB) << "wrote before the destination, n " << n;
      ASSERT_EQ(dst[n + 8 + i], 0xAB) << "wrote past the destination, n " << n;
    }
  }
}

TEST_P(HostCopyTest, FloatsAreConvertedBothWays) {
  const size_t n = 70001;  // not a multiple of the piece size in any element width
  const std::vector<float> src = RandomFloats(n);
  std::vector<uint16_t> half(n, 0xFFFF), bf16(n, 0xFFFF);
  std::vector<float> back_half(n, -1.0f), back_bf16(n, -1.0f);
  const HostCopy down[] = {{src.data(), half.data(), n, ElementCast::kFloatToHalf},
                           {src.data(), bf16.data(), n, ElementCast::kFloatToBf16}};
  Copier().Run(down);
  const HostCopy up[] = {{half.data(), back_half.data(), n, ElementCast::kHalfToFloat},
                         {bf16.data(), back_bf16.data(), n, ElementCast::kBf16ToFloat}};
  Copier().Run(up);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(half[i], cpu::FloatToHalfBits(src[i])) << i;
    ASSERT_EQ(bf16[i], cpu::FloatToBf16Bits(src[i])) << i;
    ASSERT_EQ(back_half[i], cpu::HalfBitsToFloat(half[i])) << i;
    ASSERT_EQ(back_bf16[i], cpu::Bf16BitsToFloat(bf16[i])) << i;
  }
}

// Source and destination at odd byte addresses (a caller's buffer may be anywhere): the same
// elements as from aligned ones (under UBSan: no misaligned load or store).
TEST_P(HostCopyTest, ConvertsAtAnyByteAddress) {
  const size_t n = 3001;
  const std::vector<float> src = RandomFloats(n);
  for (size_t skew : {1, 2, 3}) {
    std::vector<char> in(4 * n + 8), mid(2 * n + 8), out(4 * n + 8);
    std::memcpy(in.data() + skew, src.data(), 4 * n);
    const HostCopy down{in.data() + skew, mid.data() + skew, n, ElementCast::kFloatToBf16};
    Copier().Run({&down, 1});
    const HostCopy up{mid.data() + skew, out.data() + skew, n, ElementCast::kBf16ToFloat};
    Copier().Run({&up, 1});
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      float f;
      std::memcpy(&b, mid.data() + skew + 2 * i, 2);
      std::memcpy(&f, out.data() + skew + 4 * i, 4);
      ASSERT_EQ(b, cpu::FloatToBf16Bits(src[i])) << skew << " " << i;
      ASSERT_EQ(f, cpu::Bf16BitsToFloat(b)) << skew << " " << i;
    }
  }
}

TEST_P(HostCopyTest, CopiesOnTheCallerWhileThePoolIsBusy) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::thread holder([&] {
    pool_->ParallelFor(1, [&](int64_t, int) {
      entered.set_value();
      released.wait();
    });
  });
  entered.get_future().wait();
  const std::vector<float> src = RandomFloats(5000);
  std::vector<uint16_t> bf16(src.size(), 0xFFFF);
  const HostCopy c{src.data(), bf16.data(), src.size(), ElementCast::kFloatToBf16};
  Copier().Run({&c, 1});  // must neither wait for the holder nor skip the copy
  release.set_value();
  holder.join();
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(bf16[i], cpu::FloatToBf16Bits(src[i])) << i;
}

TEST_P(HostCopyTest, EmptyCopiesAreFine) {
  const HostCopy c{nullptr, nullptr, 0, ElementCast::kFloatToHalf};
  Copier().Run({&c, 1});
  Copier().Run({});
}

INSTANTIATE_TEST_SUITE_P(InlineAndSplit, HostCopyTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Split" : "Inline"; });

}  // namespace
}  // namespace attn
