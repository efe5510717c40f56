// PinnedPool logic with a counting malloc allocator: reuse, exhaustion, no leak.
#include "memory/pinned_pool.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>

namespace attn {
namespace {

struct CountingAllocator {
  int allocs = 0;
  int frees = 0;
  std::set<void*> live;
  PinnedPool::Allocator Get() {
    return {[this](size_t n) {
              void* p = std::malloc(n);
              ++allocs;
              live.insert(p);
              return p;
            },
            [this](void* p) {
              ++frees;
              live.erase(p);
              std::free(p);
            }};
  }
};

constexpr size_t kClass = PinnedPool::kMinClassBytes;

TEST(PinnedPoolTest, ReusesReturnedBuffers) {
  CountingAllocator alloc;
  {
    auto pool = *PinnedPool::Create(16 * kClass, alloc.Get());
    void* first;
    {
      auto b = pool->Acquire(1000);
      ASSERT_TRUE(b.ok());
      EXPECT_GE(b->capacity(), 1000u);
      first = b->data();
      EXPECT_EQ(pool->Bytes().used, int64_t(kClass));
    }
    EXPECT_EQ(pool->Bytes().used, 0);
    EXPECT_EQ(pool->Bytes().reserved, int64_t(kClass));
    auto again = pool->Acquire(kClass);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->data(), first);
    EXPECT_EQ(alloc.allocs, 1);
  }
  EXPECT_EQ(alloc.allocs, alloc.frees);
  EXPECT_TRUE(alloc.live.empty());
}

TEST(PinnedPoolTest, ExhaustionIsResourceExhaustedAndRecoverable) {
  CountingAllocator alloc;
  auto pool = *PinnedPool::Create(4 * kClass, alloc.Get());
  auto a = pool->Acquire(2 * kClass);
  auto b = pool->Acquire(2 * kClass);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = pool->Acquire(1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("pinned_pool_bytes"), std::string::npos);
  auto too_big = pool->Acquire(8 * kClass);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  *a = PinnedBuffer();  // give one back
  auto d = pool->Acquire(kClass);  // another size class: the cached buffer is released for it
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_LE(pool->Bytes().reserved, 4 * int64_t(kClass));
}

TEST(PinnedPoolTest, FailedAllocationIsReportedNotCrashing) {
  auto pool = *PinnedPool::Create(64 * kClass, {[](size_t) -> void* { return nullptr; },
                                                [](void*) {}});
  auto b = pool->Acquire(10);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Bytes().used, 0);
  EXPECT_EQ(pool->Bytes().reserved, 0);
}

TEST(PinnedPoolTest, ManyLoansNoLeak) {
  CountingAllocator alloc;
  {
    auto pool = *PinnedPool::Create(64 * kClass, alloc.Get());
    for (int round = 0; round < 50; ++round) {
      std::vector<PinnedBuffer> held;
      for (int i = 0; i < 6; ++i) {
        auto b = pool->Acquire(size_t(1 + (round * 7 + i) % 5) * kClass);
        ASSERT_TRUE(b.ok()) << b.status();
        held.push_back(std::move(*b));
      }
    }
    EXPECT_EQ(pool->Bytes().used, 0);
    EXPECT_LE(pool->Bytes().reserved, 64 * int64_t(kClass));
  }
  EXPECT_TRUE(alloc.live.empty());
}

}  // namespace
}  // namespace attn
