// Every bad-input case of Attend gets the right status code and a message naming the field, and
// the server answers a good request correctly right after each one.
#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include "test_util.h"

namespace attn {
namespace {

using testing::MakeRandomRequest;
using testing::RequestShape;

struct BadCase {
  std::string name;
  std::function<void(v1::AttendRequest&)> corrupt;
  grpc::StatusCode code;
  std::string message_part;  // the message must mention this
};

std::vector<BadCase> BadCases() {
  using grpc::StatusCode;
  return {
      {"QMissing", [](v1::AttendRequest& r) { r.clear_q(); }, StatusCode::INVALID_ARGUMENT,
       "q, k and v"},
      {"QRank2", [](v1::AttendRequest& r) { r.mutable_q()->mutable_shape()->RemoveLast(); },
       StatusCode::INVALID_ARGUMENT, "q.shape must have 3 dimensions"},
      {"KVShapesDiffer", [](v1::AttendRequest& r) {
         r.mutable_v()->set_shape(1, 1);
         r.mutable_v()->mutable_data()->resize(r.v().data().size() / 2);
       }, StatusCode::INVALID_ARGUMENT, "v.shape must equal k.shape"},
      {"HeadDimMismatch", [](v1::AttendRequest& r) {
         r.mutable_k()->set_shape(2, 32);
         r.mutable_v()->set_shape(2, 32);
         r.mutable_k()->mutable_data()->resize(r.k().data().size() / 2);
         r.mutable_v()->mutable_data()->resize(r.v().data().size() / 2);
       }, StatusCode::INVALID_ARGUMENT, "k.shape[2]"},
      {"ByteLengthShort", [](v1::AttendRequest& r) { r.mutable_q()->mutable_data()->pop_back(); },
       StatusCode::INVALID_ARGUMENT, "q.data has"},
      {"ByteLengthLong", [](v1::AttendRequest& r) { r.mutable_k()->mutable_data()->append("xx"); },
       StatusCode::INVALID_ARGUMENT, "k.data has"},
      {"UnsupportedHeadDim", [](v1::AttendRequest& r) {
         for (auto* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
           t->set_shape(2, 80);
           t->mutable_data()->resize(t->shape(0) * t->shape(1) * 80 * 2);
         }
       }, StatusCode::INVALID_ARGUMENT, "head_dim 80"},
      {"DtypeUnspecified", [](v1::AttendRequest& r) { r.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       StatusCode::INVALID_ARGUMENT, "q.dtype"},
      {"DtypeUnknownValue", [](v1::AttendRequest& r) { r.mutable_v()->set_dtype(static_cast<v1::DType>(42)); },
       StatusCode::INVALID_ARGUMENT, "v.dtype"},
      {"DtypesDiffer", [](v1::AttendRequest& r) { r.mutable_k()->set_dtype(v1::DTYPE_FLOAT16); },
       StatusCode::INVALID_ARGUMENT, "must equal q.dtype"},
      {"CuSeqlensNotFromZero", [](v1::AttendRequest& r) { r.set_cu_seqlens_q(0, 1); },
       StatusCode::INVALID_ARGUMENT, "cu_seqlens_q[0] must be 0"},
      {"CuSeqlensDecreasing", [](v1::AttendRequest& r) {
         r.set_cu_seqlens_k(1, 40);
         r.set_cu_seqlens_k(2, 30);
       }, StatusCode::INVALID_ARGUMENT, "cu_seqlens_k must not decrease"},
      {"CuSeqlensWrongTotal", [](v1::AttendRequest& r) { r.set_cu_seqlens_q(2, 63); },
       StatusCode::INVALID_ARGUMENT, "cu_seqlens_q must end at the token count 64"},
      {"CuSeqlensOnlyQ", [](v1::AttendRequest& r) { r.clear_cu_seqlens_k(); },
       StatusCode::INVALID_ARGUMENT, "given together"},
      {"CuSeqlensCountsDiffer", [](v1::AttendRequest& r) { r.add_cu_seqlens_k(32); },
       StatusCode::INVALID_ARGUMENT, "same number of entries"},
      {"HeadsNotMultipleOfKvHeads", [](v1::AttendRequest& r) {
         for (auto* t : {r.mutable_k(), r.mutable_v()}) {
           t->set_shape(1, 3);
           t->mutable_data()->resize(t->shape(0) * 3 * 64 * 2);
         }
       }, StatusCode::INVALID_ARGUMENT, "must be a multiple of num_kv_heads"},
      {"EmptyQ", [](v1::AttendRequest& r) {
         r.mutable_q()->set_shape(0, 0);
         r.mutable_q()->clear_data();
       }, StatusCode::INVALID_ARGUMENT, "q.shape[0] must be > 0"},
      {"NegativeDim", [](v1::AttendRequest& r) { r.mutable_k()->set_shape(1, -2); },
       StatusCode::INVALID_ARGUMENT, "k.shape[1] must be > 0"},
      {"HugeDeclaredShape", [](v1::AttendRequest& r) { r.mutable_q()->set_shape(0, int64_t{1} << 40); },
       StatusCode::RESOURCE_EXHAUSTED, "max_tensor_elements"},
      {"ScaleNaN", [](v1::AttendRequest& r) { r.set_softmax_scale(std::numeric_limits<float>::quiet_NaN()); },
       StatusCode::INVALID_ARGUMENT, "softmax_scale must be finite"},
      {"WindowBelowMinusOne", [](v1::AttendRequest& r) { r.mutable_window()->set_left(-5); },
       StatusCode::INVALID_ARGUMENT, "window.left"},
  };
}

class BadInputTest : public ::testing::TestWithParam<BadCase> {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.max_message_bytes = 4 << 20;
    server_ = new testing::LoopbackServer(testing::StartLoopbackServer(options));
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  // A good request: 2 sequences of 32 tokens, 4 query heads over 2 KV heads, d = 64, bf16.
  testing::RandomRequest Good() {
    RequestShape shape;
    shape.batch = 2;
    return MakeRandomRequest(shape, rng_);
  }

  void ExpectGoodRequestAnswered() {
    const auto good = Good();
    auto result = server_->client->Attend(good.q, good.k, good.v, good.options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_LE(testing::ErrorAgainstReference(good, result->o), testing::ToleranceFor(good.q.dtype));
  }

  static testing::LoopbackServer* server_;
  std::mt19937_64 rng_{std::random_device{}()};
};
testing::LoopbackServer* BadInputTest::server_ = nullptr;

TEST_P(BadInputTest, GetsStatusAndServerStillAnswers) {
  const BadCase& c = GetParam();
  const auto good = Good();
  v1::AttendRequest request =
      client::Client::BuildAttendRequest(good.q, good.k, good.v, good.options);
  c.corrupt(request);
  v1::AttendResponse response;
  grpc::ClientContext ctx;
  const grpc::Status st = server_->client->stub()->Attend(&ctx, request, &response);
  EXPECT_EQ(st.error_code(), c.code) << st.error_message();
  EXPECT_NE(st.error_message().find(c.message_part), std::string::npos)
      << "message: " << st.error_message();
  EXPECT_FALSE(response.has_o());
  ExpectGoodRequestAnswered();
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInputTest, ::testing::ValuesIn(BadCases()),
                         [](const auto& info) { return info.param.name; });

TEST_F(BadInputTest, OversizeMessageIsResourceExhausted) {
  // 4 MiB server limit; this request carries about 6 MiB.
  RequestShape shape;
  shape.seq_q = shape.seq_k = 8192;
  shape.heads = shape.kv_heads = 2;
  shape.head_dim = 64;
  const auto big = MakeRandomRequest(shape, rng_);
  auto result = server_->client->Attend(big.q, big.k, big.v, big.options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  ExpectGoodRequestAnswered();
}

TEST_F(BadInputTest, SessionRpcsAnswerUnimplementedWithMessage) {
  v1::CreateSessionRequest request;
  v1::CreateSessionResponse response;
  grpc::ClientContext ctx;
  const grpc::Status st = server_->client->stub()->CreateSession(&ctx, request, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(st.error_message().find("Attend"), std::string::npos);
  ExpectGoodRequestAnswered();
}

}  // namespace
}  // namespace attn
