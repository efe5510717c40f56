// Step and BatchStep on the wire path. The codecs: attnd's response encoders and the client's
// request encoders write exactly protobuf's bytes for random messages; attnd's request decoders
// and the client's response decoders read any split of the bytes (and messages protobuf merges:
// repeated fields, unknown fields) as protobuf's parser does, and refuse exactly what it refuses,
// with INVALID_ARGUMENT naming the message. End to end through a real attnd on loopback (CPU
// backend): both client codings give byte-identical answers that match the float64 reference
// over each session's cache, the generated stub works against the raw handlers, and malformed
// messages are refused without touching any session.
#include <gtest/gtest.h>

#include <grpcpp/client_context.h>
#include <grpcpp/impl/client_unary_call.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "attn/client/session.h"
#include "attn/client/wire_coding.h"
#include "attn/util/wire_fields.h"
#include "common/wire_test_util.h"
#include "rpc/response_encoder.h"
#include "rpc/step_request_decoder.h"
#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::Flatten;
using testing::RandomBytes;
using testing::SessionShadow;
using testing::SessionSpec;

uint64_t FreshSeed() { return std::random_device{}() | 1; }

// bytes cut at random places into pieces, some of them empty.
std::vector<std::string_view> RandomSplit(const std::string& bytes, std::mt19937_64& rng) {
  std::vector<std::string_view> pieces;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = rng() % 4 == 0 ? 0 : std::min<size_t>(bytes.size() - at, 1 + rng() % 700);
    pieces.push_back(std::string_view(bytes).substr(at, n));
    at += n;
  }
  if (rng() % 2) pieces.push_back({});
  return pieces;
}

grpc::ByteBuffer BufferOf(const std::vector<std::string_view>& pieces) {
  std::vector<grpc::Slice> slices;
  for (std::string_view p : pieces) slices.emplace_back(p.data(), p.size());
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A random step of the session spec's shape: options, windows, lse, layer and id vary.
v1::StepRequest RandomStepRequest(const std::string& id, const SessionSpec& spec, int tokens,
                                  std::mt19937_64& rng) {
  v1::StepRequest r =
      testing::RandomStep(id, static_cast<int>(rng() % spec.layers), tokens, spec, rng);
  const float scales[] = {0.0f, 0.0f, 0.11f, 0.2f};
  r.set_softmax_scale(scales[rng() % 4]);
  r.set_return_lse(rng() % 2 == 0);
  switch (rng() % 3) {
    case 0: break;
    case 1: r.mutable_window()->set_left(static_cast<int32_t>(rng() % 9)); r.mutable_window()->set_right(-1); break;
    default: r.mutable_window()->set_left(-1); r.mutable_window()->set_right(0); break;
  }
  return r;
}

// The client's input for a step message, and the message of a client's result.
client::StepInput InputOf(const v1::StepRequest& r) {
  client::StepInput in;
  in.session_id = r.session_id();
  in.layer = r.layer();
  in.q = *client::FromWireTensor(r.q());
  in.k_new = *client::FromWireTensor(r.k_new());
  in.v_new = *client::FromWireTensor(r.v_new());
  in.options.softmax_scale = r.softmax_scale();
  in.options.return_lse = r.return_lse();
  if (r.has_window()) {
    in.options.window_left = r.window().left();
    in.options.window_right = r.window().right();
  }
  in.k_new_scales.assign(r.k_new_scales().begin(), r.k_new_scales().end());
  in.v_new_scales.assign(r.v_new_scales().begin(), r.v_new_scales().end());
  return in;
}

v1::StepResponse ResponseOf(const client::StepResult& result) {
  v1::StepResponse r;
  client::ToWireTensor(result.o, r.mutable_o());
  if (result.lse) client::ToWireTensor(*result.lse, r.mutable_lse());
  r.set_cached_tokens(result.cached_tokens);
  *r.mutable_timing() = result.timing;
  return r;
}

// A random StepResponse as attnd answers a step: o (and maybe lse) with random data, timing.
v1::StepResponse RandomStepResponse(std::mt19937_64& rng) {
  v1::StepResponse r;
  const int64_t tokens = 1 + rng() % 5, heads = 1 + rng() % 8, d = 8 << (rng() % 3);
  v1::Tensor* o = r.mutable_o();
  o->set_dtype(rng() % 2 ? v1::DTYPE_BFLOAT16 : v1::DTYPE_FLOAT16);
  for (int64_t s : {tokens, heads, d}) o->add_shape(s);
  o->set_data(RandomBytes(rng, size_t(tokens * heads * d * 2)));
  if (rng() % 2) {
    v1::Tensor* lse = r.mutable_lse();
    lse->set_dtype(v1::DTYPE_FLOAT32);
    lse->add_shape(heads);
    lse->add_shape(tokens);
    lse->set_data(RandomBytes(rng, size_t(4 * heads * tokens)));
  }
  r.set_cached_tokens(static_cast<int64_t>(rng() % 100000));
  r.mutable_timing()->set_queue_us(double(rng() % 1000) / 7);
  r.mutable_timing()->set_compute_us(double(rng() % 1000) / 3);
  r.mutable_timing()->set_batch_requests(static_cast<int32_t>(rng() % 64));
  return r;
}

// The response as attnd's encoder takes it: the header without data, the data in buffers.
grpc::ByteBuffer EncodeViaServer(const v1::StepResponse& full) {
  v1::StepResponse header = full;
  OutputBytes o, lse;
  if (full.has_o() && !full.o().data().empty()) {
    o = OutputBytes::Allocate(full.o().data().size());
    std::memcpy(o.data, full.o().data().data(), o.size);
    header.mutable_o()->clear_data();
  }
  if (full.has_lse() && !full.lse().data().empty()) {
    lse = OutputBytes::Allocate(full.lse().data().size());
    std::memcpy(lse.data, full.lse().data().data(), lse.size);
    header.mutable_lse()->clear_data();
  }
  return EncodeStepResponse(header, std::move(o), std::move(lse));
}

class StepWireCodecTest : public ::testing::Test {
 protected:
  std::mt19937_64 rng_{FreshSeed()};
  SessionSpec spec_{3, 8, 2, 32, v1::DTYPE_BFLOAT16};
};

TEST_F(StepWireCodecTest, ServerEncodesResponsesAsProtobufDoes) {
  for (int i = 0; i < 200; ++i) {
    const v1::StepResponse full = RandomStepResponse(rng_);
    ASSERT_EQ(Flatten(EncodeViaServer(full)), full.SerializeAsString());
  }
  for (int i = 0; i < 50; ++i) {
    v1::BatchStepResponse full;
    std::vector<v1::StepResponse> headers(rng_() % 9);
    std::vector<EncodedStepResult> results(headers.size());
    for (size_t j = 0; j < headers.size(); ++j) {
      v1::StepResult* item = full.add_results();
      if (rng_() % 3 == 0) {
        item->set_status_code(3);
        item->set_status_message(absl::StrCat("item ", j, " is bad"));
        results[j].status_code = 3;
        results[j].status_message = item->status_message();
        continue;
      }
      *item->mutable_response() = RandomStepResponse(rng_);
      headers[j] = item->response();
      headers[j].mutable_o()->clear_data();
      results[j].o = OutputBytes::Allocate(item->response().o().data().size());
      std::memcpy(results[j].o.data, item->response().o().data().data(), results[j].o.size);
      if (item->response().has_lse()) {
        headers[j].mutable_lse()->clear_data();
        results[j].lse = OutputBytes::Allocate(item->response().lse().data().size());
        std::memcpy(results[j].lse.data, item->response().lse().data().data(),
                    results[j].lse.size);
      }
      results[j].response = &headers[j];
    }
    ASSERT_EQ(Flatten(EncodeBatchStepResponse(results)), full.SerializeAsString());
  }
}

TEST_F(StepWireCodecTest, ClientEncodesRequestsAsProtobufDoes) {
  for (int i = 0; i < 100; ++i) {
    v1::StepRequest r = RandomStepRequest(i % 5 ? "replica-a.17" : "", spec_, 1 + rng_() % 9, rng_);
    if (i % 7 == 0) r.set_softmax_scale(-0.0f);  // written: protobuf compares the bits
    if (i % 11 == 0) {
      r.mutable_window()->set_left(-1);
      r.mutable_window()->set_right(-1);
    }
    if (i % 3 == 0) {  // FP8 codes' scales (-0.0 written: packed floats keep every value)
      for (int h = 0; h < spec_.kv_heads; ++h) {
        r.add_k_new_scales(static_cast<float>(rng_() % 1000) / 448);
        r.add_v_new_scales(rng_() % 5 == 0 ? -0.0f : static_cast<float>(rng_() % 1000) / 448);
      }
    }
    client::BorrowedSlices borrowed;
    const client::StepInput in = InputOf(r);
    // What the library's protobuf path sends (a window of -1/-1 is left out by both).
    ASSERT_EQ(Flatten(client::EncodeStepRequest(in, &borrowed)),
              client::BuildStepRequest(in).SerializeAsString());
    std::vector<client::StepInput> items;
    v1::BatchStepRequest batch;
    for (int j = 0; j < static_cast<int>(rng_() % 6); ++j) {
      items.push_back(InputOf(RandomStepRequest("s", spec_, 1 + rng_() % 4, rng_)));
    }
    std::vector<size_t> indices;
    for (size_t j = 0; j < items.size(); ++j) {
      if (rng_() % 3) indices.push_back(j);
    }
    for (size_t j : indices) *batch.add_steps() = client::BuildStepRequest(items[j]);
    ASSERT_EQ(Flatten(client::EncodeBatchStepRequest(items, &indices, &borrowed)),
              batch.SerializeAsString());
    batch.Clear();
    for (const auto& item : items) *batch.add_steps() = client::BuildStepRequest(item);
    ASSERT_EQ(Flatten(client::EncodeBatchStepRequest(items, nullptr, &borrowed)),
              batch.SerializeAsString());
  }
}

// Checks that attnd's decoder reads bytes (any split) as protobuf's parser does: the same
// header (unknown fields included, compared as serialized bytes), the data fields as pieces; or
// that both refuse them. batch: a BatchStepRequest, else a lone StepRequest.
void ExpectDecodesAsProtobuf(const std::string& bytes, std::mt19937_64& rng, bool batch = true) {
  SCOPED_TRACE(::testing::Message() << (batch ? "BatchStepRequest" : "StepRequest") << " of "
                                    << bytes.size() << " bytes");
  v1::BatchStepRequest want;
  bool parses;
  std::vector<DecodedStepRequest> got;
  google::protobuf::Arena arena;
  absl::Status st;
  const std::vector<std::string_view> pieces = RandomSplit(bytes, rng);
  if (batch) {
    parses = want.ParseFromString(bytes);
    st = DecodeBatchStepRequest(pieces, &got, rng() % 2 ? &arena : nullptr);
  } else {
    parses = want.add_steps()->ParseFromString(bytes);
    st = DecodeStepRequest(pieces, &got.emplace_back(rng() % 2 ? &arena : nullptr));
  }
  ASSERT_EQ(st.ok(), parses) << st;
  if (!parses) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message().find(batch ? "BatchStepRequest is malformed: "
                                      : "StepRequest is malformed: "),
              0u)
        << st;
    EXPECT_NE(st.message().find(" (at byte "), std::string::npos) << st;
    return;
  }
  ASSERT_EQ(got.size(), static_cast<size_t>(want.steps_size()));
  for (size_t i = 0; i < got.size(); ++i) {
    v1::StepRequest header = want.steps(static_cast<int>(i));
    const std::pair<v1::Tensor*, const WireBytes*> tensors[] = {
        {header.has_q() ? header.mutable_q() : nullptr, &got[i].data.q},
        {header.has_k_new() ? header.mutable_k_new() : nullptr, &got[i].data.k},
        {header.has_v_new() ? header.mutable_v_new() : nullptr, &got[i].data.v}};
    for (const auto& [t, data] : tensors) {
      std::string copied(data->size, '\0');
      data->CopyTo(copied.data());
      EXPECT_EQ(copied, t != nullptr ? t->data() : "");
      if (t != nullptr) t->clear_data();
    }
    EXPECT_EQ(got[i].header().SerializeAsString(), header.SerializeAsString())
        << "step " << i << ": decoder " << got[i].header().ShortDebugString() << "; protobuf "
        << header.ShortDebugString();
  }
}

// The protobuf wire format written by hand, for encodings protobuf's serializer never makes:
// fields out of order or repeated, unpacked repeated fields, unknown fields and groups,
// over-long varints.
namespace hand {

std::string Varint(uint64_t v) {
  std::string s;
  wire::AppendVarint(v, &s);
  return s;
}
std::string Tag(uint64_t number, uint32_t type) { return Varint(number << 3 | type); }
std::string Len(uint64_t number, const std::string& body) {
  return Tag(number, 2) + Varint(body.size()) + body;
}
std::string VarintField(uint64_t number, uint64_t v) { return Tag(number, 0) + Varint(v); }
std::string Fixed32(uint64_t number, float f) {
  std::string s = Tag(number, 5);
  s.append(reinterpret_cast<const char*>(&f), 4);
  return s;
}
std::string Fixed64(uint64_t number, uint64_t v) {
  std::string s = Tag(number, 1);
  s.append(reinterpret_cast<const char*>(&v), 8);
  return s;
}
std::string Group(uint64_t number, const std::string& body) {
  return Tag(number, 3) + body + Tag(number, 4);
}
// Groups nested depth deep, a varint in the innermost.
std::string NestedGroups(uint64_t number, int depth) {
  std::string s = VarintField(1, 7);
  for (int i = 0; i < depth; ++i) s = Group(number, s);
  return s;
}
std::string Packed(const std::vector<int64_t>& values) {
  std::string s;
  for (int64_t v : values) wire::AppendVarint(static_cast<uint64_t>(v), &s);
  return s;
}
std::string PackedFloats(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), 4 * values.size());
}

}  // namespace hand

// A random step with every field the decoder knows, and unknown fields of every wire type (kept
// by protobuf in the message they arrive in) here and there.
v1::StepRequest RandomFullStep(const SessionSpec& spec, std::mt19937_64& rng) {
  v1::StepRequest r = RandomStepRequest(rng() % 2 ? "replica-a.3" : "", spec, 1 + rng() % 4, rng);
  auto unknowns = [&rng](google::protobuf::Message* m) {
    auto* u = m->GetReflection()->MutableUnknownFields(m);
    for (int i = 0; i < static_cast<int>(rng() % 3); ++i) {
      const int number = 30 + static_cast<int>(rng() % 2000);
      switch (rng() % 5) {
        case 0: u->AddVarint(number, rng()); break;
        case 1: u->AddFixed32(number, static_cast<uint32_t>(rng())); break;
        case 2: u->AddFixed64(number, rng()); break;
        case 3: u->AddLengthDelimited(number, RandomBytes(rng, rng() % 9)); break;
        default: u->AddGroup(number)->AddVarint(1, rng() % 300); break;
      }
    }
  };
  if (rng() % 3 == 0) {
    r.mutable_o_region()->set_region("out");
    r.mutable_o_region()->set_offset(rng() % 4096);
    r.mutable_o_region()->set_bytes(rng() % 100000);
    unknowns(r.mutable_o_region());
  }
  if (rng() % 3 == 0) r.mutable_lse_region()->set_region("lse\u00e9");
  if (rng() % 3 == 0) {
    for (int i = 0; i < spec.kv_heads; ++i) {
      r.add_k_new_scales(static_cast<float>(rng() % 1000) / 448);
      r.add_v_new_scales(rng() % 5 == 0 ? -0.0f : static_cast<float>(rng() % 1000) / 448);
    }
  }
  if (rng() % 4 == 0) r.set_layer(-1 - static_cast<int32_t>(rng() % 5));  // 10-byte varints
  if (rng() % 4 == 0) r.mutable_v_new()->mutable_region()->set_region("in");
  if (rng() % 4 == 0) r.mutable_q()->set_dtype(static_cast<v1::DType>(17));  // open enum
  for (google::protobuf::Message* m : {static_cast<google::protobuf::Message*>(&r),
                                       static_cast<google::protobuf::Message*>(r.mutable_q()),
                                       static_cast<google::protobuf::Message*>(r.mutable_window())}) {
    if (rng() % 3 == 0) unknowns(m);
  }
  return r;
}

TEST_F(StepWireCodecTest, DecoderMatchesProtobufOnRandomMessagesAndMerges) {
  for (int i = 0; i < 300; ++i) {
    std::vector<v1::StepRequest> steps(1 + rng_() % 4);
    for (auto& s : steps) s = RandomFullStep(spec_, rng_);
    // A lone step, and the same bytes twice (protobuf merges them: the later data wins, shapes
    // and scales append, sub-messages merge).
    const std::string one = steps[0].SerializeAsString();
    ExpectDecodesAsProtobuf(one, rng_, false);
    ExpectDecodesAsProtobuf(one + steps.back().SerializeAsString(), rng_, false);
    // A step cut into its fields, the fields shuffled: any order.
    {
      v1::StepRequest s = steps[0];
      std::vector<std::string> fields;
      const google::protobuf::Reflection* refl = s.GetReflection();
      std::vector<const google::protobuf::FieldDescriptor*> set;
      refl->ListFields(s, &set);
      for (const auto* fd : set) {
        v1::StepRequest only;
        only.GetReflection()->SwapFields(&s, &only, {fd});
        fields.push_back(only.SerializeAsString());
        only.GetReflection()->SwapFields(&s, &only, {fd});
      }
      std::shuffle(fields.begin(), fields.end(), rng_);
      std::string shuffled;
      for (const auto& f : fields) shuffled += f;
      ExpectDecodesAsProtobuf(shuffled, rng_, false);
    }
    v1::BatchStepRequest batch;
    for (const auto& s : steps) *batch.add_steps() = s;
    std::string bytes = batch.SerializeAsString();
    if (i % 3 == 0) bytes += batch.SerializeAsString();
    if (i % 5 == 0) bytes += hand::Group(9, hand::VarintField(2, 1)) + hand::Fixed64(10, 3);
    ExpectDecodesAsProtobuf(bytes, rng_);
  }
}

TEST_F(StepWireCodecTest, DecoderMatchesProtobufOnHandMadeEncodings) {
  using namespace hand;
  const std::string data = RandomBytes(rng_, 64);
  const std::string q_a = VarintField(1, v1::DTYPE_BFLOAT16) + Len(2, Packed({1, 2})) +
                          Len(3, data) + Len(4, Len(1, "r1") + VarintField(2, 64));
  const std::string q_b = VarintField(2, 16) + VarintField(2, 8) + Len(4, VarintField(3, 32)) +
                          Len(3, data.substr(0, 16));
  const std::vector<std::string> good = {
      // Out of order, a tensor twice (merged; the later data wins), unpacked and packed shape.
      Len(3, q_a) + VarintField(2, 1) + Len(1, "s") + Len(3, q_b) + Len(4, q_a),
      // A tensor again without data: the earlier data stays.
      Len(5, q_b) + Len(5, VarintField(1, 2)),
      // Sub-messages twice: merged field by field.
      Len(8, VarintField(1, 3)) + Len(8, VarintField(2, 5)) + Len(8, VarintField(1, 4)),
      Len(20, Len(1, "a")) + Len(20, VarintField(2, 8)) + Len(21, VarintField(3, 4)) +
          Len(20, Len(1, "b")),
      // Scales packed and unpacked, mixed; an empty packed run.
      Len(22, PackedFloats({1.5f, -0.0f})) + Fixed32(22, 2.5f) + Len(22, "") +
          Fixed32(23, 0.25f) + Len(23, PackedFloats({3.0f})),
      // Scalars again: the last wins; softmax_scale and return_lse.
      Fixed32(6, 0.5f) + VarintField(7, 1) + Fixed32(6, -0.0f) + VarintField(7, 0) +
          VarintField(2, 3) + VarintField(2, 0),
      // Known numbers with other wire types are unknown fields (kept where they arrive).
      VarintField(1, 5) + Fixed32(2, 1.0f) + VarintField(3, 9) + Len(3, Fixed64(3, 1)) +
          Len(3, Fixed32(2, 4.0f)) + Len(6, "xy") + Fixed64(7, 1) + Len(8, Fixed32(1, 1.0f)),
      // Unknown fields of every wire type at every level; groups nested in groups.
      VarintField(99, 1) + Fixed64(100, 2) + Fixed32(101, 3.0f) + Len(102, "abc") +
          Group(103, VarintField(1, 1) + Group(2, Len(3, "x")) + Fixed32(4, 1.0f)) +
          Len(3, Group(50, Len(1, "y")) + VarintField(60, 1)) +
          Len(20, Group(9, "") + Len(7, "z")) + Len(8, Fixed64(9, 5)),
      // Field numbers at the top of the range; a 5-byte tag whose bits past 32 protobuf drops.
      VarintField((uint64_t{1} << 29) - 1, 4) + std::string("\x88\x80\x80\x80\x70\x05", 6),
      // 10-byte varints: negative int32s, a dtype outside the enum, bits past the 64th.
      VarintField(2, static_cast<uint64_t>(-7)) + Len(3, VarintField(1, 1ull << 40)) +
          Tag(7, 0) + std::string("\x80\x80\x80\x80\x80\x80\x80\x80\x80\x7e", 10),
      // Groups as deep as protobuf takes them in a lone step (100).
      NestedGroups(40, 100),
      // Empty.
      "",
  };
  const std::vector<std::string> bad = {
      Len(22, PackedFloats({1.0f}) + "x"),                     // packed floats, not 4-byte
      Len(3, Len(2, "\x80")),                                  // packed varint cut short
      Len(3, Len(2, std::string(11, '\x80') + "\x01")),        // packed varint over 10 bytes
      Tag(9, 3) + VarintField(1, 1) + Tag(8, 4),                // mismatched end of group
      Tag(9, 3) + VarintField(1, 1),                            // group without its end
      Tag(9, 4),                                                // end of a group not started
      Len(3, Tag(9, 4)),                                        // ... inside a tensor
      Tag(9, 6) + "\x01", Tag(9, 7) + "\x01",                   // wire types that do not exist
      std::string("\x00\x01", 2), std::string("\x02\x00", 2),   // field number 0
      std::string("\x88\x80\x80\x80\x80\x00\x05", 7),          // a 6-byte tag
      Tag(1, 2) + std::string("\x81\x80\x80\x80\x80\x00", 6) + "s",  // a 6-byte length
      Len(1, "\xc3\x28"),                                       // session_id not UTF-8
      Len(20, Len(1, "\xff")),                                  // region name not UTF-8
      Len(3, Len(4, Len(1, "\xed\xa0\x80"))),                   // surrogate, in q.region
      Len(3, VarintField(1, 1)).substr(0, 3),                   // tensor cut short
      Tag(6, 5) + "ab",                                         // fixed32 cut short
      Tag(99, 1) + "abcdefg",                                   // fixed64 cut short
      VarintField(2, 1) + std::string(10, '\xff') + "\x01",      // varint over 10 bytes
      NestedGroups(40, 101),                                    // groups past protobuf's limit
      Len(8, NestedGroups(40, 100)),                            // ... counted with the window
  };
  for (int round = 0; round < 20; ++round) {
    for (const std::string& s : good) {
      ASSERT_TRUE(v1::StepRequest().ParseFromString(s)) << "a good encoding protobuf refuses";
      ExpectDecodesAsProtobuf(s, rng_, false);
      ExpectDecodesAsProtobuf(Len(1, s) + Len(1, s), rng_);
    }
    for (const std::string& s : bad) {
      ASSERT_FALSE(v1::StepRequest().ParseFromString(s)) << "a bad encoding protobuf takes";
      ExpectDecodesAsProtobuf(s, rng_, false);
      ExpectDecodesAsProtobuf(Len(1, good[round % good.size()]) + Len(1, s), rng_);
    }
  }
  // In a batch, each step counts as one level: groups 99 deep inside a step pass, 100 do not.
  v1::BatchStepRequest b;
  EXPECT_TRUE(b.ParseFromString(Len(1, NestedGroups(40, 99))));
  EXPECT_FALSE(b.ParseFromString(Len(1, NestedGroups(40, 100))));
  ExpectDecodesAsProtobuf(Len(1, NestedGroups(40, 99)), rng_);
  ExpectDecodesAsProtobuf(Len(1, NestedGroups(40, 100)), rng_);
  // Unknown fields of the batch itself (groups too) are skipped.
  ExpectDecodesAsProtobuf(Group(2, Len(1, "x")) + Len(1, good[0]) + VarintField(1, 3), rng_);
}

TEST_F(StepWireCodecTest, DecoderErrorsNameTheFieldAndByte) {
  using namespace hand;
  const std::string step = Len(1, "s") + Len(3, VarintField(1, 3) + Len(2, "\x80"));
  std::vector<DecodedStepRequest> got;
  const std::string bytes = Len(1, Len(1, "t")) + Len(1, step);
  absl::Status st = DecodeBatchStepRequest(std::vector<std::string_view>{bytes}, &got);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  // q.shape's tag: after the first step (5 bytes), the second's tag and length (2), its
  // session_id (3), q's tag and length (2) and q.dtype (2).
  EXPECT_EQ(std::string(st.message()),
            "BatchStepRequest is malformed: steps[1].q.shape: truncated or over-long varint in a "
            "packed field (at byte 14 of the message)");
  DecodedStepRequest one;
  st = DecodeStepRequest(std::vector<std::string_view>{step}, &one);
  EXPECT_EQ(std::string(st.message()),
            "StepRequest is malformed: q.shape: truncated or over-long varint in a packed field "
            "(at byte 7 of the message)");
  DecodedStepRequest region;
  const std::string bad_region = Len(20, Len(1, "ok") + Len(1, "\xff"));
  st = DecodeStepRequest(std::vector<std::string_view>{bad_region}, &region);
  EXPECT_EQ(std::string(st.message()),
            "StepRequest is malformed: o_region.region: a string that is not valid UTF-8 (at "
            "byte 7 of the message)");  // o_region's tag is 2 bytes, its length 1, "ok" 4
  DecodedStepRequest unknown;
  const std::string bad_unknown = VarintField(2, 1) + Tag(77, 3) + VarintField(1, 1);
  st = DecodeStepRequest(std::vector<std::string_view>{bad_unknown}, &unknown);
  EXPECT_EQ(std::string(st.message()),
            "StepRequest is malformed: field 77: group without its end (at byte 2 of the "
            "message)");
}

TEST_F(StepWireCodecTest, ServerDecodesAnySplitAsProtobufDoes) {
  for (int i = 0; i < 100; ++i) {
    v1::StepRequest step = RandomStepRequest("replica-a.3", spec_, 1 + rng_() % 9, rng_);
    if (i % 4 == 0) step.mutable_o_region()->set_region("out");
    const std::string one = step.SerializeAsString();
    DecodedStepRequest decoded;
    ASSERT_TRUE(DecodeStepRequest(RandomSplit(one, rng_), &decoded).ok());
    std::string q(decoded.data.q.size, '\0');
    decoded.data.q.CopyTo(q.data());
    EXPECT_EQ(q, step.q().data());
    v1::BatchStepRequest batch;
    for (int j = 0; j < 1 + static_cast<int>(rng_() % 5); ++j) {
      *batch.add_steps() = RandomStepRequest("s", spec_, 1 + rng_() % 4, rng_);
    }
    std::string bytes = batch.SerializeAsString();
    // Messages protobuf merges: a step's tensor again (the later data wins, shapes append), an
    // unknown field, a second batch after the first.
    if (i % 3 == 0) bytes += batch.SerializeAsString();
    if (i % 5 == 0) bytes += std::string("\x48\x07", 2);  // field 9, varint: unknown
    ExpectDecodesAsProtobuf(bytes, rng_);
  }
}

TEST_F(StepWireCodecTest, TruncatedOrCorruptRequestsAreRefusedWhereProtobufRefusesThem) {
  v1::BatchStepRequest batch;
  for (int j = 0; j < 2; ++j) {
    v1::StepRequest* s = batch.add_steps();
    *s = RandomStepRequest("replica-a.9", spec_, 1, rng_);
    s->mutable_window()->set_left(3);
  }
  const std::string bytes = batch.SerializeAsString();
  for (size_t cut = 0; cut < bytes.size(); cut += 1 + cut / 64) {
    ExpectDecodesAsProtobuf(bytes.substr(0, cut), rng_);
  }
  for (int i = 0; i < 300; ++i) {
    std::string corrupt = bytes;
    corrupt[rng_() % 80] = static_cast<char>(rng_());
    ExpectDecodesAsProtobuf(corrupt, rng_);
  }
  // A session id that is not UTF-8: named.
  v1::StepRequest bad = RandomStepRequest("ok", spec_, 1, rng_);
  std::string step_bytes = bad.SerializeAsString();
  step_bytes += std::string("\x0a\x02\xc3\x28", 4);  // session_id = invalid UTF-8
  DecodedStepRequest decoded;
  const absl::Status st = DecodeStepRequest(RandomSplit(step_bytes, rng_), &decoded);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("StepRequest is malformed: session_id: a string that is not valid "
                             "UTF-8"),
            std::string::npos)
      << st;
  // A length past the end, inside k_new of the second step.
  const size_t at = bytes.size() - 20;
  std::vector<DecodedStepRequest> got;
  const absl::Status cut = DecodeBatchStepRequest(
      std::vector<std::string_view>{std::string_view(bytes).substr(0, at)}, &got);
  EXPECT_EQ(cut.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cut.message().find("BatchStepRequest is malformed: steps[1]"), std::string::npos)
      << cut;
}

TEST_F(StepWireCodecTest, ClientDecodesResponsesAsProtobufDoes) {
  for (int i = 0; i < 100; ++i) {
    const v1::StepResponse full = RandomStepResponse(rng_);
    const std::string bytes = full.SerializeAsString();
    grpc::ByteBuffer one = BufferOf(RandomSplit(bytes, rng_));
    auto got = client::StepResultFromWire(&one);
    ASSERT_TRUE(got.ok()) << got.status();
    auto want = client::ParseStepResponse(full);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(ResponseOf(*got).SerializeAsString(), ResponseOf(*want).SerializeAsString());

    v1::BatchStepResponse batch;
    for (int j = 0; j < static_cast<int>(rng_() % 6); ++j) {
      v1::StepResult* r = batch.add_results();
      if (rng_() % 3 == 0) {
        r->set_status_code(5);
        r->set_status_message("gone");
      } else {
        *r->mutable_response() = RandomStepResponse(rng_);
      }
    }
    const std::string batch_bytes = batch.SerializeAsString();
    grpc::ByteBuffer buffer = BufferOf(RandomSplit(batch_bytes, rng_));
    auto results = client::BatchStepResultsFromWire(&buffer, batch.results_size());
    ASSERT_TRUE(results.ok()) << results.status();
    for (int j = 0; j < batch.results_size(); ++j) {
      auto w = client::ParseStepResult(batch.results(j));
      const auto& g = (*results)[j];
      ASSERT_EQ(g.status(), w.status());
      if (w.ok()) EXPECT_EQ(ResponseOf(*g).SerializeAsString(), ResponseOf(*w).SerializeAsString());
    }
    // Cut short: refused as a whole, never half-read.
    if (batch_bytes.size() > 3) {
      grpc::ByteBuffer cut = BufferOf({std::string_view(batch_bytes).substr(0, batch_bytes.size() - 3)});
      auto bad = client::BatchStepResultsFromWire(&cut, batch.results_size());
      EXPECT_FALSE(bad.ok());
    }
  }
}

// ---- end to end ---------------------------------------------------------------------------

std::unique_ptr<client::Client> MakeClient(const std::string& target, bool wire_coding) {
  client::ClientOptions o;
  o.target = target;
  o.wire_coding = wire_coding;
  o.connections = 1;
  auto c = client::Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

class StepWireServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.kv_page_tokens = 1;
    o.kv_cache_bytes = int64_t{16} << 20;
    o.kv_shuffle_seed = FreshSeed();
    server_ = testing::StartLoopbackServer(o);
    ASSERT_NE(server_.server, nullptr);
    wire_ = MakeClient(server_.target, true);
    proto_ = MakeClient(server_.target, false);
  }
  std::string Create(client::Client& c) {
    client::SessionSpec s;
    s.num_layers = spec_.layers;
    s.num_kv_heads = spec_.kv_heads;
    s.head_dim = spec_.head_dim;
    s.dtype = client::DType::kBFloat16;
    auto info = client::CreateSession(c, s);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->session_id : "";
  }
  // Both codings' answers to one step, sent to a session of each (with equal caches), checked
  // equal byte for byte and against the reference.
  void ExpectSameAndCorrect(const v1::StepRequest& step, const client::StepResult& wire,
                            const client::StepResult& proto, SessionShadow& shadow) {
    const v1::StepResponse w = ResponseOf(wire), p = ResponseOf(proto);
    EXPECT_EQ(w.o().data(), p.o().data());
    EXPECT_EQ(w.lse().data(), p.lse().data());
    EXPECT_EQ(w.cached_tokens(), p.cached_tokens());
    EXPECT_EQ(w.cached_tokens(), shadow.Tokens(step.layer()));
    const auto e = shadow.Check(step, w);
    EXPECT_EQ(e.non_finite, 0);
    EXPECT_LE(e.o, testing::StepTolerance(spec_.dtype));
    EXPECT_LE(e.lse, 2e-5);
  }

  testing::LoopbackServer server_;
  std::unique_ptr<client::Client> wire_, proto_;
  SessionSpec spec_{3, 8, 2, 32, v1::DTYPE_BFLOAT16};
  std::mt19937_64 rng_{FreshSeed()};
};

TEST_F(StepWireServerTest, BothCodingsGiveTheSameCorrectAnswers) {
  const std::string a = Create(*wire_), b = Create(*proto_);
  SessionShadow shadow(spec_);
  for (int round = 0; round < 12; ++round) {
    if (round % 2 == 0) {
      const v1::StepRequest step = RandomStepRequest("", spec_, 1 + rng_() % 9, rng_);
      client::StepInput in = InputOf(step);
      in.session_id = a;
      auto w = client::Step(*wire_, in);
      in.session_id = b;
      auto p = client::Step(*proto_, in);
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE(p.ok()) << p.status();
      shadow.Append(step);
      ExpectSameAndCorrect(step, *w, *p, shadow);
      continue;
    }
    // A batch over every layer, one of them bad (its own status, the others computed).
    std::vector<v1::StepRequest> steps;
    std::vector<client::StepInput> wire_items, proto_items;
    for (int layer = 0; layer < spec_.layers; ++layer) {
      v1::StepRequest step = RandomStepRequest("", spec_, 1 + rng_() % 3, rng_);
      step.set_layer(layer);
      steps.push_back(step);
      wire_items.push_back(InputOf(step));
      wire_items.back().session_id = a;
      proto_items.push_back(InputOf(step));
      proto_items.back().session_id = b;
    }
    wire_items.push_back(wire_items.front());
    wire_items.back().layer = 99;
    proto_items.push_back(proto_items.front());
    proto_items.back().layer = 99;
    auto w = client::BatchStep(*wire_, wire_items);
    auto p = client::BatchStep(*proto_, proto_items);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(w->size(), wire_items.size());
    for (size_t i = 0; i < steps.size(); ++i) {
      ASSERT_TRUE((*w)[i].ok()) << (*w)[i].status();
      ASSERT_TRUE((*p)[i].ok()) << (*p)[i].status();
      shadow.Append(steps[i]);
      ExpectSameAndCorrect(steps[i], *(*w)[i], *(*p)[i], shadow);
    }
    for (const auto* r : {&w->back(), &p->back()}) {
      EXPECT_EQ(r->status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(r->status().message().find("layer 99 is out of range"), std::string::npos)
          << r->status();
    }
  }
}

TEST_F(StepWireServerTest, MalformedMessagesAreRefusedAndHarmNothing) {
  const std::string id = Create(*wire_);
  SessionShadow shadow(spec_);
  v1::StepRequest step = RandomStepRequest(id, spec_, 3, rng_);
  auto raw_call = [&](const char* method, const std::string& bytes) {
    grpc::Slice slice(bytes);
    const grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer reply;
    grpc::ClientContext ctx;
    const grpc::internal::RpcMethod m(method, grpc::internal::RpcMethod::NORMAL_RPC);
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        wire_->channel().get(), m, &ctx, request, &reply);
  };
  const std::string bytes = step.SerializeAsString();
  // Cut in the middle of q's data.
  grpc::Status st = raw_call(client::kStepMethod, bytes.substr(0, bytes.size() / 2));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("StepRequest is malformed: "), std::string::npos)
      << st.error_message();
  v1::BatchStepRequest batch;
  *batch.add_steps() = step;
  *batch.add_steps() = step;
  const std::string batch_bytes = batch.SerializeAsString();
  // Cut in the middle of the second step's q data.
  st = raw_call(client::kBatchStepMethod, batch_bytes.substr(0, batch_bytes.size() * 3 / 4));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("BatchStepRequest is malformed: steps[1]"), std::string::npos)
      << st.error_message();
  // Nothing was appended: the session's first step still finds an empty cache, and a good raw
  // message (protobuf's own bytes) is answered as the library's calls are.
  st = raw_call(client::kStepMethod, bytes);
  ASSERT_TRUE(st.ok()) << st.error_message();
  auto again = client::Step(*proto_, InputOf(step));
  ASSERT_TRUE(again.ok()) << again.status();
  shadow.Append(step);
  shadow.Append(step);
  EXPECT_EQ(again->cached_tokens, 6);
  EXPECT_EQ(again->cached_tokens, shadow.Tokens(step.layer()));
  const auto e = shadow.Check(step, ResponseOf(*again));
  EXPECT_LE(e.o, testing::StepTolerance(spec_.dtype));
}

// A BatchStep whose tensors pass half the client's largest message goes in several calls, in
// order, through either coding; a call that attnd refuses as a whole (over its own, smaller
// limit) fails its own items only, and the other calls' items are applied and right.
TEST(StepWireSplitTest, LargeBatchStepsGoInPartsAndARefusedPartFailsOnlyItsItems) {
  const SessionSpec spec{3, 8, 2, 32, v1::DTYPE_BFLOAT16};  // 768 bytes of tensors a token
  ServerOptions o;
  o.kv_page_tokens = 4;
  o.kv_cache_bytes = int64_t{16} << 20;
  o.max_message_bytes = 40 << 10;
  testing::LoopbackServer server = testing::StartLoopbackServer(o);
  ASSERT_NE(server.server, nullptr);
  std::mt19937_64 rng(FreshSeed());
  for (bool wire : {true, false}) {
    SCOPED_TRACE(wire ? "wire coding" : "protobuf coding");
    for (int client_limit : {64 << 10, 128 << 10}) {  // parts of <= 32 KiB, <= 64 KiB
      SCOPED_TRACE(::testing::Message() << "client limit " << client_limit);
      client::ClientOptions co;
      co.target = server.target;
      co.wire_coding = wire;
      co.max_message_bytes = client_limit;
      auto c = client::Client::Create(co);
      ASSERT_TRUE(c.ok()) << c.status();
      client::SessionSpec cs;
      cs.num_layers = spec.layers;
      cs.num_kv_heads = spec.kv_heads;
      cs.head_dim = spec.head_dim;
      cs.dtype = client::DType::kBFloat16;
      auto info = client::CreateSession(**c, cs);
      ASSERT_TRUE(info.ok()) << info.status();
      SessionShadow shadow(spec);
      // 30 tokens a layer (~23 KiB, 69 KiB together: more than either client sends at once).
      std::vector<v1::StepRequest> steps;
      std::vector<client::StepInput> items;
      for (int layer = 0; layer < spec.layers; ++layer) {
        steps.push_back(testing::RandomStep(info->session_id, layer, 30, spec, rng));
        items.push_back(InputOf(steps.back()));
      }
      auto results = client::BatchStep(**c, items);
      ASSERT_TRUE(results.ok()) << results.status();
      ASSERT_EQ(results->size(), items.size());
      // 64 KiB: three calls of one step, all applied. 128 KiB: layers 0 and 1 in one call of
      // ~46 KiB, which attnd refuses; layer 2 alone, applied.
      const size_t refused = client_limit == (64 << 10) ? 0 : 2;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i < refused) {
          EXPECT_EQ((*results)[i].status().code(), absl::StatusCode::kResourceExhausted)
              << (*results)[i].status();
          continue;
        }
        ASSERT_TRUE((*results)[i].ok()) << (*results)[i].status();
        shadow.Append(steps[i]);
        EXPECT_EQ((*results)[i]->cached_tokens, 30);
        const auto e = shadow.Check(steps[i], ResponseOf(*(*results)[i]));
        EXPECT_EQ(e.non_finite, 0);
        EXPECT_LE(e.o, testing::StepTolerance(spec.dtype));
      }
    }
  }
}

}  // namespace
}  // namespace attn
