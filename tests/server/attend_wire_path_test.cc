// Attend's wire path end to end, through real gRPC servers on loopback and the C++ client (the
// generated stub): on fresh random requests of every dtype, with lse, varlen batches, GQA, masks
// and windows, its answers equal byte for byte those of a server that codes whole protobuf
// messages (--attend_wire_path=false), and match the float64 reference. Also with many calls at
// once, and with messages of tens of MB (many slices each way).
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <thread>
#include <vector>

#include "test_util.h"

namespace attn {
namespace {

using testing::MakeRandomRequest;
using testing::RequestShape;

class AttendWirePathTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions wire;
    wire.max_message_bytes = 256 << 20;
    wire_ = new testing::LoopbackServer(testing::StartLoopbackServer(wire));
    ServerOptions proto = wire;
    proto.attend_wire_path = false;
    proto_ = new testing::LoopbackServer(testing::StartLoopbackServer(proto));
  }
  static void TearDownTestSuite() {
    delete wire_;
    delete proto_;
  }

  testing::RandomRequest RandomRequest() { return testing::MakeRandomShapedRequest(rng_, 70); }

  // Sends r to both servers and checks the answers against each other and the reference.
  void ExpectSameAnswers(const testing::RandomRequest& r, const std::string& what) {
    auto wire = wire_->client->Attend(r.q, r.k, r.v, r.options);
    auto proto = proto_->client->Attend(r.q, r.k, r.v, r.options);
    ASSERT_TRUE(wire.ok()) << what << ": " << wire.status();
    ASSERT_TRUE(proto.ok()) << what << ": " << proto.status();
    EXPECT_EQ(wire->o.shape, proto->o.shape) << what;
    EXPECT_EQ(wire->o.dtype, proto->o.dtype) << what;
    EXPECT_TRUE(wire->o.data == proto->o.data) << what << ": o differs between the paths";
    ASSERT_EQ(wire->lse.has_value(), r.options.return_lse) << what;
    if (r.options.return_lse) {
      ASSERT_TRUE(proto->lse.has_value());
      EXPECT_EQ(wire->lse->shape, proto->lse->shape) << what;
      EXPECT_TRUE(wire->lse->data == proto->lse->data) << what << ": lse differs";
    }
    EXPECT_LE(testing::ErrorAgainstReference(r, wire->o), testing::ToleranceFor(r.q.dtype))
        << what;
  }

  static testing::LoopbackServer* wire_;
  static testing::LoopbackServer* proto_;
  std::mt19937_64 rng_{std::random_device{}()};
};
testing::LoopbackServer* AttendWirePathTest::wire_ = nullptr;
testing::LoopbackServer* AttendWirePathTest::proto_ = nullptr;

TEST_F(AttendWirePathTest, RandomRequestsAnsweredAsByProtobufCoding) {
  for (int i = 0; i < 60; ++i) {
    ASSERT_NO_FATAL_FAILURE(ExpectSameAnswers(RandomRequest(), "request " + std::to_string(i)));
  }
}

// Tens of MB each way: the request arrives in many slices, o leaves as one of its own.
TEST_F(AttendWirePathTest, LargeMessages) {
  for (client::DType dtype : {client::DType::kBFloat16, client::DType::kFloat32}) {
    RequestShape s;
    s.dtype = dtype;
    s.heads = s.kv_heads = 16;
    s.head_dim = 128;
    s.seq_q = 2048;
    s.seq_k = 64;  // little compute; q and o carry the bytes (8 MiB of bf16, 16 MiB of fp32)
    testing::RandomRequest r = MakeRandomRequest(s, rng_);
    r.options.return_lse = true;
    ASSERT_NO_FATAL_FAILURE(ExpectSameAnswers(r, "large"));
  }
}

// Many calls at once over several threads: each answer is its own request's.
TEST_F(AttendWirePathTest, ConcurrentCallsGetTheirOwnAnswers) {
  constexpr int kThreads = 8, kCalls = 6;
  std::vector<std::future<void>> done;
  for (int t = 0; t < kThreads; ++t) {
    done.push_back(std::async(std::launch::async, [this, seed = rng_()] {
      std::mt19937_64 rng(seed);
      for (int i = 0; i < kCalls; ++i) {
        RequestShape s;
        s.seq_q = 1 + static_cast<int>(rng() % 100);
        s.seq_k = 1 + static_cast<int>(rng() % 100);
        const testing::RandomRequest r = MakeRandomRequest(s, rng);
        auto got = wire_->client->Attend(r.q, r.k, r.v, r.options);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_LE(testing::ErrorAgainstReference(r, got->o), testing::ToleranceFor(r.q.dtype));
      }
    }));
  }
  for (auto& f : done) f.get();
}

}  // namespace
}  // namespace attn
