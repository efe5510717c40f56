// The bad-input matrix: every field of AttendRequest wrong in every way we could think of, each
// with its exact status code and a message that names the field. Every case is its own test
// (BadInputCase/Matrix.<Name>), on unary Attend and midway through an AttendStream; after each one
// a good request must be answered correctly. Also the defined behaviour of the valid edge cases:
// zero-length sequences, NaN/Inf inputs and oversize messages. The session RPCs have a
// matrix of their own (SessionBadInput/Matrix.<Name>).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <ostream>
#include <regex>
#include <set>
#include <thread>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>

#include "common/reference.h"
#include "common/wire_test_util.h"
#include "rpc/step_validation.h"
#include "session_util.h"
#include "sessions/crc32c.h"
#include "common/tsan_annotations.h"
#include "test_util.h"

namespace attn {
namespace {

using grpc::StatusCode;
using testing::MakeRandomRequest;
using testing::RequestShape;

constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int32_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

struct BadCase {
  std::string name;
  std::function<void(v1::AttendRequest&)> corrupt;
  StatusCode code;
  std::string message_part;  // the message must contain this (it names the field)
};
// gtest prints a parameter in failure messages; the name is what identifies a case.
void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

// Resizes t's data to match its (new) shape.
void FitData(v1::Tensor* t) {
  int64_t n = 2;  // bf16
  for (int64_t s : t->shape()) n *= s;
  t->mutable_data()->resize(n);
}

// A case on the good request with k and v turned into FP8 codes (1.0 each, per-tensor descales
// of 1) before `corrupt` runs.
std::function<void(v1::AttendRequest&)> Fp8Kv(std::function<void(v1::AttendRequest&)> corrupt) {
  return [corrupt](v1::AttendRequest& r) {
    for (auto* t : {r.mutable_k(), r.mutable_v()}) {
      t->set_dtype(v1::DTYPE_FLOAT8_E4M3);
      t->mutable_data()->assign(t->data().size() / 2, '\x38');
    }
    r.mutable_fp8()->add_k_descale(1.0f);
    r.mutable_fp8()->add_v_descale(1.0f);
    corrupt(r);
  };
}

void SetHeadDim(v1::AttendRequest& r, int64_t d) {
  for (auto* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
    t->set_shape(2, d);
    FitData(t);
  }
}

// The good request every case starts from: q [64, 4, 64], k/v [64, 2, 64], bf16,
// cu_seqlens_q = cu_seqlens_k = {0, 32, 64}.
std::vector<BadCase> BadCases() {
  const auto RE = StatusCode::RESOURCE_EXHAUSTED;
  const auto IA = StatusCode::INVALID_ARGUMENT;
  return {
      // Missing tensors.
      {"QMissing", [](auto& r) { r.clear_q(); }, IA,
       "tensor q is not set; q, k and v must all be set"},
      {"KMissing", [](auto& r) { r.clear_k(); }, IA, "tensor k is not set"},
      {"VMissing", [](auto& r) { r.clear_v(); }, IA, "tensor v is not set"},
      {"QAndVMissing", [](auto& r) { r.clear_q(); r.clear_v(); }, IA,
       "tensors q and v are not set"},
      {"QKVMissing", [](auto& r) { r.clear_q(); r.clear_k(); r.clear_v(); }, IA,
       "tensors q, k and v are not set"},
      // Ranks.
      {"QRank2", [](auto& r) { r.mutable_q()->mutable_shape()->RemoveLast(); }, IA,
       "q.shape must have 3 dimensions"},
      {"KRank4", [](auto& r) { r.mutable_k()->add_shape(1); }, IA,
       "k.shape must have 3 dimensions"},
      {"VRank0", [](auto& r) { r.mutable_v()->clear_shape(); }, IA,
       "v.shape must have 3 dimensions"},
      // Sizes: zero, negative, overflowing, larger than the data.
      {"QTokensZero", [](auto& r) { r.mutable_q()->set_shape(0, 0); r.mutable_q()->clear_data(); },
       IA, "q.shape[0] must be > 0"},
      {"KHeadsNegative", [](auto& r) { r.mutable_k()->set_shape(1, -2); }, IA,
       "k.shape[1] must be > 0"},
      {"VHeadDimZero", [](auto& r) { r.mutable_v()->set_shape(2, 0); }, IA,
       "v.shape[2] must be > 0"},
      {"QTokensInt64Min", [](auto& r) { r.mutable_q()->set_shape(0, kInt64Min); }, IA,
       "q.shape[0] must be > 0"},
      {"QHugeTokensSmallData", [](auto& r) { r.mutable_q()->set_shape(0, int64_t{1} << 40); }, RE,
       "q has more than max_tensor_elements"},
      {"QElementsNameTheFlag", [](auto& r) { r.mutable_q()->set_shape(1, int64_t{1} << 29); }, RE,
       "q has more than max_tensor_elements (268435456) elements: shape [64, 536870912, 64]; the "
       "limit is attnd's --max_tensor_elements flag"},
      {"KHugeHeadsSmallData", [](auto& r) { r.mutable_k()->set_shape(1, int64_t{1} << 20); }, RE,
       "k has more than max_tensor_elements"},
      {"VProductOverflowsInt64", [](auto& r) {
         for (int i = 0; i < 3; ++i) r.mutable_v()->set_shape(i, int64_t{1} << 62);
       }, RE, "v has more than max_tensor_elements"},
      {"QDeclaredLargerThanData", [](auto& r) { r.mutable_q()->set_shape(0, 1000); }, IA,
       "q.data has 32768 bytes, but shape [1000, 4, 64]"},
      // Byte lengths.
      {"QDataOneByteShort", [](auto& r) { r.mutable_q()->mutable_data()->pop_back(); }, IA,
       "q.data has 32767 bytes"},
      {"KDataTwoBytesLong", [](auto& r) { r.mutable_k()->mutable_data()->append("xx"); }, IA,
       "k.data has 16386 bytes"},
      {"VDataEmpty", [](auto& r) { r.mutable_v()->clear_data(); }, IA, "v.data has 0 bytes"},
      {"QFloat32WithBf16Bytes", [](auto& r) { r.mutable_q()->set_dtype(v1::DTYPE_FLOAT32); }, IA,
       "q.data has 32768 bytes, but shape [64, 4, 64] of DTYPE_FLOAT32 needs 65536"},
      // Dtypes.
      {"QDtypeUnspecified", [](auto& r) { r.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); }, IA,
       "q.dtype must be DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_FLOAT32 or DTYPE_FLOAT8_E4M3, got "
       "DTYPE_UNSPECIFIED"},
      {"KDtypeUnknownValue", [](auto& r) { r.mutable_k()->set_dtype(static_cast<v1::DType>(42)); },
       IA, "k.dtype must be DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_FLOAT32 or DTYPE_FLOAT8_E4M3, got 42"},
      {"VDtypeNegative", [](auto& r) { r.mutable_v()->set_dtype(static_cast<v1::DType>(-1)); },
       IA, "v.dtype must be DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_FLOAT32 or DTYPE_FLOAT8_E4M3, got -1"},
      {"KDtypeDiffers", [](auto& r) { r.mutable_k()->set_dtype(v1::DTYPE_FLOAT16); }, IA,
       "k.dtype and v.dtype must equal q.dtype (DTYPE_BFLOAT16), or both be DTYPE_FLOAT8_E4M3; "
       "got DTYPE_FLOAT16 and DTYPE_BFLOAT16"},
      // FP8 K/V (the good request made FP8 by Fp8Kv: k and v codes, per-tensor descales).
      {"Fp8KDescaleMissing", Fp8Kv([](auto& r) { r.mutable_fp8()->clear_k_descale(); }), IA,
       "fp8.k_descale is missing: k is DTYPE_FLOAT8_E4M3"},
      {"Fp8Missing", Fp8Kv([](auto& r) { r.clear_fp8(); }), IA,
       "fp8 is missing: k and v are DTYPE_FLOAT8_E4M3"},
      {"Fp8KDescaleZero", Fp8Kv([](auto& r) { r.mutable_fp8()->set_k_descale(0, 0.0f); }), IA,
       "fp8.k_descale[0] must be finite and > 0, got 0"},
      {"Fp8VDescaleNegative", Fp8Kv([](auto& r) { r.mutable_fp8()->set_v_descale(0, -2.0f); }),
       IA, "fp8.v_descale[0] must be finite and > 0, got -2"},
      {"Fp8VDescaleNaN", Fp8Kv([](auto& r) { r.mutable_fp8()->set_v_descale(0, kNaN); }), IA,
       "fp8.v_descale[0] must be finite and > 0, got nan"},
      {"Fp8KDescaleInf", Fp8Kv([](auto& r) {
         r.mutable_fp8()->clear_k_descale();
         for (float x : {1.0f, 1.0f, 1.0f, kInf}) r.mutable_fp8()->add_k_descale(x);
       }), IA, "fp8.k_descale[3] must be finite and > 0, got inf"},
      {"Fp8KDescaleWrongLength", Fp8Kv([](auto& r) { r.mutable_fp8()->add_k_descale(1.0f); }),
       IA, "fp8.k_descale must have 1 entry (per tensor) or batch * num_kv_heads = 2 * 2 = 4 "
           "entries ([batch, num_kv_heads]), got 2"},
      {"Fp8QDescaleWithoutFp8Q", Fp8Kv([](auto& r) { r.mutable_fp8()->add_q_descale(1.0f); }),
       IA, "fp8.q_descale is set, but q.dtype is not DTYPE_FLOAT8_E4M3"},
      {"Fp8ODtypeWithoutFp8Q",
       Fp8Kv([](auto& r) { r.mutable_fp8()->set_o_dtype(v1::DTYPE_FLOAT16); }), IA,
       "fp8.o_dtype must be unset unless q is DTYPE_FLOAT8_E4M3"},
      {"Fp8OnlyK", Fp8Kv([](auto& r) {
         r.mutable_v()->set_dtype(v1::DTYPE_BFLOAT16);
         FitData(r.mutable_v());
       }), IA, "got DTYPE_FLOAT8_E4M3 and DTYPE_BFLOAT16"},
      {"Fp8QWithBf16KV", [](auto& r) {
         r.mutable_q()->set_dtype(v1::DTYPE_FLOAT8_E4M3);
         r.mutable_q()->mutable_data()->resize(r.q().data().size() / 2);
       }, IA, "k.dtype and v.dtype must equal q.dtype (DTYPE_FLOAT8_E4M3), or both be"},
      {"Fp8QWithoutODtype", Fp8Kv([](auto& r) {
         r.mutable_q()->set_dtype(v1::DTYPE_FLOAT8_E4M3);
         r.mutable_q()->mutable_data()->resize(r.q().data().size() / 2);
         r.mutable_fp8()->add_q_descale(1.0f);
       }), IA, "fp8.o_dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16 when q is DTYPE_FLOAT8_E4M3"},
      {"Fp8QDescaleMissing", Fp8Kv([](auto& r) {
         r.mutable_q()->set_dtype(v1::DTYPE_FLOAT8_E4M3);
         r.mutable_q()->mutable_data()->resize(r.q().data().size() / 2);
         r.mutable_fp8()->set_o_dtype(v1::DTYPE_BFLOAT16);
       }), IA, "fp8.q_descale is missing: q is DTYPE_FLOAT8_E4M3"},
      {"Fp8DescaleProductOverflows", Fp8Kv([](auto& r) {
         r.mutable_q()->set_dtype(v1::DTYPE_FLOAT8_E4M3);
         r.mutable_q()->mutable_data()->resize(r.q().data().size() / 2);
         r.mutable_fp8()->set_o_dtype(v1::DTYPE_BFLOAT16);
         r.mutable_fp8()->add_q_descale(1e30f);
         r.mutable_fp8()->set_k_descale(0, 1e30f);
       }), IA, "fp8.q_descale * fp8.k_descale must be a finite float32 > 0"},
      {"Fp8SetForBf16", [](auto& r) { r.mutable_fp8()->add_k_descale(1.0f); }, IA,
       "fp8 is set, but none of q, k and v is DTYPE_FLOAT8_E4M3"},
      {"Fp8KDataBf16Sized", Fp8Kv([](auto& r) { FitData(r.mutable_k()); }), IA,
       "k.data has 16384 bytes, but shape [64, 2, 64] of DTYPE_FLOAT8_E4M3 needs 8192"},
      {"VDtypeFloat32Differs", [](auto& r) {
         r.mutable_v()->set_dtype(v1::DTYPE_FLOAT32);
         r.mutable_v()->mutable_data()->append(r.v().data());
       }, IA, "got DTYPE_BFLOAT16 and DTYPE_FLOAT32"},
      // Shapes that disagree with each other.
      {"VTokensDiffer", [](auto& r) { r.mutable_v()->set_shape(0, 63); FitData(r.mutable_v()); },
       IA, "v.shape must equal k.shape [64, 2, 64], got [63, 2, 64]"},
      {"VHeadsDiffer", [](auto& r) { r.mutable_v()->set_shape(1, 1); FitData(r.mutable_v()); },
       IA, "v.shape must equal k.shape"},
      {"KHeadDimDiffers", [](auto& r) {
         for (auto* t : {r.mutable_k(), r.mutable_v()}) { t->set_shape(2, 32); FitData(t); }
       }, IA, "k.shape[2] (head_dim) must equal q.shape[2] = 64, got 32"},
      {"HeadDim80Unsupported", [](auto& r) { SetHeadDim(r, 80); }, IA,
       "head_dim 80 (q.shape[2]) is not supported"},
      {"HeadDim16Unsupported", [](auto& r) { SetHeadDim(r, 16); }, IA, "head_dim 16"},
      {"HeadDim512Unsupported", [](auto& r) { SetHeadDim(r, 512); }, IA, "head_dim 512"},
      {"HeadsNotMultipleOfKvHeads", [](auto& r) {
         for (auto* t : {r.mutable_k(), r.mutable_v()}) { t->set_shape(1, 3); FitData(t); }
       }, IA, "num_heads (q.shape[1] = 4) must be a multiple of num_kv_heads (k.shape[1] = 3)"},
      {"KvHeadsMoreThanHeads", [](auto& r) {
         for (auto* t : {r.mutable_k(), r.mutable_v()}) { t->set_shape(1, 8); FitData(t); }
       }, IA, "must be a multiple of num_kv_heads (k.shape[1] = 8)"},
      // cu_seqlens.
      {"CuQNotFromZero", [](auto& r) { r.set_cu_seqlens_q(0, 1); }, IA,
       "cu_seqlens_q[0] must be 0, got 1"},
      {"CuKStartsNegative", [](auto& r) { r.set_cu_seqlens_k(0, -1); }, IA,
       "cu_seqlens_k[0] must be 0, got -1"},
      {"CuQNegativeEntry", [](auto& r) { r.set_cu_seqlens_q(1, -5); }, IA,
       "cu_seqlens_q must not decrease, but cu_seqlens_q[1] = -5 < cu_seqlens_q[0] = 0"},
      {"CuKDecreasing", [](auto& r) { r.set_cu_seqlens_k(1, 40); r.set_cu_seqlens_k(2, 30); }, IA,
       "cu_seqlens_k must not decrease"},
      {"CuQMiddleOverTotal", [](auto& r) { r.set_cu_seqlens_q(1, 100); }, IA,
       "cu_seqlens_q[2] = 64 < cu_seqlens_q[1] = 100"},
      {"CuQLastBelowTotal", [](auto& r) { r.set_cu_seqlens_q(2, 63); }, IA,
       "cu_seqlens_q must end at the token count 64, but its last entry is 63"},
      {"CuKLastAboveTotal", [](auto& r) { r.set_cu_seqlens_k(2, 65); }, IA,
       "cu_seqlens_k must end at the token count 64, but its last entry is 65"},
      {"CuQLastInt32Max", [](auto& r) { r.set_cu_seqlens_q(2, kInt32Max); }, IA,
       "cu_seqlens_q must end at the token count 64"},
      {"CuOnlyQGiven", [](auto& r) { r.clear_cu_seqlens_k(); }, IA,
       "cu_seqlens_q and cu_seqlens_k must be given together"},
      {"CuOnlyKGiven", [](auto& r) { r.clear_cu_seqlens_q(); }, IA,
       "cu_seqlens_q and cu_seqlens_k must be given together"},
      {"CuCountsDiffer", [](auto& r) { r.add_cu_seqlens_k(64); }, IA,
       "cu_seqlens_q and cu_seqlens_k must have the same number of entries (batch + 1), got 3 "
       "and 4"},
      {"CuSingleEntry", [](auto& r) {
         r.mutable_cu_seqlens_q()->Resize(1, 0);
         r.mutable_cu_seqlens_k()->Resize(1, 0);
       }, IA, "cu_seqlens_q must have at least 2 entries"},
      // softmax_scale.
      {"ScaleNaN", [](auto& r) { r.set_softmax_scale(kNaN); }, IA, "softmax_scale must be finite"},
      {"ScalePlusInf", [](auto& r) { r.set_softmax_scale(kInf); }, IA,
       "softmax_scale must be finite, got inf"},
      {"ScaleMinusInf", [](auto& r) { r.set_softmax_scale(-kInf); }, IA,
       "softmax_scale must be finite, got -inf"},
      // window.
      {"WindowLeftMinusFive", [](auto& r) { r.mutable_window()->set_left(-5); }, IA,
       "window.left and window.right must be >= -1"},
      {"WindowRightMinusTwo", [](auto& r) { r.mutable_window()->set_right(-2); }, IA,
       "window.right must be >= -1 (-1: unbounded), got 0 and -2"},
      {"WindowLeftInt32Min", [](auto& r) { r.mutable_window()->set_left(kInt32Min); }, IA,
       "got -2147483648 and 0"},
      // Shared-memory regions on a server without --allow_shared_memory (the region matrix on
      // one with it: region_bad_input_test.cc).
      {"QRegionWithSharedMemoryOff",
       [](auto& r) {
         r.mutable_q()->clear_data();
         r.mutable_q()->mutable_region()->set_region("in");
         r.mutable_q()->mutable_region()->set_bytes(64 * 4 * 64 * 2);
       },
       StatusCode::FAILED_PRECONDITION,
       "q.region names a shared-memory region, but shared memory is off"},
      {"OutputRegionWithSharedMemoryOff",
       [](auto& r) {
         r.mutable_o_region()->set_region("out");
         r.mutable_o_region()->set_bytes(64 * 4 * 64 * 2);
       },
       StatusCode::FAILED_PRECONDITION, "o_region names a shared-memory region"},
      {"LseRegionWithSharedMemoryOff",
       [](auto& r) {
         r.set_return_lse(true);
         r.mutable_lse_region()->set_region("out");
         r.mutable_lse_region()->set_bytes(4 * 64 * 4);
       },
       StatusCode::FAILED_PRECONDITION, "lse_region names a shared-memory region"},
      {"LseRegionWithoutReturnLse",
       [](auto& r) { r.mutable_lse_region()->set_region("out"); }, IA,
       "lse_region is set, but return_lse is false"},
  };
}

// One in-process server per test program, with a 4 MiB message limit. ctest runs each test in
// its own process (gtest_discover_tests), so there it is started once per test; a whole-binary
// run (./bad_input_matrix_test) shares it among all tests.
testing::LoopbackServer* SharedServer() {
  static testing::LoopbackServer* server = [] {
    ServerOptions options;
    options.max_message_bytes = 4 << 20;
    return new testing::LoopbackServer(testing::StartLoopbackServer(options));
  }();
  return server;
}

class BadInputMatrixTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = SharedServer(); }

  testing::RandomRequest Good() {
    RequestShape shape;
    shape.batch = 2;
    return MakeRandomRequest(shape, rng_);
  }

  void ExpectGoodRequestAnswered(const std::string& after) {
    const auto good = Good();
    auto result = server_->client->Attend(good.q, good.k, good.v, good.options);
    ASSERT_TRUE(result.ok()) << "after " << after << ": " << result.status();
    EXPECT_LE(testing::ErrorAgainstReference(good, result->o),
              testing::ToleranceFor(good.q.dtype))
        << "after " << after;
  }

  static testing::LoopbackServer* server_;
  std::mt19937_64 rng_{20240611};
};
testing::LoopbackServer* BadInputMatrixTest::server_ = nullptr;

// One test per bad case: BadInputCase/Matrix.<Name>/Unary and .../StreamItem.
class BadInputCase : public BadInputMatrixTest, public ::testing::WithParamInterface<BadCase> {};

TEST_P(BadInputCase, Unary) {
  const BadCase& c = GetParam();
  const auto good = Good();
  v1::AttendRequest request =
      client::Client::BuildAttendRequest(good.q, good.k, good.v, good.options);
  c.corrupt(request);
  v1::AttendResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::Status st = server_->client->stub()->Attend(&ctx, request, &response);
  EXPECT_EQ(st.error_code(), c.code) << st.error_message();
  EXPECT_NE(st.error_message().find(c.message_part), std::string::npos)
      << "message: " << st.error_message() << "\nwanted: " << c.message_part;
  EXPECT_FALSE(response.has_o());
  ExpectGoodRequestAnswered(c.name);
}

// The bad item between two good ones on one stream: it gets its own status_code and
// status_message, the good ones are answered correctly and the stream ends OK.
TEST_P(BadInputCase, StreamItem) {
  const BadCase& c = GetParam();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = server_->client->stub()->AttendStream(&ctx);
  std::vector<testing::RandomRequest> goods = {Good(), Good()};
  auto build = [](const testing::RandomRequest& g, uint64_t id) {
    v1::AttendRequest req = client::Client::BuildAttendRequest(g.q, g.k, g.v, g.options);
    req.set_request_id(id);
    return req;
  };
  v1::AttendRequest bad = build(Good(), 2);
  c.corrupt(bad);
  bad.set_request_id(2);
  ASSERT_TRUE(stream->Write(build(goods[0], 1)));
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Write(build(goods[1], 3)));
  ASSERT_TRUE(stream->WritesDone());
  std::map<uint64_t, v1::AttendResponse> received;
  v1::AttendResponse response;
  while (stream->Read(&response)) received[response.request_id()] = response;
  const grpc::Status st = stream->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(received.size(), 3u);
  const v1::AttendResponse& r = received.at(2);
  EXPECT_EQ(r.status_code(), c.code) << r.status_message();
  EXPECT_NE(r.status_message().find(c.message_part), std::string::npos)
      << "message: " << r.status_message() << "\nwanted: " << c.message_part;
  EXPECT_FALSE(r.has_o());
  for (uint64_t id : {uint64_t{1}, uint64_t{3}}) {
    const v1::AttendResponse& g = received.at(id);
    ASSERT_EQ(g.status_code(), 0) << "item " << id << ": " << g.status_message();
    auto parsed = client::Client::ParseAttendResponse(g);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const auto& sent = goods[id == 1 ? 0 : 1];
    EXPECT_LE(testing::ErrorAgainstReference(sent, parsed->o),
              testing::ToleranceFor(sent.q.dtype))
        << "item " << id;
  }
  ExpectGoodRequestAnswered(c.name + " on a stream");
}

INSTANTIATE_TEST_SUITE_P(Matrix, BadInputCase, ::testing::ValuesIn(BadCases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) {
                           return info.param.name;
                         });

// Every field of AttendRequest that can be wrong has at least one case whose expected message
// names it (as a whole word), so a field added to the proto, or a case table that loses a
// field's cases, fails here. The fields left out accept every value (bools, an unknown priority
// is NORMAL, request_id is only echoed); ValidEdgeValuesAreAccepted covers them.
TEST(BadInputMatrixTable, EveryValidatedFieldHasACaseNamingIt) {
  const std::set<std::string> any_value_valid = {"causal", "return_lse", "priority",
                                                 "request_id"};
  const auto cases = BadCases();
  const google::protobuf::Descriptor* d = v1::AttendRequest::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const std::string field = d->field(i)->name();
    if (any_value_valid.count(field)) continue;
    const std::regex word("(^|[^A-Za-z0-9_])" + field + "($|[^A-Za-z0-9_])");
    int named = 0;
    for (const BadCase& c : cases) named += std::regex_search(c.message_part, word);
    EXPECT_GT(named, 0) << "no bad case's message names AttendRequest." << field;
  }
  std::set<std::string> names;
  for (const BadCase& c : cases) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case name " << c.name;
    EXPECT_FALSE(c.message_part.empty()) << c.name;
    EXPECT_NE(c.code, StatusCode::OK) << c.name;
  }
}

// All cases on one stream, each between two good items: many bad items interleaved with good
// ones on the same stream still each get their own status, and the stream ends OK.
TEST_F(BadInputMatrixTest, EveryCaseMidwayThroughOneStream) {
  const auto cases = BadCases();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = server_->client->stub()->AttendStream(&ctx);
  std::map<uint64_t, testing::RandomRequest> goods;
  std::map<uint64_t, const BadCase*> bads;
  uint64_t id = 0;
  auto write_good = [&] {
    auto g = Good();
    v1::AttendRequest req = client::Client::BuildAttendRequest(g.q, g.k, g.v, g.options);
    req.set_request_id(++id);
    goods.emplace(id, std::move(g));
    return stream->Write(req);
  };
  std::thread writer([&] {
    for (const BadCase& c : cases) {
      if (!write_good()) return;
      auto g = Good();
      v1::AttendRequest req = client::Client::BuildAttendRequest(g.q, g.k, g.v, g.options);
      c.corrupt(req);
      req.set_request_id(++id);
      bads.emplace(id, &c);
      if (!stream->Write(req)) return;
    }
    write_good();
    stream->WritesDone();
  });
  std::map<uint64_t, v1::AttendResponse> received;
  v1::AttendResponse response;
  while (stream->Read(&response)) received[response.request_id()] = response;
  writer.join();
  const grpc::Status st = stream->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(received.size(), goods.size() + bads.size());
  for (const auto& [rid, c] : bads) {
    const v1::AttendResponse& r = received.at(rid);
    EXPECT_EQ(r.status_code(), c->code) << c->name << ": " << r.status_message();
    EXPECT_NE(r.status_message().find(c->message_part), std::string::npos)
        << c->name << ": " << r.status_message();
    EXPECT_FALSE(r.has_o()) << c->name;
  }
  for (const auto& [rid, g] : goods) {
    const v1::AttendResponse& r = received.at(rid);
    ASSERT_EQ(r.status_code(), 0) << "item " << rid << ": " << r.status_message();
    auto parsed = client::Client::ParseAttendResponse(r);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_LE(testing::ErrorAgainstReference(g, parsed->o), testing::ToleranceFor(g.q.dtype))
        << "item " << rid;
  }
}

// gRPC itself refuses a message over --max_message_bytes, before attnd's handler sees it, with
// its own text ("Received message larger than max (<size> vs. <limit>)"); attnd cannot reword
// it (see the proto's header comment), so the test pins what callers get.
TEST_F(BadInputMatrixTest, OversizeUnaryMessageIsResourceExhausted) {
  RequestShape shape;  // about 6 MiB against the 4 MiB limit
  shape.seq_q = shape.seq_k = 8192;
  shape.heads = shape.kv_heads = 2;
  const auto big = MakeRandomRequest(shape, rng_);
  auto result = server_->client->Attend(big.q, big.k, big.v, big.options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  EXPECT_NE(result.status().message().find("larger than max"), std::string::npos)
      << result.status();
  EXPECT_NE(result.status().message().find("vs. 4194304)"), std::string::npos)
      << "the limit should be in the message: " << result.status();
  ExpectGoodRequestAnswered("oversize unary");
}

// A request under the limit whose answer (o as large as q, plus lse) would be over it is refused
// before any work, with a message that says why; without lse the same request is answered.
TEST_F(BadInputMatrixTest, ResponseOverTheMessageLimitIsRefusedBeforeWork) {
  RequestShape shape;  // q 3.86 MiB, k and v 512 bytes; o + lse 4.10 MiB, over the 4 MiB limit
  shape.seq_q = 7900;
  shape.seq_k = 1;
  shape.heads = shape.kv_heads = 8;
  shape.head_dim = 32;
  auto r = MakeRandomRequest(shape, rng_);
  r.options.return_lse = true;
  auto refused = server_->client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const char* word : {"--max_message_bytes", "return_lse"}) {
    EXPECT_NE(refused.status().message().find(word), std::string::npos) << refused.status();
  }
  r.options.return_lse = false;
  auto answered = server_->client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_LE(testing::ErrorAgainstReference(r, answered->o), testing::ToleranceFor(shape.dtype));
  ExpectGoodRequestAnswered("response over the limit");
}

// An oversize item cannot be read, so gRPC ends the whole stream with RESOURCE_EXHAUSTED; the
// items before it were answered and the server goes on serving.
TEST_F(BadInputMatrixTest, OversizeStreamItemEndsThatStreamOnly) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = server_->client->stub()->AttendStream(&ctx);
  const auto g = Good();
  v1::AttendRequest good = client::Client::BuildAttendRequest(g.q, g.k, g.v, g.options);
  good.set_request_id(1);
  ASSERT_TRUE(stream->Write(good));
  v1::AttendResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.status_code(), 0) << response.status_message();
  RequestShape shape;
  shape.seq_q = shape.seq_k = 8192;
  shape.heads = shape.kv_heads = 2;
  const auto big = MakeRandomRequest(shape, rng_);
  v1::AttendRequest oversize = client::Client::BuildAttendRequest(big.q, big.k, big.v, big.options);
  stream->Write(oversize);  // may or may not report the failure here
  stream->WritesDone();
  while (stream->Read(&response)) {
  }
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  ExpectGoodRequestAnswered("oversize stream item");
}

// Malformed wire input: bytes no protobuf encoder would write, sent to Attend as they are
// (a generic stub). Attend reads its request off the wire itself (rpc/attend_request_decoder.h),
// so each gets INVALID_ARGUMENT with a message naming the field, and the server goes on.
using attn::testing::AppendLen;
using attn::testing::AppendVarint;

struct WireCase {
  std::string name;
  std::function<std::string(const std::string& good)> bytes;  // from the good request's bytes
  std::string message_part;
};
void PrintTo(const WireCase& c, std::ostream* os) { *os << c.name; }

std::vector<WireCase> WireCases() {
  const auto append = [](std::string tail) {
    return [tail](const std::string& good) { return good + tail; };
  };
  return {
      {"TruncatedInsideQData",
       [](const std::string& good) { return good.substr(0, good.size() / 8); },
       "AttendRequest is malformed: q: length"},
      {"QDataRunsPastQ",
       [](const std::string& good) {
         std::string body = std::string("\x1a") + '\x64' + "abcde";  // data: 100 bytes, 5 there
         std::string out = good;
         AppendLen(1, body, &out);
         return out;
       },
       "q.data: length 100 runs past the end of q"},
      {"KDataLengthOfUint64Max",
       [](const std::string& good) {
         std::string body = "\x1a";
         AppendVarint(~uint64_t{0}, &body);
         std::string out = good;
         AppendLen(2, body, &out);
         return out;
       },
       "k.data: length 18446744073709551615 runs past the end of k"},
      {"VLengthPastTheMessage",
       [](const std::string& good) {
         std::string out = good;
         AppendVarint(3 << 3 | 2, &out);
         AppendVarint(1 << 20, &out);
         return out + "short";
       },
       "v: length 1048576 runs past the end of the message"},
      {"OverlongTag", append(std::string(11, '\x80') + '\x01'),
       "AttendRequest: truncated or over-long field tag"},
      {"TruncatedVarint", append(std::string("\x30\x80", 2)),
       "causal: truncated or over-long varint"},
      {"FieldNumberZero", append(std::string("\x00\x01", 2)), "field number 0 out of range"},
      {"WireType7", append("\x0f\x01"), "q: unknown wire type 7"},
      {"EndGroupNotStarted", append("\x4c"), "return_lse: end of a group that was not started"},
      {"GroupWithoutEnd", append("\xc3\x0c"), "field 200: group without its end"},
      {"GroupsNestedTooDeeply", append(std::string(200, '\x0b')), "groups nested too deeply"},
      {"TruncatedFixed32", append("\x3d\x01"), "softmax_scale: truncated 4-byte value"},
      {"CuSeqlensQLengthPastTheEnd",
       [](const std::string& good) {
         std::string out = good;
         AppendVarint(4 << 3 | 2, &out);
         AppendVarint(1000, &out);
         return out + "\x01\x02";
       },
       "cu_seqlens_q: length 1000 runs past the end of its message"},
      {"ORegionNameNotUtf8",
       [](const std::string& good) {
         std::string slice;
         AppendLen(1, "\xff\xfe", &slice);
         std::string out = good;
         AppendLen(12, slice, &out);
         return out;
       },
       "o_region: protobuf could not parse this field"},
      {"QShapePackedPastQ",
       [](const std::string& good) {
         std::string body;
         AppendVarint(2 << 3 | 2, &body);
         AppendVarint(5, &body);
         body += "\x01\x02";
         std::string out = good;
         AppendLen(1, body, &out);
         return out;
       },
       "q.shape: length 5 runs past the end of its message"},
  };
}

// Attend over a generic stub: request bytes as they are, the response's bytes back.
grpc::Status RawAttend(const std::string& target, const std::string& bytes,
                       std::string* response) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  std::promise<grpc::Status> done;
  // The callback runs on a gRPC thread, after this one handed it everything (tsan_annotations.h).
  HandOffToGrpc(&done);
  stub.UnaryCall(&ctx, "/attn.v1.Attention/Attend", grpc::StubOptions(), &request, &reply,
                 [&done](grpc::Status st) {
                   TakeBackFromGrpc(&done);
                   done.set_value(std::move(st));
                 });
  grpc::Status st = done.get_future().get();
  response->clear();
  std::vector<grpc::Slice> slices;
  if (st.ok() && reply.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) response->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return st;
}

class MalformedWireCase : public BadInputMatrixTest,
                          public ::testing::WithParamInterface<WireCase> {};

TEST_P(MalformedWireCase, Unary) {
  const WireCase& c = GetParam();
  const auto good = Good();
  const std::string bytes =
      c.bytes(client::Client::BuildAttendRequest(good.q, good.k, good.v, good.options)
                  .SerializeAsString());
  v1::AttendRequest parsed;
  EXPECT_FALSE(parsed.ParseFromString(bytes)) << "protobuf accepts the case's bytes";
  std::string response;
  const grpc::Status st = RawAttend(server_->target, bytes, &response);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find(c.message_part), std::string::npos)
      << "message: " << st.error_message() << "\nwanted: " << c.message_part;
  ExpectGoodRequestAnswered(c.name);
}

INSTANTIATE_TEST_SUITE_P(Wire, MalformedWireCase, ::testing::ValuesIn(WireCases()),
                         [](const ::testing::TestParamInfo<WireCase>& info) {
                           return info.param.name;
                         });

// Every prefix of a good request's bytes (at 64 points) is refused with INVALID_ARGUMENT: as
// malformed where protobuf cannot parse it either, else by validation (a tensor missing or
// short), except the one prefix that is itself a whole valid request.
TEST_F(BadInputMatrixTest, PrefixesOfAGoodRequestAreRefused) {
  const auto good = Good();
  const std::string bytes =
      client::Client::BuildAttendRequest(good.q, good.k, good.v, good.options).SerializeAsString();
  for (int i = 0; i < 64; ++i) {
    const std::string prefix = bytes.substr(0, bytes.size() * i / 64 + i % 7);
    std::string response;
    const grpc::Status st = RawAttend(server_->target, prefix, &response);
    v1::AttendRequest parsed;
    if (!parsed.ParseFromString(prefix)) {
      EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT) << st.error_message();
      EXPECT_NE(st.error_message().find("AttendRequest is malformed"), std::string::npos)
          << st.error_message();
    } else if (!st.ok()) {
      EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT) << st.error_message();
    }
  }
  ExpectGoodRequestAnswered("prefixes");
}

// Bytes a protobuf encoder could write differently from the C++ one (fields in reverse order,
// repeated ints unpacked, unknown fields of every wire type, q split over two occurrences) are
// answered exactly as the canonical encoding is, and the answer's bytes parse as protobuf.
TEST_F(BadInputMatrixTest, UnusualButValidEncodingsAreAnsweredAlike) {
  const auto good = Good();
  const v1::AttendRequest r =
      client::Client::BuildAttendRequest(good.q, good.k, good.v, good.options);
  std::string canonical_answer;
  ASSERT_TRUE(RawAttend(server_->target, r.SerializeAsString(), &canonical_answer).ok());
  v1::AttendResponse expected;
  ASSERT_TRUE(expected.ParseFromString(canonical_answer));

  std::string bytes = "\xa0\x06\x2a";  // unknown field 100, varint
  for (int32_t x : r.cu_seqlens_k()) {  // unpacked
    AppendVarint(5 << 3 | 0, &bytes);
    AppendVarint(static_cast<uint64_t>(x), &bytes);
  }
  for (int32_t x : r.cu_seqlens_q()) {
    AppendVarint(4 << 3 | 0, &bytes);
    AppendVarint(static_cast<uint64_t>(x), &bytes);
  }
  bytes += "\xab\x06\x08\x01\xac\x06";  // unknown group 101 holding a varint
  AppendLen(3, r.v().SerializeAsString(), &bytes);
  AppendLen(2, r.k().SerializeAsString(), &bytes);
  v1::Tensor q_shape = r.q(), q_data;
  q_shape.clear_data();
  q_data.set_data(r.q().data());
  AppendLen(1, q_data.SerializeAsString() + "\xe5\x07\x01\x02\x03\x04", &bytes);  // + fixed32 188
  AppendLen(1, q_shape.SerializeAsString(), &bytes);
  std::string answer;
  const grpc::Status st = RawAttend(server_->target, bytes, &answer);
  ASSERT_TRUE(st.ok()) << st.error_message();
  v1::AttendResponse got;
  ASSERT_TRUE(got.ParseFromString(answer));
  EXPECT_EQ(got.o().data(), expected.o().data());
  EXPECT_EQ(got.o().shape_size(), 3);
}

// The session RPCs: every field of CreateSession, Step, TruncateSession, ForkSession and
// CloseSession wrong in the ways we could think of, each its own test
// (SessionBadInput/Matrix.<Name>) with its exact code and a message naming the field. Each runs
// against a live session holding 5 tokens in each of its 2 layers (bf16, 4 query heads over 2 KV
// heads, head_dim 64, max_tokens 64); afterwards a good step on that session must be answered
// and match the float64 reference over the cache as it was, so a failed call changed nothing.
struct SessionCall {
  std::string session_id;  // the live session
  v1::Attention::Stub* stub = nullptr;
  std::mt19937_64* rng = nullptr;
  testing::SessionSpec spec;
};
struct SessionBadCase {
  std::string name;
  std::function<grpc::Status(const SessionCall&)> call;
  StatusCode code;
  std::string message_part;
};
void PrintTo(const SessionBadCase& c, std::ostream* os) { *os << c.name; }

// A step of the live session, changed by `corrupt`, sent.
std::function<grpc::Status(const SessionCall&)> BadStep(
    std::function<void(v1::StepRequest&)> corrupt, int tokens = 1) {
  return [corrupt, tokens](const SessionCall& c) {
    v1::StepRequest r = testing::RandomStep(c.session_id, 0, tokens, c.spec, *c.rng);
    corrupt(r);
    v1::StepResponse response;
    const grpc::Status st = testing::Step(c.stub, r, &response);
    EXPECT_FALSE(response.has_o());
    return st;
  };
}
std::function<grpc::Status(const SessionCall&)> BadCreate(
    std::function<void(v1::CreateSessionRequest&)> corrupt) {
  return [corrupt](const SessionCall& c) {
    v1::CreateSessionRequest r;
    r.set_num_layers(2);
    r.set_num_kv_heads(2);
    r.set_head_dim(64);
    r.set_dtype(v1::DTYPE_BFLOAT16);
    corrupt(r);
    grpc::ClientContext ctx;
    v1::CreateSessionResponse response;
    const grpc::Status st = c.stub->CreateSession(&ctx, r, &response);
    EXPECT_TRUE(response.session_id().empty());
    return st;
  };
}
grpc::Status TruncateCall(const SessionCall& c, const std::string& id, int64_t tokens) {
  grpc::ClientContext ctx;
  v1::TruncateSessionRequest r;
  r.set_session_id(id);
  r.set_tokens(tokens);
  v1::TruncateSessionResponse response;
  return c.stub->TruncateSession(&ctx, r, &response);
}
grpc::Status ForkCall(const SessionCall& c, const std::string& id) {
  grpc::ClientContext ctx;
  v1::ForkSessionRequest r;
  r.set_session_id(id);
  v1::ForkSessionResponse response;
  return c.stub->ForkSession(&ctx, r, &response);
}
// A session created and closed again: its id.
std::string ClosedSessionId(const SessionCall& c) {
  v1::CreateSessionResponse r;
  EXPECT_TRUE(testing::CreateSession(c.stub, c.spec, &r).ok());
  EXPECT_TRUE(testing::CloseSession(c.stub, r.session_id()).ok());
  return r.session_id();
}

void SetShapes(v1::StepRequest& r, int64_t q_heads, int64_t kv_heads, int64_t d) {
  for (auto* t : {r.mutable_q(), r.mutable_k_new(), r.mutable_v_new()}) {
    t->set_shape(1, t == r.mutable_q() ? q_heads : kv_heads);
    t->set_shape(2, d);
    FitData(t);
  }
}

// A session with an FP8 cache (the live session's shape, scales per KV head) holding 3 tokens,
// the step on it changed by `corrupt` and sent; then a good step on it must match the reference
// over its cache as it was. Returns the bad step's status.
testing::SessionSpec Fp8SessionSpec() {
  testing::SessionSpec spec{2, 4, 2, 64, v1::DTYPE_BFLOAT16};
  spec.fp8_cache = true;
  spec.k_scales = {1.0f / 448, 1.5f / 448};
  spec.v_scales = {2.0f / 448, 1.25f / 448};
  return spec;
}
std::function<grpc::Status(const SessionCall&)> BadFp8Step(
    std::function<void(v1::StepRequest&)> corrupt, bool codes = false) {
  return [corrupt, codes](const SessionCall& c) {
    testing::SessionSpec spec = Fp8SessionSpec();
    spec.fp8_k_new = codes;
    v1::CreateSessionResponse created;
    EXPECT_TRUE(testing::CreateSession(c.stub, spec, &created).ok());
    testing::SessionShadow shadow(spec);
    v1::StepResponse response;
    const v1::StepRequest first = testing::RandomStep(created.session_id(), 0, 3, spec, *c.rng);
    EXPECT_TRUE(testing::Step(c.stub, first, &response).ok());
    shadow.Append(first);
    v1::StepRequest bad = testing::RandomStep(created.session_id(), 0, 1, spec, *c.rng);
    corrupt(bad);
    v1::StepResponse refused;
    const grpc::Status st = testing::Step(c.stub, bad, &refused);
    EXPECT_FALSE(refused.has_o());
    const v1::StepRequest good = testing::RandomStep(created.session_id(), 0, 2, spec, *c.rng);
    EXPECT_TRUE(testing::Step(c.stub, good, &response).ok());
    shadow.Append(good);
    EXPECT_EQ(response.cached_tokens(), 5);
    EXPECT_LE(shadow.Check(good, response).o, testing::StepTolerance(spec.dtype));
    EXPECT_TRUE(testing::CloseSession(c.stub, created.session_id()).ok());
    return st;
  };
}
// CreateSession of an FP8 cache with two KV heads, changed by `corrupt`.
std::function<grpc::Status(const SessionCall&)> BadFp8Create(
    std::function<void(v1::CreateSessionRequest&)> corrupt) {
  return BadCreate([corrupt](v1::CreateSessionRequest& r) {
    r.set_cache_dtype(v1::DTYPE_FLOAT8_E4M3);
    for (float s : {0.01f, 0.02f}) {
      r.add_k_scales(s);
      r.add_v_scales(s);
    }
    corrupt(r);
  });
}
// t turned into E4M3 codes of the same shape (code 0x38, 1.0).
void MakeFp8(v1::Tensor* t) {
  int64_t n = 1;
  for (int64_t s : t->shape()) n *= s;
  t->set_dtype(v1::DTYPE_FLOAT8_E4M3);
  t->set_data(std::string(static_cast<size_t>(n), '\x38'));
}

std::vector<SessionBadCase> SessionBadCases() {
  const auto IA = StatusCode::INVALID_ARGUMENT;
  const auto NF = StatusCode::NOT_FOUND;
  const auto RE = StatusCode::RESOURCE_EXHAUSTED;
  const auto FP = StatusCode::FAILED_PRECONDITION;
  return {
      // CreateSession.
      {"CreateLayersZero", BadCreate([](auto& r) { r.set_num_layers(0); }), IA,
       "num_layers must be in [1, 1024], got 0"},
      {"CreateLayersTooMany", BadCreate([](auto& r) { r.set_num_layers(1025); }), IA,
       "num_layers must be in [1, 1024], got 1025"},
      {"CreateKvHeadsZero", BadCreate([](auto& r) { r.set_num_kv_heads(0); }), IA,
       "num_kv_heads must be >= 1, got 0"},
      {"CreateHeadDimUnsupported", BadCreate([](auto& r) { r.set_head_dim(80); }), IA,
       "head_dim 80 is not supported"},
      {"CreateDtypeFloat32", BadCreate([](auto& r) { r.set_dtype(v1::DTYPE_FLOAT32); }), IA,
       "dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16 (the cache's element type), got "
       "DTYPE_FLOAT32"},
      {"CreateDtypeUnspecified", BadCreate([](auto& r) { r.set_dtype(v1::DTYPE_UNSPECIFIED); }),
       IA, "got DTYPE_UNSPECIFIED"},
      {"CreateMaxTokensNegative", BadCreate([](auto& r) { r.set_max_tokens(-1); }), IA,
       "max_tokens must be in [0, 131072]"},
      {"CreateMaxTokensOverLimit", BadCreate([](auto& r) { r.set_max_tokens(131073); }), IA,
       "(0: the server's limit, --max_session_tokens), got 131073"},
      // A row that does not divide a page is served in runs of adjacent pages (session_test),
      // unless no run of at most 64 pages holds whole rows: 65 x 64 x 2 = 65 x 128 bytes.
      {"CreateRowFittingNoRunOfPages", BadCreate([](auto& r) { r.set_num_kv_heads(65); }), IA,
       "num_kv_heads (65) x head_dim (64) x 2 bytes = 8320 bytes per token fit no run of at most "
       "64 KV pages of 32768 bytes"},
      // CreateSession of an FP8 cache: its scales.
      {"CreateFp8KScalesMissing", BadFp8Create([](auto& r) { r.clear_k_scales(); }), IA,
       "k_scales is required for an FP8 cache"},
      {"CreateFp8VScalesMissing", BadFp8Create([](auto& r) { r.clear_v_scales(); }), IA,
       "v_scales is required for an FP8 cache"},
      {"CreateFp8KScaleZero", BadFp8Create([](auto& r) { r.set_k_scales(1, 0.0f); }), IA,
       "k_scales[1] must be finite and > 0, got 0"},
      {"CreateFp8VScaleNegative", BadFp8Create([](auto& r) { r.set_v_scales(0, -1.0f); }), IA,
       "v_scales[0] must be finite and > 0, got -1"},
      {"CreateFp8KScaleNaN", BadFp8Create([](auto& r) { r.set_k_scales(0, kNaN); }), IA,
       "k_scales[0] must be finite and > 0, got nan"},
      {"CreateFp8VScaleInf", BadFp8Create([](auto& r) {
         r.set_v_scales(1, std::numeric_limits<float>::infinity());
       }), IA, "v_scales[1] must be finite and > 0, got inf"},
      {"CreateFp8KScalesTooMany", BadFp8Create([](auto& r) { r.add_k_scales(0.5f); }), IA,
       "k_scales must have num_kv_heads (2) entries, got 3"},
      {"CreateFp8VScalesTooFew", BadFp8Create([](auto& r) { r.mutable_v_scales()->RemoveLast(); }),
       IA, "v_scales must have num_kv_heads (2) entries, got 1"},
      {"CreateScalesWithoutFp8Cache", BadFp8Create([](auto& r) { r.clear_cache_dtype(); }), IA,
       "k_scales is only for an FP8 cache (cache_dtype DTYPE_FLOAT8_E4M3)"},
      {"CreateCacheDtypeFloat32", BadCreate([](auto& r) { r.set_cache_dtype(v1::DTYPE_FLOAT32); }),
       IA, "cache_dtype must be unset, the session's dtype or DTYPE_FLOAT8_E4M3, got DTYPE_FLOAT32"},
      // Step of a session with an FP8 cache.
      {"StepFp8Q", BadFp8Step([](auto& r) { MakeFp8(r.mutable_q()); }), IA,
       "q.dtype must be the session's dtype DTYPE_BFLOAT16, got DTYPE_FLOAT8_E4M3"},
      {"StepFp8KNewWithoutScales", BadFp8Step([](auto& r) {
         r.clear_k_new_scales();
         r.clear_v_new_scales();
       }, /*codes=*/true), IA,
       "k_new_scales must have num_kv_heads (2) entries for FP8 k_new/v_new, got 0"},
      {"StepFp8VNewScaleNotTheSessions", BadFp8Step([](auto& r) {
         r.set_v_new_scales(1, r.v_new_scales(1) * 2);
       }, /*codes=*/true), IA, "v_new_scales[1] is"},
      {"StepFp8KNewScalesTooMany", BadFp8Step([](auto& r) { r.add_k_new_scales(1.0f); },
                                              /*codes=*/true),
       IA, "k_new_scales must have num_kv_heads (2) entries for FP8 k_new/v_new, got 3"},
      {"StepFp8OnlyKNew", BadFp8Step([](auto& r) { MakeFp8(r.mutable_k_new()); }), IA,
       "k_new.dtype and v_new.dtype must both be DTYPE_FLOAT8_E4M3 or neither"},
      {"StepFp8ScalesFor16BitKNew", BadFp8Step([](auto& r) { r.add_k_new_scales(0.01f); }), IA,
       "k_new_scales is only for FP8 k_new/v_new (DTYPE_FLOAT8_E4M3)"},
      {"StepFp8KNewOnA16BitCache", BadStep([](auto& r) {
         MakeFp8(r.mutable_k_new());
         MakeFp8(r.mutable_v_new());
       }), IA, "k_new.dtype must be the session's dtype DTYPE_BFLOAT16, got DTYPE_FLOAT8_E4M3"},
      // Step: which session.
      {"StepUnknownSession", BadStep([](auto& r) { r.set_session_id("nosuchreplica"); }), NF,
       "no session nosuchreplica on replica bad-input"},
      {"StepEmptySessionId", BadStep([](auto& r) { r.clear_session_id(); }), NF,
       "no session '' on replica bad-input"},
      {"StepUnknownIdOfThisReplica", BadStep([](auto& r) { r.set_session_id("bad-input.1"); }),
       NF, "no session bad-input.1 on replica bad-input"},
      {"StepOtherReplica", BadStep([](auto& r) { r.set_session_id("other.42"); }), FP,
       "session other.42 belongs to replica other, but this is replica bad-input"},
      {"StepClosedSession",
       [](const SessionCall& c) {
         SessionCall closed = c;
         closed.session_id = ClosedSessionId(c);
         return BadStep([](auto&) {})(closed);
       },
       NF, "was closed"},
      // Step: layer and tensors.
      // Shared-memory regions while shared memory is off (their own cases: session_region_test).
      {"StepQRegion",
       BadStep([](auto& r) {
         r.mutable_q()->clear_data();
         r.mutable_q()->mutable_region()->set_region("in");
       }),
       StatusCode::FAILED_PRECONDITION, "q.region names a shared-memory region, but shared memory is off"},
      {"StepOutputRegion", BadStep([](auto& r) { r.mutable_o_region()->set_region("out"); }),
       StatusCode::FAILED_PRECONDITION, "o_region names a shared-memory region, but shared memory is off"},
      {"StepLseRegion",
       BadStep([](auto& r) {
         r.set_return_lse(true);
         r.mutable_lse_region()->set_region("out");
       }),
       StatusCode::FAILED_PRECONDITION, "lse_region names a shared-memory region, but shared memory is off"},
      {"StepLayerNegative", BadStep([](auto& r) { r.set_layer(-1); }), IA,
       "layer -1 is out of range"},
      {"StepLayerPastLast", BadStep([](auto& r) { r.set_layer(2); }), IA,
       "layer 2 is out of range: session"},
      {"StepQMissing", BadStep([](auto& r) { r.clear_q(); }), IA,
       "tensor q is not set; q, k_new and v_new must all be set"},
      {"StepKNewAndVNewMissing", BadStep([](auto& r) { r.clear_k_new(); r.clear_v_new(); }), IA,
       "tensors k_new and v_new are not set"},
      {"StepQDtypeNotTheSessions", BadStep([](auto& r) { r.mutable_q()->set_dtype(v1::DTYPE_FLOAT16); }),
       IA, "q.dtype must be the session's dtype DTYPE_BFLOAT16, got DTYPE_FLOAT16"},
      {"StepVNewFloat32", BadStep([](auto& r) {
         r.mutable_v_new()->set_dtype(v1::DTYPE_FLOAT32);
         r.mutable_v_new()->mutable_data()->append(r.v_new().data());
       }), IA, "v_new.dtype must be the session's dtype DTYPE_BFLOAT16, got DTYPE_FLOAT32"},
      {"StepKvHeadsNotTheSessions", BadStep([](auto& r) { SetShapes(r, 4, 4, 64); }), IA,
       "k_new.shape[1] (num_kv_heads) must be the session's 2, got 4"},
      {"StepHeadsNotAMultipleOfKvHeads", BadStep([](auto& r) { SetShapes(r, 3, 2, 64); }), IA,
       "q.shape[1] (num_heads = 3) must be a multiple of the session's num_kv_heads (2)"},
      {"StepHeadDimNotTheSessions", BadStep([](auto& r) { SetShapes(r, 4, 2, 32); }), IA,
       "q.shape[2] (head_dim) must be the session's 64, got 32"},
      {"StepKNewTokensDiffer", BadStep([](auto& r) {
         for (auto* t : {r.mutable_k_new(), r.mutable_v_new()}) { t->set_shape(0, 2); FitData(t); }
       }), IA, "k_new.shape[0] (new tokens) must equal q.shape[0] = 1, got 2"},
      {"StepVNewShapeDiffers", BadStep([](auto& r) {
         r.mutable_v_new()->set_shape(1, 1);
         FitData(r.mutable_v_new());
       }), IA, "v_new.shape must equal k_new.shape [1, 2, 64], got [1, 1, 64]"},
      {"StepQDataShort", BadStep([](auto& r) { r.mutable_q()->mutable_data()->pop_back(); }), IA,
       "q.data has 511 bytes"},
      {"StepKNewRank2", BadStep([](auto& r) { r.mutable_k_new()->mutable_shape()->RemoveLast(); }),
       IA, "k_new.shape must have 3 dimensions"},
      {"StepQTokensZero", BadStep([](auto& r) { r.mutable_q()->set_shape(0, 0); r.mutable_q()->clear_data(); }),
       IA, "q.shape[0] must be > 0"},
      {"StepScaleNaN", BadStep([](auto& r) { r.set_softmax_scale(kNaN); }), IA,
       "softmax_scale must be finite"},
      {"StepWindowLeftBelowMinusOne", BadStep([](auto& r) { r.mutable_window()->set_left(-2); }),
       IA, "window.left and window.right must be >= -1 (-1: unbounded), got -2 and 0"},
      {"StepMoreTokensThanTheSessionHolds", BadStep([](auto&) {}, 65), RE,
       "q.shape[0] (65 new tokens) is more than the session's limit of 64 tokens per layer"},
      {"StepPastTheSessionLimit", BadStep([](auto&) {}, 60), RE,
       "layer 0 holds 5 tokens; 60 more would make 65, over the session's limit of 64"},
      // TruncateSession, ForkSession, CloseSession.
      {"TruncatePastTheStart", [](const SessionCall& c) { return TruncateCall(c, c.session_id, 6); },
       IA, "tokens (6) is more than layer 0 of session"},
      {"TruncateNegative", [](const SessionCall& c) { return TruncateCall(c, c.session_id, -3); },
       IA, "tokens must be >= 0, got -3"},
      {"TruncateUnknownSession", [](const SessionCall& c) { return TruncateCall(c, "bad-input.7", 1); },
       NF, "no session bad-input.7"},
      {"TruncateClosedSession",
       [](const SessionCall& c) { return TruncateCall(c, ClosedSessionId(c), 0); }, NF,
       "was closed"},
      {"ForkUnknownSession", [](const SessionCall& c) { return ForkCall(c, "xyz"); }, NF,
       "no session xyz"},
      {"ForkOtherReplica", [](const SessionCall& c) { return ForkCall(c, "r2.abc"); }, FP,
       "belongs to replica r2"},
      {"CloseUnknownSession",
       [](const SessionCall& c) { return testing::CloseSession(c.stub, "bad-input.x"); }, NF,
       "no session bad-input.x on replica bad-input"},
      {"CloseTwice",
       [](const SessionCall& c) { return testing::CloseSession(c.stub, ClosedSessionId(c)); }, NF,
       "was closed"},
      {"CloseLongGarbageId",
       [](const SessionCall& c) { return testing::CloseSession(c.stub, std::string(4096, 'x')); },
       NF, "no session xxxx"},
  };
}

testing::LoopbackServer* SessionServer() {
  static testing::LoopbackServer* server = [] {
    ServerOptions options;
    options.max_message_bytes = 4 << 20;
    options.replica_id = "bad-input";
    options.kv_cache_bytes = 16 << 20;
    return new testing::LoopbackServer(testing::StartLoopbackServer(options));
  }();
  return server;
}

class SessionBadInput : public ::testing::TestWithParam<SessionBadCase> {
 protected:
  void SetUp() override {
    server_ = SessionServer();
    c_.stub = server_->client->stub();
    c_.rng = &rng_;
    c_.spec = {2, 4, 2, 64, v1::DTYPE_BFLOAT16};
    v1::CreateSessionResponse r;
    ASSERT_TRUE(testing::CreateSession(c_.stub, c_.spec, &r, 64).ok());
    c_.session_id = r.session_id();
    for (int layer : {0, 1}) GoodStep(layer, 5);
  }
  void TearDown() override { EXPECT_TRUE(testing::CloseSession(c_.stub, c_.session_id).ok()); }
  void GoodStep(int layer, int tokens) {
    const v1::StepRequest step = testing::RandomStep(c_.session_id, layer, tokens, c_.spec, rng_);
    v1::StepResponse response;
    const grpc::Status st = testing::Step(c_.stub, step, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    shadow_.Append(step);
    EXPECT_EQ(response.cached_tokens(), shadow_.Tokens(layer));
    EXPECT_LE(shadow_.Check(step, response).o, testing::StepTolerance(c_.spec.dtype));
  }

  testing::LoopbackServer* server_ = nullptr;
  SessionCall c_;
  std::mt19937_64 rng_{std::random_device{}()};
  testing::SessionShadow shadow_{{2, 4, 2, 64, v1::DTYPE_BFLOAT16}};
};

TEST_P(SessionBadInput, RefusedAndTheSessionGoesOn) {
  const SessionBadCase& c = GetParam();
  const grpc::Status st = c.call(c_);
  EXPECT_EQ(st.error_code(), c.code) << st.error_message();
  EXPECT_NE(st.error_message().find(c.message_part), std::string::npos)
      << "message: " << st.error_message() << "\nwanted: " << c.message_part;
  GoodStep(0, 1);
  GoodStep(1, 2);
}

INSTANTIATE_TEST_SUITE_P(Matrix, SessionBadInput, ::testing::ValuesIn(SessionBadCases()),
                         [](const ::testing::TestParamInfo<SessionBadCase>& info) {
                           return info.param.name;
                         });

// ImportSession (the hand-off's receiving side): every field of SessionTransferHeader and
// SessionTransferPage wrong, and streams of the wrong length, each its own test
// (ImportBadInput/Matrix.<Name>) with its exact code and a message naming the field. The stream
// goes to the session server (256 pages of 32 KiB); afterwards its KV pool has as many free pages
// and sessions as before, and a good import still works.
struct ImportBadCase {
  std::string name;
  std::function<std::vector<v1::SessionTransferChunk>()> chunks;
  StatusCode code;
  std::string message_part;
};
void PrintTo(const ImportBadCase& c, std::ostream* os) { *os << c.name; }

// A session of one layer of 130 tokens (2 KV heads x 64 x bf16: rows of 256 bytes, 128 a page):
// two pages.
constexpr int64_t kImportPageBytes = 32768;
v1::SessionTransferChunk ImportHeader(
    const std::function<void(v1::SessionTransferHeader&)>& change = {}) {
  v1::SessionTransferChunk c;
  v1::SessionTransferHeader* h = c.mutable_header();
  h->set_num_layers(1);
  h->set_num_kv_heads(2);
  h->set_head_dim(64);
  h->set_dtype(v1::DTYPE_BFLOAT16);
  h->set_max_tokens(4096);
  h->set_page_tokens(128);
  h->set_page_span(1);
  h->set_page_bytes(kImportPageBytes);
  h->add_layer_tokens(130);
  h->add_layer_pages(2);
  h->set_source_session_id("elsewhere.0123");
  if (change) change(*h);
  return c;
}
// Page i: bf16 values of i's pattern (finite), with its CRC32C.
v1::SessionTransferChunk ImportPage(int64_t i,
                                    const std::function<void(v1::SessionTransferPage&)>& change = {}) {
  v1::SessionTransferChunk c;
  std::string kv(2 * kImportPageBytes, '\0');
  for (size_t b = 0; b < kv.size(); ++b) kv[b] = static_cast<char>(b % 2 ? 0x3c : (b * 7 + i) & 0xff);
  c.mutable_page()->set_index(i);
  c.mutable_page()->set_crc32c(Crc32c(kv));
  c.mutable_page()->set_kv(std::move(kv));
  if (change) change(*c.mutable_page());
  return c;
}
// The header changed by `change`, then both pages.
std::function<std::vector<v1::SessionTransferChunk>()> BadHeader(
    std::function<void(v1::SessionTransferHeader&)> change) {
  return [change] {
    return std::vector<v1::SessionTransferChunk>{ImportHeader(change), ImportPage(0), ImportPage(1)};
  };
}
// An FP8 cache of the same shape (rows of 128 one-byte codes: 256 tokens a page, one page).
void MakeFp8Header(v1::SessionTransferHeader& h) {
  h.set_cache_dtype(v1::DTYPE_FLOAT8_E4M3);
  h.set_page_tokens(256);
  h.set_layer_pages(0, 1);
  for (float s : {0.01f, 0.02f}) {
    h.add_k_scales(s);
    h.add_v_scales(s);
  }
}
std::function<std::vector<v1::SessionTransferChunk>()> BadFp8Header(
    std::function<void(v1::SessionTransferHeader&)> change) {
  return [change] {
    return std::vector<v1::SessionTransferChunk>{ImportHeader([&](auto& h) {
                                                   MakeFp8Header(h);
                                                   change(h);
                                                 }),
                                                 ImportPage(0)};
  };
}
// The header, page 0 changed by `change`, page 1.
std::function<std::vector<v1::SessionTransferChunk>()> BadPage(
    std::function<void(v1::SessionTransferPage&)> change) {
  return [change] {
    return std::vector<v1::SessionTransferChunk>{ImportHeader(), ImportPage(0, change), ImportPage(1)};
  };
}

std::vector<ImportBadCase> ImportBadCases() {
  const auto IA = StatusCode::INVALID_ARGUMENT;
  using Chunks = std::vector<v1::SessionTransferChunk>;
  return {
      // The stream's shape.
      {"NoChunkAtAll", [] { return Chunks{}; }, IA, "ImportSession: no header"},
      {"APageFirst", [] { return Chunks{ImportPage(0), ImportPage(1)}; }, IA,
       "the first chunk must be the header"},
      {"AnEmptyChunkFirst", [] { return Chunks{v1::SessionTransferChunk()}; }, IA,
       "the first chunk must be the header"},
      {"ASecondHeader", [] { return Chunks{ImportHeader(), ImportPage(0), ImportHeader()}; }, IA,
       "every chunk after the header is a page"},
      {"AnEmptyChunkAfterTheHeader",
       [] { return Chunks{ImportHeader(), v1::SessionTransferChunk()}; }, IA,
       "every chunk after the header is a page"},
      {"EndsAfterTheHeader", [] { return Chunks{ImportHeader()}; }, IA,
       "the stream ended after 0 of the 2 pages the header's layer_pages announce"},
      {"EndsAPageEarly", [] { return Chunks{ImportHeader(), ImportPage(0)}; }, IA,
       "the stream ended after 1 of the 2 pages the header's layer_pages announce"},
      {"APageTooMany",
       [] { return Chunks{ImportHeader(), ImportPage(0), ImportPage(1), ImportPage(2)}; }, IA,
       "page index 2 after all 2 pages the header's layer_pages announce"},
      // SessionTransferHeader.
      {"NumLayersZero", BadHeader([](auto& h) { h.set_num_layers(0); }), IA,
       "num_layers must be in [1, 1024], got 0"},
      {"NumLayersHuge", BadHeader([](auto& h) { h.set_num_layers(1 << 30); }), IA,
       "num_layers must be in [1, 1024], got 1073741824"},
      {"NumKvHeadsZero", BadHeader([](auto& h) { h.set_num_kv_heads(0); }), IA,
       "num_kv_heads must be >= 1, got 0"},
      {"NumKvHeadsHuge", BadHeader([](auto& h) { h.set_num_kv_heads(kInt32Max); }), IA,
       "num_kv_heads must be at most 65536"},
      {"HeadDimUnsupported", BadHeader([](auto& h) { h.set_head_dim(80); }), IA,
       "head_dim 80 is not supported"},
      {"DtypeFloat32", BadHeader([](auto& h) { h.set_dtype(v1::DTYPE_FLOAT32); }), IA,
       "dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16 (the cache's element type), got "
       "DTYPE_FLOAT32"},
      {"DtypeUnspecified", BadHeader([](auto& h) { h.clear_dtype(); }), IA,
       "dtype must be DTYPE_FLOAT16 or DTYPE_BFLOAT16 (the cache's element type), got "
       "DTYPE_UNSPECIFIED"},
      {"MaxTokensZero", BadHeader([](auto& h) { h.set_max_tokens(0); }), IA,
       "max_tokens must be >= 1 (the session's limit), got 0"},
      {"MaxTokensOverTheLimit", BadHeader([](auto& h) { h.set_max_tokens(int64_t{1} << 40); }),
       IA, "max_tokens must be in [0, 131072]"},
      {"PageTokensOfAnotherReplica", BadHeader([](auto& h) { h.set_page_tokens(64); }), IA,
       "page_tokens 64 / page_span 1 differ from this replica's 128 / 1"},
      {"PageSpanOfAnotherReplica", BadHeader([](auto& h) { h.set_page_span(2); }), IA,
       "page_tokens 128 / page_span 2 differ from this replica's 128 / 1"},
      {"PageBytesOfAnotherReplica", BadHeader([](auto& h) { h.set_page_bytes(16384); }), IA,
       "page_bytes 16384 does not match this replica's 32768"},
      {"PageBytesAbsurd", BadHeader([](auto& h) { h.set_page_bytes(int64_t{1} << 62); }), IA,
       "page_bytes 4611686018427387904 does not match"},
      {"PageBytesNegative", BadHeader([](auto& h) { h.set_page_bytes(-32768); }), IA,
       "page_bytes -32768 does not match"},
      {"LayerTokensMissing", BadHeader([](auto& h) { h.clear_layer_tokens(); }), IA,
       "layer_tokens and layer_pages must have num_layers (1) entries"},
      {"LayerPagesTooMany", BadHeader([](auto& h) { h.add_layer_pages(0); }), IA,
       "layer_tokens and layer_pages must have num_layers (1) entries"},
      {"LayerPagesNotTheTokens", BadHeader([](auto& h) { h.set_layer_pages(0, 3); }), IA,
       "layer 0 has 130 tokens in 3 pages"},
      {"LayerPagesNegative", BadHeader([](auto& h) { h.set_layer_pages(0, -2); }), IA,
       "layer 0 has 130 tokens in -2 pages"},
      {"LayerTokensNegative", BadHeader([](auto& h) { h.set_layer_tokens(0, -1); }), IA,
       "layer 0 has -1 tokens"},
      {"LayerTokensOverMaxTokens", BadHeader([](auto& h) {
         h.set_layer_tokens(0, 4097);
         h.set_layer_pages(0, 33);
       }), IA, "layer 0 has 4097 tokens in 33 pages"},
      {"LayerTokensInt64Max", BadHeader([](auto& h) {
         h.set_layer_tokens(0, std::numeric_limits<int64_t>::max());
       }), IA, "layer 0 has 9223372036854775807 tokens"},
      {"MorePagesThanThePoolHas", BadHeader([](auto& h) {
         h.set_max_tokens(131072);
         h.set_layer_tokens(0, 128 * 257);
         h.set_layer_pages(0, 257);
       }), StatusCode::RESOURCE_EXHAUSTED, "257"},
      {"CacheDtypeFloat32", BadHeader([](auto& h) { h.set_cache_dtype(v1::DTYPE_FLOAT32); }), IA,
       "cache_dtype must be unset, the session's dtype or DTYPE_FLOAT8_E4M3, got DTYPE_FLOAT32"},
      {"Fp8KScalesMissing", BadFp8Header([](auto& h) { h.clear_k_scales(); }), IA,
       "k_scales is required for an FP8 cache"},
      {"Fp8VScalesMissing", BadFp8Header([](auto& h) { h.clear_v_scales(); }), IA,
       "v_scales is required for an FP8 cache"},
      {"Fp8KScalesTooMany", BadFp8Header([](auto& h) { h.add_k_scales(0.5f); }), IA,
       "k_scales must have num_kv_heads (2) entries, got 3"},
      {"Fp8VScaleNaN", BadFp8Header([](auto& h) { h.set_v_scales(1, kNaN); }), IA,
       "v_scales[1] must be finite and > 0, got nan"},
      {"Fp8KScaleZero", BadFp8Header([](auto& h) { h.set_k_scales(0, 0.0f); }), IA,
       "k_scales[0] must be finite and > 0, got 0"},
      {"Fp8PageLayoutOf16BitRows", BadFp8Header([](auto& h) { h.set_page_tokens(128); }), IA,
       "page_tokens 128 / page_span 1 differ from this replica's 256 / 1"},
      {"ScalesWithoutAnFp8Cache", BadHeader([](auto& h) { h.add_v_scales(1.0f); }), IA,
       "v_scales is only for an FP8 cache (cache_dtype DTYPE_FLOAT8_E4M3)"},
      // shared_pages: pages of sessions sent before in the same stream (a fork family).
      {"SharedPagesNamingNoPageSent", BadHeader([](auto& h) {
         h.add_shared_pages(1);
         h.add_shared_pages(0);
       }), IA, "shared_pages[0] = 1 names no page sent before it (0 were) in this stream"},
      {"SharedPagesNegative", BadHeader([](auto& h) {
         h.add_shared_pages(0);
         h.add_shared_pages(-1);
       }), IA, "shared_pages[1] = -1 names no page sent before it"},
      {"SharedPagesOneEntryShort", BadHeader([](auto& h) { h.add_shared_pages(0); }), IA,
       "shared_pages must have one entry per page of the tables (2), got 1"},
      {"ForkHeaderNamingAPageNotSent", [] {
         return Chunks{ImportHeader(), ImportPage(0), ImportPage(1), ImportHeader([](auto& h) {
                         h.add_shared_pages(1);
                         h.add_shared_pages(3);
                       })};
       }, IA, "shared_pages[1] = 3 names no page sent before it (2 were) in this stream"},
      // SessionTransferPage.
      {"PageChecksumWrong", BadPage([](auto& p) { p.set_crc32c(p.crc32c() ^ 1); }),
       StatusCode::DATA_LOSS, "page 0's kv does not match its crc32c"},
      {"PageBitFlipped", BadPage([](auto& p) { (*p.mutable_kv())[77] ^= 0x10; }),
       StatusCode::DATA_LOSS, "page 0's kv does not match its crc32c"},
      {"PageIndexSkipsOne", BadPage([](auto& p) { p.set_index(1); }), IA,
       "page index 1 where 0 was expected"},
      {"PageIndexNegative", BadPage([](auto& p) { p.set_index(-1); }), IA,
       "page index -1 where 0 was expected"},
      {"PageKvEmpty", BadPage([](auto& p) { p.clear_kv(); }), IA,
       "page 0's kv has 0 bytes, not 65536 (2 x page_bytes)"},
      {"PageKvOneByteShort", BadPage([](auto& p) {
         p.mutable_kv()->pop_back();
         p.set_crc32c(Crc32c(p.kv()));
       }), IA, "page 0's kv has 65535 bytes, not 65536"},
      {"PageKvOneByteLong", BadPage([](auto& p) {
         p.mutable_kv()->push_back('x');
         p.set_crc32c(Crc32c(p.kv()));
       }), IA, "page 0's kv has 65537 bytes, not 65536"},
  };
}

class ImportBadInput : public ::testing::TestWithParam<ImportBadCase> {
 protected:
  void SetUp() override {
    stub_ = SessionServer()->client->stub();
    ASSERT_TRUE(testing::GetKvCache(stub_, &before_).ok());
  }
  grpc::Status Import(const std::vector<v1::SessionTransferChunk>& chunks,
                      v1::ImportSessionResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stream = stub_->ImportSession(&ctx, response);
    for (const auto& c : chunks) {
      if (!stream->Write(c)) break;
    }
    stream->WritesDone();
    return stream->Finish();
  }
  // As many free pages and sessions as before the case (the refusal gives back what it took
  // before its status is sent).
  void ExpectNothingLeft(const std::string& after) {
    v1::KvCacheInfo now;
    ASSERT_TRUE(testing::GetKvCache(stub_, &now).ok());
    EXPECT_EQ(now.free_pages(), before_.free_pages()) << after;
    EXPECT_EQ(now.sessions(), before_.sessions()) << after;
  }

  v1::Attention::Stub* stub_ = nullptr;
  v1::KvCacheInfo before_;
};

TEST_P(ImportBadInput, RefusedAndLeavesNothing) {
  const ImportBadCase& c = GetParam();
  v1::ImportSessionResponse response;
  const grpc::Status st = Import(c.chunks(), &response);
  EXPECT_EQ(st.error_code(), c.code) << st.error_message();
  EXPECT_NE(st.error_message().find(c.message_part), std::string::npos)
      << "message: " << st.error_message() << "\nwanted: " << c.message_part;
  EXPECT_TRUE(response.session_id().empty());
  ExpectNothingLeft(c.name);
  // The good stream is still taken, holds its two pages, and gives them back on close.
  const grpc::Status good = Import({ImportHeader(), ImportPage(0), ImportPage(1)}, &response);
  ASSERT_TRUE(good.ok()) << "after " << c.name << ": " << good.error_message();
  v1::KvCacheInfo with;
  ASSERT_TRUE(testing::GetKvCache(stub_, &with).ok());
  EXPECT_EQ(with.free_pages(), before_.free_pages() - 2);
  ASSERT_TRUE(testing::CloseSession(stub_, response.session_id()).ok());
  ExpectNothingLeft(c.name + ", then a good import closed");
}

INSTANTIATE_TEST_SUITE_P(Matrix, ImportBadInput, ::testing::ValuesIn(ImportBadCases()),
                         [](const ::testing::TestParamInfo<ImportBadCase>& info) {
                           return info.param.name;
                         });

// A fork family in one stream: the session, then a fork sharing its first page (and a page of
// its own after it): both open, the shared page held once, and every page back once both close.
TEST_F(ImportBadInput, AForkFamilyInOneStreamSharesItsPage) {
  v1::ImportSessionResponse response;
  const grpc::Status st = Import({ImportHeader(), ImportPage(0), ImportPage(1),
                                  ImportHeader([](auto& h) {
                                    h.add_shared_pages(1);
                                    h.add_shared_pages(0);
                                  }),
                                  ImportPage(2)},
                                 &response);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(response.session_ids_size(), 2);
  EXPECT_EQ(response.session_ids(0), response.session_id());
  EXPECT_EQ(response.pages(), 3);
  v1::KvCacheInfo with;
  ASSERT_TRUE(testing::GetKvCache(stub_, &with).ok());
  EXPECT_EQ(with.free_pages(), before_.free_pages() - 3);
  EXPECT_EQ(with.sessions(), before_.sessions() + 2);
  ASSERT_TRUE(testing::CloseSession(stub_, response.session_ids(0)).ok());
  ASSERT_TRUE(testing::GetKvCache(stub_, &with).ok());
  EXPECT_EQ(with.free_pages(), before_.free_pages() - 2);  // the shared page stays with the fork
  ASSERT_TRUE(testing::CloseSession(stub_, response.session_ids(1)).ok());
  ExpectNothingLeft("a fork family, closed");
}

// A sender that goes away midway (its call cancelled after a page): the peer frees what it took.
TEST_F(ImportBadInput, ASenderThatGoesAwayMidwayLeavesNothing) {
  // The sender goes away once attnd holds the import's pages (its header was taken), and the
  // check waits for attnd's count of the imports it answered (whatever their code) to move: free
  // pages alone read as before both before the import takes its pages and after it gives them
  // back.
  const int port = SessionServer()->server->metrics_port();
  auto answered = [port] {
    return testing::MetricValue(testing::HttpGet(port, "/metrics"), "attn_requests_total",
                                {"rpc=\"ImportSession\""});
  };
  const double answered_before = answered();
  grpc::ClientContext ctx;
  v1::ImportSessionResponse response;
  auto stream = stub_->ImportSession(&ctx, &response);
  ASSERT_TRUE(stream->Write(ImportHeader()));
  ASSERT_TRUE(stream->Write(ImportPage(0)));
  v1::KvCacheInfo now;
  for (int waited = 0; waited < 10000; waited += 10) {
    ASSERT_TRUE(testing::GetKvCache(stub_, &now).ok());
    if (now.free_pages() < before_.free_pages()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_LT(now.free_pages(), before_.free_pages()) << "the import never took its pages";
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), StatusCode::CANCELLED);
  for (int waited = 0; waited < 10000 && answered() == answered_before; waited += 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(answered(), answered_before + 1);
  ExpectNothingLeft("a cancelled import");
}

// Every field of SessionTransferHeader and SessionTransferPage that can be wrong has a case whose
// message names it (source_session_id is only logged: any value is valid).
TEST(BadInputMatrixTable, EveryImportFieldHasACaseNamingIt) {
  const auto cases = ImportBadCases();
  for (const google::protobuf::Descriptor* d :
       {v1::SessionTransferHeader::descriptor(), v1::SessionTransferPage::descriptor()}) {
    for (int i = 0; i < d->field_count(); ++i) {
      const std::string field = d->field(i)->name();
      if (field == "source_session_id") continue;
      const std::regex word("(^|[^A-Za-z0-9_])" + field + "($|[^A-Za-z0-9_])");
      int named = 0;
      for (const ImportBadCase& c : cases) named += std::regex_search(c.message_part, word);
      EXPECT_GT(named, 0) << "no import bad case's message names " << d->name() << "." << field;
    }
  }
  std::set<std::string> names;
  for (const ImportBadCase& c : cases) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case name " << c.name;
  }
}

// An FP8 cache asked of a backend without FP8 sessions (every backend attnd has today serves
// them, so the check is exercised on the validation function the service calls).
TEST(SessionFp8Unsupported, CreateIsFailedPrecondition) {
  v1::CreateSessionRequest r;
  r.set_num_layers(1);
  r.set_num_kv_heads(1);
  r.set_head_dim(64);
  r.set_dtype(v1::DTYPE_BFLOAT16);
  r.set_cache_dtype(v1::DTYPE_FLOAT8_E4M3);
  r.add_k_scales(1.0f);
  r.add_v_scales(1.0f);
  SessionManager::CreateParams p;
  const absl::Status st = SessionCacheParams(r, Fp8Features{}, &p);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("cache_dtype DTYPE_FLOAT8_E4M3: this attnd's backend has no FP8 "
                              "session caches"),
            std::string::npos)
      << st;
  EXPECT_FALSE(p.cache_dtype.has_value());
  Fp8Features with;
  with.session_cache = true;
  EXPECT_TRUE(SessionCacheParams(r, with, &p).ok());
  EXPECT_EQ(p.cache_dtype, kernels::DType::kFloat8E4M3);
  // A backend whose FP8 kernel has other head dims (the CUDA backend: 64, 128, 256).
  with.session_head_dims = {128, 256};
  SessionManager::CreateParams q;
  const absl::Status dim = SessionCacheParams(r, with, &q);
  EXPECT_EQ(dim.code(), absl::StatusCode::kFailedPrecondition) << dim;
  EXPECT_NE(dim.message().find("head_dim 64: this backend's FP8 kernel takes head_dim 128, 256"),
            std::string::npos)
      << dim;
}

// The same bad steps as BatchStep items between good ones: each bad item gets its own code and
// message, the good ones are computed.
TEST_F(BadInputMatrixTest, BadStepsInsideABatchStepFailAlone) {
  testing::LoopbackServer* server = SessionServer();
  auto* stub = server->client->stub();
  const testing::SessionSpec spec{1, 4, 2, 64, v1::DTYPE_BFLOAT16};
  v1::CreateSessionResponse cr;
  ASSERT_TRUE(testing::CreateSession(stub, spec, &cr).ok());
  testing::SessionShadow shadow(spec);
  v1::BatchStepRequest req;
  std::vector<int> good;
  *req.add_steps() = testing::RandomStep(cr.session_id(), 0, 3, spec, rng_);
  good.push_back(0);
  auto bad = testing::RandomStep(cr.session_id(), 0, 1, spec, rng_);
  bad.mutable_q()->set_dtype(v1::DTYPE_FLOAT16);
  *req.add_steps() = bad;
  *req.add_steps() = testing::RandomStep("other.1", 0, 1, spec, rng_);
  *req.add_steps() = testing::RandomStep(cr.session_id(), 0, 2, spec, rng_);
  good.push_back(3);
  grpc::ClientContext ctx;
  v1::BatchStepResponse resp;
  ASSERT_TRUE(stub->BatchStep(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.results_size(), 4);
  EXPECT_EQ(resp.results(1).status_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(resp.results(1).status_message().find("q.dtype must be the session's dtype"),
            std::string::npos);
  EXPECT_EQ(resp.results(2).status_code(), StatusCode::FAILED_PRECONDITION);
  for (int i : good) {
    ASSERT_EQ(resp.results(i).status_code(), 0) << resp.results(i).status_message();
    shadow.Append(req.steps(i));
    EXPECT_LE(shadow.Check(req.steps(i), resp.results(i).response()).o,
              testing::StepTolerance(spec.dtype));
  }
  // A session id that is not UTF-8 makes the message unparseable (proto3 strings must be
  // UTF-8): gRPC fails the call before attnd's handler sees the request.
  grpc::ClientContext ctx2;
  v1::CloseSessionRequest close;
  close.set_session_id(std::string("\0\xff\xfe", 3));
  v1::CloseSessionResponse closed;
  EXPECT_FALSE(stub->CloseSession(&ctx2, close, &closed).ok());
  EXPECT_TRUE(testing::CloseSession(stub, cr.session_id()).ok());
  ExpectGoodRequestAnswered("session RPCs");
}

// Every field of the session requests that can be wrong has a case whose message names it.
TEST(BadInputMatrixTable, EverySessionFieldHasACaseNamingIt) {
  const auto cases = SessionBadCases();
  for (const google::protobuf::Descriptor* d :
       {v1::CreateSessionRequest::descriptor(), v1::StepRequest::descriptor(),
        v1::TruncateSessionRequest::descriptor()}) {
    for (int i = 0; i < d->field_count(); ++i) {
      std::string field = d->field(i)->name();
      if (field == "return_lse" || field == "session_id") continue;  // any value / ids below
      const std::regex word("(^|[^A-Za-z0-9_])" + field + "($|[^A-Za-z0-9_.])");
      int named = 0;
      for (const SessionBadCase& c : cases) named += std::regex_search(c.message_part, word);
      if (field == "window") named += 1;  // named as window.left
      EXPECT_GT(named, 0) << "no session bad case's message names " << d->name() << "." << field;
    }
  }
  EXPECT_GE(cases.size(), 25u);
}

// Valid edge values that must be accepted (and computed right).
TEST_F(BadInputMatrixTest, ValidEdgeValuesAreAccepted) {
  struct Edge {
    std::string name;
    std::function<void(testing::RandomRequest&, v1::AttendRequest&)> change;
  };
  const std::vector<Edge> edges = {
      {"UnknownPriorityIsNormal", [](auto&, auto& r) { r.set_priority(static_cast<v1::Priority>(7)); }},
      {"WindowInt32Max", [](auto& g, auto& r) {
         g.options.window_left = g.options.window_right = kInt32Max;
         r.mutable_window()->set_left(kInt32Max);
         r.mutable_window()->set_right(kInt32Max);
       }},
      {"WindowZeroZero", [](auto& g, auto& r) {
         g.options.window_left = g.options.window_right = 0;
         r.mutable_window()->set_left(0);
         r.mutable_window()->set_right(0);
       }},
      {"NegativeScale", [](auto& g, auto& r) {
         g.options.softmax_scale = -0.5f;
         r.set_softmax_scale(-0.5f);
       }},
      {"TinyScale", [](auto& g, auto& r) {
         g.options.softmax_scale = 1e-30f;
         r.set_softmax_scale(1e-30f);
       }},
      {"NoCuSeqlens", [](auto& g, auto& r) {
         g.options.cu_seqlens_q = {0, 64};
         g.options.cu_seqlens_k = {0, 64};
         r.clear_cu_seqlens_q();
         r.clear_cu_seqlens_k();
       }},
  };
  for (const Edge& e : edges) {
    SCOPED_TRACE(e.name);
    auto g = Good();
    v1::AttendRequest request = client::Client::BuildAttendRequest(g.q, g.k, g.v, g.options);
    e.change(g, request);
    v1::AttendResponse response;
    grpc::ClientContext ctx;
    const grpc::Status st = server_->client->stub()->Attend(&ctx, request, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    auto parsed = client::Client::ParseAttendResponse(response);
    ASSERT_TRUE(parsed.ok());
    EXPECT_LE(testing::ErrorAgainstReference(g, parsed->o), testing::ToleranceFor(g.q.dtype));
  }
}

// A batch with zero-length sequences is valid: a sequence with queries but no keys gets o = 0
// and lse = -inf for its rows; one with keys but no queries contributes nothing.
TEST_F(BadInputMatrixTest, ZeroLengthSequencesAreValid) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    RequestShape shape;
    shape.seq_q = shape.seq_k = 64;
    shape.dtype = client::DType::kFloat32;
    auto g = MakeRandomRequest(shape, rng_);
    g.options.cu_seqlens_q = {0, 20, 20, 50, 64, 64};
    g.options.cu_seqlens_k = {0, 0, 30, 64, 64, 64};
    g.options.causal = causal;
    g.options.return_lse = true;
    auto result = server_->client->Attend(g.q, g.k, g.v, g.options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_LE(testing::ErrorAgainstReference(g, result->o), testing::ToleranceFor(g.q.dtype));
    const std::vector<float> o = result->o.ToFloats();
    const std::vector<float> lse = result->lse->ToFloats();
    const int64_t row = shape.heads * shape.head_dim;
    auto keyless = [](int64_t t) { return t < 20 || t >= 50; };  // sequences 0 and 3
    for (int64_t t = 0; t < 64; ++t) {
      for (int64_t i = 0; i < row; ++i) {
        if (keyless(t)) ASSERT_EQ(o[t * row + i], 0.0f) << "token " << t;
      }
      for (int h = 0; h < shape.heads; ++h) {
        const float x = lse[h * 64 + t];
        if (keyless(t)) {
          EXPECT_EQ(x, -kInf) << "token " << t;
        } else {
          EXPECT_TRUE(std::isfinite(x)) << "token " << t;
        }
      }
    }
  }
  // All sequences keyless but one query each: o is all zeros.
  RequestShape shape;
  shape.seq_q = 3;
  shape.seq_k = 1;
  auto g = MakeRandomRequest(shape, rng_);
  g.options.cu_seqlens_q = {0, 1, 2, 3};
  g.options.cu_seqlens_k = {0, 0, 0, 1};
  auto result = server_->client->Attend(g.q, g.k, g.v, g.options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LE(testing::ErrorAgainstReference(g, result->o), testing::ToleranceFor(g.q.dtype));
  ExpectGoodRequestAnswered("zero-length sequences");
}

// NaN/Inf inside the tensors are not rejected: the server computes what IEEE arithmetic gives.
// A NaN reaches exactly the output rows that read it; every other row, and every other request
// of the same batch, is unaffected.
class NonFiniteInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.max_queue_delay_us = 300000;  // so that concurrent requests share one batch
    options.gather_when_idle = true;
    server_ = new testing::LoopbackServer(testing::StartLoopbackServer(options));
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  // 2 sequences of 32 queries/keys, 4 query heads over 2 KV heads, d 64, fp32 (exact values).
  testing::RandomRequest Request(bool causal) {
    RequestShape shape;
    shape.batch = 2;
    shape.dtype = client::DType::kFloat32;
    shape.causal = causal;
    return MakeRandomRequest(shape, rng_);
  }

  static void Poison(client::Tensor& t, int64_t token, int64_t head, int64_t c, float value) {
    const int64_t i = (token * t.shape[1] + head) * t.shape[2] + c;
    std::memcpy(t.data.data() + 4 * i, &value, 4);
  }

  // Row (token, head) is affected when affected(token, head); those rows must be all NaN (when
  // expect_nan) and every other row must match the float64 reference of the same inputs.
  static void Check(const testing::RandomRequest& r, const client::Tensor& o,
                    const std::function<bool(int64_t, int64_t)>& affected, bool expect_nan) {
    const auto ref = testing::ReferenceFor(r);
    const std::vector<float> got = o.ToFloats();
    const int64_t heads = r.q.shape[1], head_dim = r.q.shape[2];
    int64_t nan_rows = 0;
    for (int64_t t = 0; t < r.q.shape[0]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (t * heads + h) * head_dim;
        if (affected(t, h)) {
          if (expect_nan) {
            for (int c = 0; c < head_dim; ++c) {
              ASSERT_TRUE(std::isnan(got[base + c])) << "row " << t << " head " << h;
            }
            ++nan_rows;
          }
          continue;
        }
        for (int c = 0; c < head_dim; ++c) {
          ASSERT_TRUE(std::isfinite(got[base + c])) << "row " << t << " head " << h;
          ASSERT_NEAR(got[base + c], ref.o[base + c], 1e-4) << "row " << t << " head " << h;
        }
      }
    }
    if (expect_nan) EXPECT_GT(nan_rows, 0);
  }

  static testing::LoopbackServer* server_;
  std::mt19937_64 rng_{77};
};
testing::LoopbackServer* NonFiniteInputTest::server_ = nullptr;

TEST_F(NonFiniteInputTest, NaNInQReachesOnlyThatRowAndHead) {
  auto r = Request(false);
  Poison(r.q, 5, 1, 3, kNaN);
  auto result = server_->client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(result.ok()) << result.status();
  Check(r, result->o, [](int64_t t, int64_t h) { return t == 5 && h == 1; }, true);
}

// Key 40 (sequence 1) of KV head 0 is NaN: query heads 0 and 1 of sequence 1 read it.
TEST_F(NonFiniteInputTest, NaNInKReachesTheRowsThatSeeThatKey) {
  auto r = Request(false);
  Poison(r.k, 40, 0, 0, kNaN);
  auto result = server_->client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(result.ok()) << result.status();
  Check(r, result->o, [](int64_t t, int64_t h) { return t >= 32 && h < 2; }, true);
}

// Causal: value row 45 (sequence 1, position 13) of KV head 1 is NaN; queries of sequence 1 at
// positions >= 13 see it (heads 2 and 3); earlier queries mask it out and stay finite.
TEST_F(NonFiniteInputTest, NaNInVUnderACausalMaskReachesOnlyQueriesThatSeeIt) {
  auto r = Request(true);
  Poison(r.v, 45, 1, 7, kNaN);
  r.options.return_lse = true;
  auto result = server_->client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(result.ok()) << result.status();
  // A NaN in v leaves the scores alone: the row's lse stays finite, only o turns NaN (column 7
  // at least; the other columns are finite).
  const std::vector<float> o = result->o.ToFloats();
  for (int64_t t = 0; t < 64; ++t) {
    for (int64_t h = 0; h < 4; ++h) {
      const bool sees = t >= 45 && h >= 2;
      const float x = o[(t * 4 + h) * 64 + 7];
      EXPECT_EQ(std::isnan(x), sees) << "row " << t << " head " << h;
    }
  }
  for (float x : result->lse->ToFloats()) EXPECT_TRUE(std::isfinite(x));
  Check(r, result->o, [](int64_t t, int64_t h) { return t >= 45 && h >= 2; }, false);
}

// +Inf in k gives what IEEE arithmetic gives in the rows that see it (here NaN or not, the
// server does not care); other rows are exact.
TEST_F(NonFiniteInputTest, InfInKStaysInItsRows) {
  auto r = Request(false);
  Poison(r.k, 3, 1, 0, kInf);
  auto result = server_->client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(result.ok()) << result.status();
  Check(r, result->o, [](int64_t t, int64_t h) { return t < 32 && h >= 2; }, false);
}

// A NaN request and clean requests computed in the same batch: only the NaN rows of the NaN
// request are affected.
TEST_F(NonFiniteInputTest, OtherRequestsInTheSameBatchAreUnaffected) {
  auto poisoned = Request(false);
  for (int64_t t = 0; t < 64; ++t) Poison(poisoned.q, t, 0, 0, kNaN);
  std::vector<testing::RandomRequest> clean;
  for (int i = 0; i < 3; ++i) clean.push_back(Request(false));
  auto bad_future = std::async(std::launch::async, [&] {
    return server_->client->Attend(poisoned.q, poisoned.k, poisoned.v, poisoned.options);
  });
  std::vector<std::future<absl::StatusOr<client::AttendResult>>> futures;
  for (auto& c : clean) {
    futures.push_back(std::async(std::launch::async, [&] {
      return server_->client->Attend(c.q, c.k, c.v, c.options);
    }));
  }
  auto bad = bad_future.get();
  ASSERT_TRUE(bad.ok()) << bad.status();
  Check(poisoned, bad->o, [](int64_t, int64_t h) { return h == 0; }, true);
  int max_batch = bad->timing.batch_requests();
  for (size_t i = 0; i < clean.size(); ++i) {
    auto res = futures[i].get();
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_LE(testing::ErrorAgainstReference(clean[i], res->o), 1e-5);
    max_batch = std::max(max_batch, res->timing.batch_requests());
  }
  EXPECT_GE(max_batch, 2) << "the requests were expected to share a batch";
}

}  // namespace
}  // namespace attn
