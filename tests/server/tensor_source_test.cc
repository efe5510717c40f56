// ResolveTensor / ResolveSlice on their own: what a session Step (q, k_new, v_new, o_region) calls
// to read a tensor from the message or a region, with the field named in every error, and the
// hold that keeps a region mapped while it is used.
#include "transport/tensor_source.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "transport/region_registry.h"

namespace attn {
namespace {

constexpr uint64_t kRegionBytes = 1 << 16;

// A registry holding one host region "r" of identity "alice".
class TensorSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int fd = memfd_create("r", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kRegionBytes), 0);
    ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    auto region = SharedRegion::MapMemfd(fd, kRegionBytes);
    close(fd);
    ASSERT_TRUE(region.ok()) << region.status();
    base_ = (*region)->data();
    auto handle = registry_.AddPending(std::move(*region), 1);
    ASSERT_TRUE(handle.ok());
    v1::RegisterRegionRequest r;
    r.set_name("r");
    r.set_kind(v1::REGION_KIND_HOST);
    r.set_handle(*handle);
    ASSERT_TRUE(registry_.Register("alice", r).ok());
  }
  static v1::Tensor InRegion(uint64_t offset, uint64_t bytes) {
    v1::Tensor t;
    t.mutable_region()->set_region("r");
    t.mutable_region()->set_offset(offset);
    t.mutable_region()->set_bytes(bytes);
    return t;
  }
  int64_t InFlight() { return registry_.List("alice").at(0).in_flight(); }

  RegionRegistry registry_{RegionRegistry::Options{}, nullptr};
  char* base_ = nullptr;
};

TEST_F(TensorSourceTest, InlineDataIsUsedWhereItIs) {
  v1::Tensor t;
  t.set_data("abcd");
  auto b = ResolveTensor(t, "k_new", {4, 2}, "alice", &registry_);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data, t.data().data());
  EXPECT_EQ(b->bytes, 4u);
  EXPECT_EQ(b->hold, nullptr);
}

TEST_F(TensorSourceTest, RegionSliceIsHeldWhileUsed) {
  auto b = ResolveTensor(InRegion(256, 1024), "k_new", {1024, 2}, "alice", &registry_);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data, base_ + 256);
  EXPECT_EQ(b->bytes, 1024u);
  EXPECT_FALSE(b->on_gpu);
  EXPECT_EQ(InFlight(), 1);
  // Unregistered while held: still mapped (the write below would fault otherwise).
  ASSERT_TRUE(registry_.Unregister("alice", "r").ok());
  b->data[0] = 1;
  b->hold.reset();
}

TEST_F(TensorSourceTest, ErrorsNameTheCallersField) {
  auto b = ResolveTensor(InRegion(0, 100), "k_new", {128, 2}, "alice", &registry_);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("k_new.region.bytes is 100, but the tensor needs 128"),
            std::string::npos)
      << b.status();
  b = ResolveTensor(InRegion(kRegionBytes - 8, 16), "v_new", {16, 2}, "alice", &registry_);
  EXPECT_NE(b.status().message().find("v_new.region: offset"), std::string::npos) << b.status();
  b = ResolveTensor(InRegion(0, 16), "q", {16, 2}, "bob", &registry_);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(b.status().message().find("q.region.region: no region named 'r'"), std::string::npos);
  v1::RegionSlice o;
  o.set_region("r");
  o.set_bytes(16);
  auto s = ResolveSlice(o, "o_region", {16, 2}, "alice", nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("o_region names a shared-memory region"), std::string::npos);
  EXPECT_EQ(InFlight(), 0);  // nothing held after the failures
}

// A slice starts at a multiple of its element size; any such offset is taken, the others are
// refused by name with the offset and the rule, holding nothing.
TEST_F(TensorSourceTest, OffsetsMustBeMultiplesOfTheElementSize) {
  for (uint64_t element : {1, 2, 4}) {
    for (uint64_t offset = 0; offset < 12; ++offset) {
      auto b = ResolveTensor(InRegion(1024 + offset, 64), "k", {64, element}, "alice", &registry_);
      if (offset % element == 0) {
        ASSERT_TRUE(b.ok()) << element << " " << offset << ": " << b.status();
        EXPECT_EQ(b->data, base_ + 1024 + offset);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data) % element, 0u);
        continue;
      }
      EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(b.status().message().find(
                    absl::StrCat("k.region: offset ", 1024 + offset, " is not a multiple of ",
                                 element, ", the size of the tensor's elements: a tensor in a "
                                 "region must start at a multiple of its element size")),
                std::string::npos)
          << b.status();
      EXPECT_EQ(InFlight(), 0);
    }
  }
  v1::RegionSlice lse;
  lse.set_region("r");
  lse.set_offset(6);
  lse.set_bytes(32);
  auto s = ResolveSlice(lse, "lse_region", {32, 4}, "alice", &registry_);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("lse_region: offset 6 is not a multiple of 4"),
            std::string::npos)
      << s.status();
}

}  // namespace
}  // namespace attn
