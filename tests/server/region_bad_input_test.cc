// The bad-input matrix of shared-memory regions: every region field of AttendRequest (q/k/v
// .region, o_region, lse_region) and of the SharedMemory RPCs wrong in the ways a client can get
// it wrong, each with its exact status code and a message naming the field. After each case a
// good request through the regions must still be answered correctly (nothing was spoiled), and
// the region bytes of the rejected request's output must be untouched.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <ostream>

#include "region_test_util.h"

namespace attn {
namespace {

using grpc::StatusCode;
using testing::RegionRig;

constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();

struct RegionCase {
  std::string name;
  std::function<void(v1::AttendRequest&, const RegionRig&)> corrupt;
  StatusCode code;
  std::string message_part;
};
void PrintTo(const RegionCase& c, std::ostream* os) { *os << c.name; }

// The rig's request as float32: the same bytes, read as head_dim 32 instead of 64 bfloat16.
void AsFloat32(v1::AttendRequest& r) {
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    t->set_shape(2, t->shape(2) / 2);
  }
}

std::vector<RegionCase> Cases() {
  const auto IA = StatusCode::INVALID_ARGUMENT;
  const auto NF = StatusCode::NOT_FOUND;
  return {
      {"UnknownRegion", [](auto& r, auto&) { r.mutable_q()->mutable_region()->set_region("nope"); },
       NF, "q.region.region: no region named 'nope' is registered"},
      {"EmptyRegionName", [](auto& r, auto&) { r.mutable_k()->mutable_region()->set_region(""); },
       IA, "k.region.region (the region's name) is empty"},
      {"OffsetAtEnd",
       [](auto& r, auto& rig) { r.mutable_k()->mutable_region()->set_offset(rig.in().size()); },
       IA, "k.region: offset"},
      {"OffsetPastEnd",
       [](auto& r, auto& rig) { r.mutable_v()->mutable_region()->set_offset(rig.in().size() + 1); },
       IA, "runs past the end of region 'in'"},
      {"OffsetOverflows",  // offset + bytes wraps around 2^64
       [](auto& r, auto&) { r.mutable_q()->mutable_region()->set_offset(kU64Max - 16); }, IA,
       "q.region: offset 18446744073709551599"},
      {"SliceRunsPastEnd",  // starts inside, ends outside (a region shorter than the tensors)
       [](auto& r, auto& rig) {
         r.mutable_v()->mutable_region()->set_offset(rig.in().size() - rig.kv_bytes() / 2);
       },
       IA, "v.region: offset"},
      {"BytesTooFew",
       [](auto& r, auto& rig) { r.mutable_v()->mutable_region()->set_bytes(rig.kv_bytes() - 2); },
       IA, "v.region.bytes is"},
      {"BytesHuge", [](auto& r, auto&) { r.mutable_q()->mutable_region()->set_bytes(kU64Max); }, IA,
       "q.region.bytes is 18446744073709551615, but the tensor needs"},
      {"BytesZero", [](auto& r, auto&) { r.mutable_k()->mutable_region()->set_bytes(0); }, IA,
       "k.region.bytes is 0"},
      {"DataAndRegion", [](auto& r, auto&) { r.mutable_q()->set_data("xx"); }, IA,
       "q.data and q.region are both set"},
      {"OutputUnknownRegion", [](auto& r, auto&) { r.mutable_o_region()->set_region("gone"); }, NF,
       "o_region.region: no region named 'gone'"},
      {"OutputRegionTooSmall",  // o does not fit after this offset
       [](auto& r, auto& rig) { r.mutable_o_region()->set_offset(rig.out().size() - 8); }, IA,
       "o_region: offset"},
      {"OutputBytesWrong",
       [](auto& r, auto& rig) { r.mutable_o_region()->set_bytes(rig.o_bytes() * 2); }, IA,
       "o_region.bytes is"},
      {"OutputOverlapsInput",
       [](auto& r, auto& rig) { *r.mutable_o_region() = client::RegionSliceOf("in", 0, rig.o_bytes()); },
       IA, "o_region overlaps q.region in region 'in'"},
      {"OutputOverlapsK",
       [](auto& r, auto& rig) {
         *r.mutable_o_region() = client::RegionSliceOf("in", rig.q_bytes(), rig.o_bytes());
       },
       IA, "o_region overlaps k.region"},
      {"LseRegionWithoutReturnLse",
       [](auto& r, auto& rig) {
         *r.mutable_lse_region() = client::RegionSliceOf("out", rig.lse_offset(), rig.lse_bytes());
       },
       IA, "lse_region is set, but return_lse is false"},
      {"LseRegionBytesWrong",
       [](auto& r, auto& rig) {
         r.set_return_lse(true);
         *r.mutable_lse_region() = client::RegionSliceOf("out", rig.lse_offset(), 4);
       },
       IA, "lse_region.bytes is 4"},
      {"LseOverlapsO",
       [](auto& r, auto& rig) {
         r.set_return_lse(true);
         *r.mutable_lse_region() = client::RegionSliceOf("out", 0, rig.lse_bytes());
       },
       IA, "o_region overlaps lse_region"},
      {"RegionClearedNoData",  // q neither in a region nor in the message: its data is empty
       [](auto& r, auto&) { r.mutable_q()->clear_region(); }, IA, "q.data has 0 bytes"},
      // Offsets that are not a multiple of the element size (2 for bfloat16, 4 for float32 and
      // lse), each slice otherwise inside its region: refused before any element is read.
      {"QOffsetOdd", [](auto& r, auto&) { r.mutable_q()->mutable_region()->set_offset(1); }, IA,
       "q.region: offset 1 is not a multiple of 2, the size of the tensor's elements: a tensor "
       "in a region must start at a multiple of its element size"},
      {"KOffsetOdd",
       [](auto& r, auto& rig) { r.mutable_k()->mutable_region()->set_offset(rig.q_bytes() + 1); },
       IA, "k.region: offset 32769 is not a multiple of 2"},
      {"VOffsetOdd",
       [](auto& r, auto& rig) {
         r.mutable_v()->mutable_region()->set_offset(rig.q_bytes() + rig.kv_bytes() - 1);
       },
       IA, "v.region: offset 49151 is not a multiple of 2"},
      {"OutputOffsetOdd", [](auto& r, auto&) { r.mutable_o_region()->set_offset(3); }, IA,
       "o_region: offset 3 is not a multiple of 2"},
      {"LseOffsetNotMultipleOf4",  // a multiple of 2 (o's element size), not of 4
       [](auto& r, auto& rig) {
         r.set_return_lse(true);
         *r.mutable_lse_region() =
             client::RegionSliceOf("out", rig.lse_offset() + 2, rig.lse_bytes());
       },
       IA, "lse_region: offset 32770 is not a multiple of 4"},
      {"LseOffsetOdd",
       [](auto& r, auto& rig) {
         r.set_return_lse(true);
         *r.mutable_lse_region() =
             client::RegionSliceOf("out", rig.lse_offset() + 1, rig.lse_bytes());
       },
       IA, "lse_region: offset 32769 is not a multiple of 4"},
      // The inputs fuzzing found: float32 tensors (the same bytes, as head_dim 32) with k, or v,
      // at an offset that is even but not a multiple of 4.
      {"Float32KOffsetNotMultipleOf4",
       [](auto& r, auto& rig) {
         AsFloat32(r);
         r.mutable_k()->mutable_region()->set_offset(rig.q_bytes() + 2);
       },
       IA, "k.region: offset 32770 is not a multiple of 4"},
      {"Float32VOffsetNotMultipleOf4",
       [](auto& r, auto& rig) {
         AsFloat32(r);
         r.mutable_v()->mutable_region()->set_offset(rig.q_bytes() + rig.kv_bytes() - 6);
       },
       IA, "v.region: offset 49146 is not a multiple of 4"},
      {"Float32QOffsetNotMultipleOf4",
       [](auto& r, auto&) {
         AsFloat32(r);
         r.mutable_q()->mutable_region()->set_offset(6);
       },
       IA, "q.region: offset 6 is not a multiple of 4"},
      {"Float32OutputOffsetNotMultipleOf4",
       [](auto& r, auto&) {
         AsFloat32(r);
         r.mutable_o_region()->set_offset(10);
       },
       IA, "o_region: offset 10 is not a multiple of 4"},
  };
}

class RegionBadInput : public ::testing::TestWithParam<RegionCase> {
 protected:
  static void SetUpTestSuite() {
    rig_ = new RegionRig();
    ASSERT_TRUE(rig_->Start());
  }
  static void TearDownTestSuite() {
    delete rig_;
    rig_ = nullptr;
  }
  // A good request through the regions is answered, and correctly.
  void ExpectGoodRequestAnswered() {
    v1::AttendResponse inline_response, response;
    ASSERT_TRUE(rig_->Attend(rig_->InlineRequest(false), &inline_response).ok());
    std::memset(rig_->out().data(), 0, rig_->o_bytes());
    const absl::Status st = rig_->Attend(rig_->RegionRequest(true, false), &response);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(std::memcmp(rig_->out().data(), inline_response.o().data().data(), rig_->o_bytes()),
              0);
  }
  static RegionRig* rig_;
};
RegionRig* RegionBadInput::rig_ = nullptr;

TEST_P(RegionBadInput, Unary) {
  const RegionCase& c = GetParam();
  v1::AttendRequest request = rig_->RegionRequest(true, false);
  c.corrupt(request, *rig_);
  std::memset(rig_->out().data(), 0x5a, rig_->out().size());
  v1::AttendResponse response;
  const absl::Status st = rig_->Attend(request, &response);
  EXPECT_EQ(static_cast<int>(st.code()), static_cast<int>(c.code)) << st;
  EXPECT_NE(std::string(st.message()).find(c.message_part), std::string::npos)
      << "message: " << st.message() << "\nwanted: " << c.message_part;
  EXPECT_FALSE(response.has_o());
  // Refused before any work: the output region was not written.
  for (size_t i = 0; i < rig_->out().size(); ++i) {
    if (rig_->out().data()[i] != 0x5a) {
      ADD_FAILURE() << "output region byte " << i << " was written by a refused request";
      break;
    }
  }
  ExpectGoodRequestAnswered();
}

// The bad item midway through an AttendStream: its own status, the stream goes on.
TEST_P(RegionBadInput, StreamItem) {
  const RegionCase& c = GetParam();
  v1::AttendRequest bad = rig_->RegionRequest(true, false);
  c.corrupt(bad, *rig_);
  bad.set_request_id(7);
  v1::AttendRequest good = rig_->InlineRequest(false);
  good.set_request_id(8);
  grpc::ClientContext ctx;
  rig_->client().PrepareContext(&ctx, std::chrono::milliseconds(30000));
  auto stream = rig_->client().stub()->AttendStream(&ctx);
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Write(good));
  stream->WritesDone();
  v1::AttendResponse r;
  int seen = 0;
  while (stream->Read(&r)) {
    ++seen;
    if (r.request_id() == 7) {
      EXPECT_EQ(r.status_code(), static_cast<int>(c.code)) << r.status_message();
      EXPECT_NE(r.status_message().find(c.message_part), std::string::npos) << r.status_message();
    } else {
      EXPECT_EQ(r.status_code(), 0) << r.status_message();
    }
  }
  EXPECT_EQ(seen, 2);
  EXPECT_TRUE(stream->Finish().ok());
}

INSTANTIATE_TEST_SUITE_P(Matrix, RegionBadInput, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

// Any offset that is a multiple of the element size is taken, also one that is not 16-byte
// aligned: the answer through such slices equals the inline one, bit for bit.
TEST_F(RegionBadInput, ElementAlignedOffsetsAreServed) {
  struct Layout {
    const char* dtype;
    uint64_t q, k, v, o, lse;  // the gap before each slice (inputs in "in2", outputs in "out2")
  };
  for (const Layout& at : {Layout{"bfloat16", 2, 6, 10, 2, 2}, Layout{"float32", 4, 8, 12, 4, 4}}) {
    const bool f32 = std::string(at.dtype) == "float32";
    const size_t q = rig_->q_bytes(), kv = rig_->kv_bytes();
    const uint64_t q_at = at.q, k_at = q_at + q + at.k, v_at = k_at + kv + at.v;
    auto in = client::HostRegion::Create(v_at + kv);
    auto out = client::HostRegion::Create(at.o + q + at.lse + rig_->lse_bytes());
    ASSERT_TRUE(in.ok() && out.ok());
    std::memcpy((*in)->data() + q_at, rig_->random().q.data.data(), q);
    std::memcpy((*in)->data() + k_at, rig_->random().k.data.data(), kv);
    std::memcpy((*in)->data() + v_at, rig_->random().v.data.data(), kv);
    ASSERT_TRUE(rig_->regions().Register("in2", **in).ok());
    ASSERT_TRUE(rig_->regions().Register("out2", **out).ok());
    v1::AttendRequest inline_request = rig_->InlineRequest(true);
    v1::AttendRequest request = rig_->RegionRequest(true, true);
    if (f32) {
      AsFloat32(inline_request);
      AsFloat32(request);
    }
    for (auto [t, offset] : {std::pair{request.mutable_q(), q_at}, std::pair{request.mutable_k(), k_at},
                             std::pair{request.mutable_v(), v_at}}) {
      t->mutable_region()->set_region("in2");
      t->mutable_region()->set_offset(offset);
    }
    const uint64_t lse_at = at.o + q + at.lse;
    *request.mutable_o_region() = client::RegionSliceOf("out2", at.o, q);
    *request.mutable_lse_region() = client::RegionSliceOf("out2", lse_at, rig_->lse_bytes());
    std::memset((*out)->data(), 0x5a, (*out)->size());
    v1::AttendResponse inline_response, response;
    ASSERT_TRUE(rig_->Attend(inline_request, &inline_response).ok());
    const absl::Status st = rig_->Attend(request, &response);
    ASSERT_TRUE(st.ok()) << at.dtype << ": " << st;
    EXPECT_EQ(std::memcmp((*out)->data() + at.o, inline_response.o().data().data(), q), 0)
        << at.dtype << ": o differs from the inline answer";
    EXPECT_EQ(std::memcmp((*out)->data() + lse_at, inline_response.lse().data().data(),
                          rig_->lse_bytes()),
              0)
        << at.dtype << ": lse differs from the inline answer";
    ASSERT_TRUE(rig_->regions().Unregister("in2").ok());
    ASSERT_TRUE(rig_->regions().Unregister("out2").ok());
  }
}

// SharedMemory RPCs with bad fields.
class RegionRpcBadInput : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(rig_.Start()); }
  absl::Status RegisterWith(const std::function<void(v1::RegisterRegionRequest&)>& corrupt) {
    auto region = client::HostRegion::Create(4096);
    EXPECT_TRUE(region.ok());
    auto handle = rig_.regions().SendDescriptor((*region)->fd());
    EXPECT_TRUE(handle.ok()) << handle.status();
    v1::RegisterRegionRequest request;
    request.set_name("fresh");
    request.set_kind(v1::REGION_KIND_HOST);
    request.set_handle(handle.ok() ? *handle : "");
    corrupt(request);
    return rig_.Register(request);
  }
  static void Expect(const absl::Status& st, absl::StatusCode code, const std::string& part) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(std::string(st.message()).find(part), std::string::npos) << st;
  }
  RegionRig rig_;
};

TEST_F(RegionRpcBadInput, NameEmpty) {
  Expect(RegisterWith([](auto& r) { r.set_name(""); }), absl::StatusCode::kInvalidArgument,
         "name must have 1 to 64 characters, got 0");
}
TEST_F(RegionRpcBadInput, NameTooLong) {
  Expect(RegisterWith([](auto& r) { r.set_name(std::string(65, 'a')); }),
         absl::StatusCode::kInvalidArgument, "name must have 1 to 64 characters, got 65");
}
TEST_F(RegionRpcBadInput, NameWithSlash) {
  Expect(RegisterWith([](auto& r) { r.set_name("../etc"); }), absl::StatusCode::kInvalidArgument,
         "name may hold only");
}
TEST_F(RegionRpcBadInput, NameTaken) {
  Expect(RegisterWith([](auto& r) { r.set_name("in"); }), absl::StatusCode::kAlreadyExists,
         "name: a region named 'in' is already registered");
}
TEST_F(RegionRpcBadInput, KindUnspecified) {
  Expect(RegisterWith([](auto& r) { r.set_kind(v1::REGION_KIND_UNSPECIFIED); }),
         absl::StatusCode::kInvalidArgument,
         "kind must be REGION_KIND_HOST, REGION_KIND_CUDA or REGION_KIND_CUDA_VMM");
}
TEST_F(RegionRpcBadInput, KindUnknownNumber) {
  Expect(RegisterWith([](auto& r) { r.set_kind(static_cast<v1::RegionKind>(77)); }),
         absl::StatusCode::kInvalidArgument, "REGION_KIND_CUDA_VMM, got 77");
}
// A GPU region's own fields are checked first, then whether this attnd has a GPU at all.
void AsCuda(v1::RegisterRegionRequest& r) {
  r.set_kind(v1::REGION_KIND_CUDA);
  r.clear_handle();
  r.set_cuda_ipc_handle(std::string(64, '\1'));
  r.set_bytes(4096);
}
TEST_F(RegionRpcBadInput, CudaHandleWrongLength) {
  Expect(RegisterWith([](auto& r) { AsCuda(r); r.set_cuda_ipc_handle("short"); }),
         absl::StatusCode::kInvalidArgument,
         "cuda_ipc_handle must be the 64 bytes of a cudaIpcMemHandle_t, got 5");
}
TEST_F(RegionRpcBadInput, CudaBytesZero) {
  Expect(RegisterWith([](auto& r) { AsCuda(r); r.set_bytes(0); }),
         absl::StatusCode::kInvalidArgument, "bytes must be > 0 for a GPU region");
}
TEST_F(RegionRpcBadInput, CudaDeviceNegative) {
  Expect(RegisterWith([](auto& r) { AsCuda(r); r.set_device_id(-1); }),
         absl::StatusCode::kInvalidArgument, "device_id must be >= 0, got -1");
}
TEST_F(RegionRpcBadInput, CudaOnTheCpuBackend) {
  Expect(RegisterWith([](auto& r) { AsCuda(r); }), absl::StatusCode::kFailedPrecondition,
         "GPU regions need attnd's CUDA backend");
}
TEST_F(RegionRpcBadInput, HandleEmpty) {
  Expect(RegisterWith([](auto& r) { r.set_handle(""); }), absl::StatusCode::kInvalidArgument,
         "handle is empty");
}
TEST_F(RegionRpcBadInput, HandleUnknown) {
  Expect(RegisterWith([](auto& r) { r.set_handle("0123456789abcdef0123456789abcdef"); }),
         absl::StatusCode::kInvalidArgument, "handle is unknown");
}
// Leases (handles without a memfd, for GPU regions) and memfd handles are not interchangeable.
TEST_F(RegionRpcBadInput, HostRegionWithALease) {
  auto lease = rig_.regions().Lease();
  ASSERT_TRUE(lease.ok()) << lease.status();
  Expect(RegisterWith([&](auto& r) { r.set_handle(*lease); }), absl::StatusCode::kInvalidArgument,
         "handle is a lease for a GPU region");
}
TEST_F(RegionRpcBadInput, CudaRegionWithAMemfdHandle) {
  // RegisterWith passes a memfd's handle; a GPU region wants a lease there.
  Expect(RegisterWith([](auto& r) {
           const std::string memfd_handle = r.handle();
           AsCuda(r);
           r.set_handle(memfd_handle);
         }),
         absl::StatusCode::kInvalidArgument, "handle is unknown, expired (60 s), already claimed or not a lease");
}
TEST_F(RegionRpcBadInput, CudaRegionWithUnknownLease) {
  Expect(RegisterWith([](auto& r) { AsCuda(r); r.set_handle("00000000000000000000000000000000"); }),
         absl::StatusCode::kInvalidArgument, "not a lease");
}
TEST_F(RegionRpcBadInput, CudaRegionWithALeaseOnTheCpuBackend) {
  auto lease = rig_.regions().Lease();
  ASSERT_TRUE(lease.ok()) << lease.status();
  Expect(RegisterWith([&](auto& r) { AsCuda(r); r.set_handle(*lease); }),
         absl::StatusCode::kFailedPrecondition, "GPU regions need attnd's CUDA backend");
}

// A CUDA VMM region: its descriptor over the socket, then RegisterRegion.
TEST_F(RegionRpcBadInput, CudaVmmOnTheCpuBackend) {
  auto region = client::HostRegion::Create(4096);  // any descriptor: refused before an import
  ASSERT_TRUE(region.ok());
  auto handle = rig_.regions().SendVmmDescriptor((*region)->fd());
  ASSERT_TRUE(handle.ok()) << handle.status();
  Expect(RegisterWith([&](auto& r) {
           r.set_kind(v1::REGION_KIND_CUDA_VMM);
           r.set_handle(*handle);
           r.set_bytes(4096);
         }),
         absl::StatusCode::kFailedPrecondition,
         "kind REGION_KIND_CUDA_VMM: GPU regions need attnd's CUDA backend");
}
TEST_F(RegionRpcBadInput, CudaVmmWithAMemfdHandle) {
  Expect(RegisterWith([](auto& r) {
           r.set_kind(v1::REGION_KIND_CUDA_VMM);
           r.set_bytes(4096);
         }),
         absl::StatusCode::kInvalidArgument, "not a CUDA VMM allocation's");
}
TEST_F(RegionRpcBadInput, CudaVmmBytesZero) {
  Expect(RegisterWith([](auto& r) { r.set_kind(v1::REGION_KIND_CUDA_VMM); }),
         absl::StatusCode::kInvalidArgument, "bytes must be > 0 for a GPU region");
}
TEST_F(RegionRpcBadInput, HostRegionWithAVmmHandle) {
  auto region = client::HostRegion::Create(4096);
  ASSERT_TRUE(region.ok());
  auto handle = rig_.regions().SendVmmDescriptor((*region)->fd());
  ASSERT_TRUE(handle.ok()) << handle.status();
  Expect(RegisterWith([&](auto& r) { r.set_handle(*handle); }),
         absl::StatusCode::kInvalidArgument, "handle is a CUDA VMM allocation's");
}

TEST_F(RegionRpcBadInput, UnregisterUnknown) {
  Expect(rig_.regions().Unregister("never"), absl::StatusCode::kNotFound,
         "name: no region named 'never'");
}
TEST_F(RegionRpcBadInput, UnregisterTwice) {
  ASSERT_TRUE(rig_.regions().Unregister("out").ok());
  Expect(rig_.regions().Unregister("out"), absl::StatusCode::kNotFound,
         "name: no region named 'out'");
}

}  // namespace
}  // namespace attn
