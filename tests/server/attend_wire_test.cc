// The wire path's AttendRequest reader and AttendResponse writer against protobuf's own parser
// and serializer, on fresh random messages: what the reader makes of any bytes protobuf accepts
// must equal protobuf's message (tensor data as pieces of the input), however the bytes are split
// into slices, in whatever order their fields come, with unknown fields and unpacked repeated
// ints; bytes protobuf refuses get INVALID_ARGUMENT naming the field. The writer's bytes must be
// exactly protobuf's serialization of the full response.
#include <gtest/gtest.h>

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rpc/attend_request_decoder.h"
#include "rpc/response_encoder.h"
#include "attn/util/wire_reader.h"
#include "common/wire_test_util.h"

namespace attn {
namespace {

using attn::testing::AppendLen;
using attn::testing::AppendRandomUnknownField;
using attn::testing::AppendTag;
using attn::testing::AppendVarint;
using attn::testing::RandomBytes;
using attn::testing::RandomSplit;
using attn::testing::Split;

using google::protobuf::util::MessageDifferencer;

void FillTensor(std::mt19937_64& rng, v1::Tensor* t, size_t max_data) {
  std::uniform_int_distribution<int> coin(0, 1);
  t->set_dtype(static_cast<v1::DType>(rng() % 5));  // includes values with no name
  const int rank = static_cast<int>(rng() % 5);
  for (int i = 0; i < rank; ++i) t->add_shape(static_cast<int64_t>(rng() % 4096) - 8);
  if (coin(rng) || max_data == 0) {
    t->set_data(RandomBytes(rng, rng() % (max_data + 1)));
  }
  if (rng() % 4 == 0) {
    t->mutable_region()->set_region("r" + std::to_string(rng() % 100));
    t->mutable_region()->set_offset(rng());
    t->mutable_region()->set_bytes(rng() % 1000);
  }
}

// A random AttendRequest: every field present or not, data up to max_data bytes.
v1::AttendRequest RandomRequest(std::mt19937_64& rng, size_t max_data) {
  v1::AttendRequest r;
  if (rng() % 8) FillTensor(rng, r.mutable_q(), max_data);
  if (rng() % 8) FillTensor(rng, r.mutable_k(), max_data);
  if (rng() % 8) FillTensor(rng, r.mutable_v(), max_data);
  const int batch = static_cast<int>(rng() % 5);
  for (int i = 0; i < batch; ++i) {
    r.add_cu_seqlens_q(static_cast<int32_t>(rng()));
    r.add_cu_seqlens_k(static_cast<int32_t>(rng() % 1000));
  }
  r.set_causal(rng() % 2);
  if (rng() % 2) r.set_softmax_scale(std::uniform_real_distribution<float>(-2, 2)(rng));
  if (rng() % 2) {
    r.mutable_window()->set_left(static_cast<int32_t>(rng() % 64) - 2);
    r.mutable_window()->set_right(static_cast<int32_t>(rng() % 64) - 2);
  }
  r.set_return_lse(rng() % 2);
  r.set_priority(static_cast<v1::Priority>(rng() % 3));
  r.set_request_id(rng());
  if (rng() % 4 == 0) r.mutable_o_region()->set_region("o");
  if (rng() % 4 == 0) r.mutable_lse_region()->set_bytes(rng());
  return r;
}

// The decoded request with its data fields filled from their pieces: what protobuf would give.
v1::AttendRequest Reassemble(const DecodedAttendRequest& d) {
  v1::AttendRequest r = d.header;
  const std::pair<const WireBytes*, v1::Tensor*> tensors[] = {
      {&d.data.q, r.mutable_q()}, {&d.data.k, r.mutable_k()}, {&d.data.v, r.mutable_v()}};
  for (auto [bytes, t] : tensors) {
    std::string data(bytes->size, '\0');
    bytes->CopyTo(data.data());
    if (!data.empty()) t->set_data(data);
  }
  // mutable_q() above made q present; protobuf's message has it only if the bytes did.
  if (!d.header.has_q()) r.clear_q();
  if (!d.header.has_k()) r.clear_k();
  if (!d.header.has_v()) r.clear_v();
  return r;
}

// Equal messages (a NaN equal to a NaN); the differences are printed.
::testing::AssertionResult SameMessage(const google::protobuf::Message& a,
                                       const google::protobuf::Message& b) {
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  MessageDifferencer differ;
  differ.set_field_comparator(&comparator);
  std::string diff;
  differ.ReportDifferencesToString(&diff);
  if (differ.Compare(a, b)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << diff;
}

// Decodes bytes split as given and checks the result against protobuf's parse of them: both
// accept with equal messages, or both refuse (the reader with INVALID_ARGUMENT).
void ExpectAgreesWithProtobuf(const std::string& bytes,
                              const std::vector<std::string_view>& pieces,
                              const std::string& what) {
  v1::AttendRequest expected;
  const bool protobuf_ok = expected.ParseFromString(bytes);
  DecodedAttendRequest decoded;
  const absl::Status st = DecodeAttendRequest(pieces, &decoded);
  ASSERT_EQ(st.ok(), protobuf_ok) << what << ": " << st;
  if (!st.ok()) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(st.message().find("AttendRequest is malformed: "), std::string::npos) << st;
    return;
  }
  EXPECT_TRUE(decoded.header.q().data().empty() && decoded.header.k().data().empty() &&
              decoded.header.v().data().empty())
      << what << ": tensor data copied into the header";
  const v1::AttendRequest got = Reassemble(decoded);
  EXPECT_TRUE(SameMessage(expected, got)) << what;
}

TEST(AttendRequestDecoder, RandomMessagesRandomlySplitEqualProtobufsParse) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 2000; ++i) {
    const v1::AttendRequest r = RandomRequest(rng, i % 10 == 0 ? 70000 : 300);
    const std::string bytes = r.SerializeAsString();
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, RandomSplit(rng, bytes),
                                                     "message " + std::to_string(i)));
  }
}

TEST(AttendRequestDecoder, EverySplitPointOfSmallMessages) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 40; ++i) {
    const std::string bytes = RandomRequest(rng, 24).SerializeAsString();
    for (size_t cut = 0; cut <= bytes.size(); ++cut) {
      ASSERT_NO_FATAL_FAILURE(
          ExpectAgreesWithProtobuf(bytes, Split(bytes, {cut}), "cut at " + std::to_string(cut)));
      ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(
          bytes, Split(bytes, {cut, cut, std::min(cut + 1, bytes.size())}),
          "cuts at " + std::to_string(cut) + " with an empty piece"));
    }
    std::vector<size_t> every_byte(bytes.size());
    for (size_t c = 0; c < bytes.size(); ++c) every_byte[c] = c;
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, Split(bytes, every_byte), "1-byte pieces"));
  }
}

TEST(AttendRequestDecoder, EveryPrefixAgreesWithProtobuf) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 40; ++i) {
    const std::string bytes = RandomRequest(rng, 40).SerializeAsString();
    for (size_t n = 0; n <= bytes.size(); ++n) {
      const std::string prefix = bytes.substr(0, n);
      ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(prefix, RandomSplit(rng, prefix),
                                                       "prefix of " + std::to_string(n)));
    }
  }
}

TEST(AttendRequestDecoder, MutatedBytesThatProtobufAcceptsDecodeAlike) {
  google::protobuf::LogSilencer quiet;  // protobuf logs each string that is not UTF-8
  std::mt19937_64 rng(std::random_device{}());
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = RandomRequest(rng, 30).SerializeAsString();
    if (bytes.empty()) continue;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    v1::AttendRequest expected;
    const bool protobuf_ok = expected.ParseFromString(bytes);
    DecodedAttendRequest decoded;
    const absl::Status st = DecodeAttendRequest(RandomSplit(rng, bytes), &decoded);
    if (!st.ok()) {
      // The reader may refuse more than protobuf (tags over 5 bytes); never with another code.
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      ASSERT_FALSE(protobuf_ok) << "protobuf parsed what the reader refused: " << st;
      continue;
    }
    if (!protobuf_ok) continue;
    ++accepted;
    EXPECT_TRUE(SameMessage(expected, Reassemble(decoded)));
  }
  EXPECT_GT(accepted, 1000);  // enough mutated messages were valid to mean something
}

// Concatenated messages merge (protobuf's rule): fields in any order, repeated tensors and
// scalars, with a later data field replacing an earlier one.
TEST(AttendRequestDecoder, FieldsInAnyOrderAndRepeatedMerge) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 500; ++i) {
    std::vector<std::string> parts;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int p = 0; p < n; ++p) {
      v1::AttendRequest r = RandomRequest(rng, 100);
      // Keep a random subset of its fields.
      const auto* d = r.GetDescriptor();
      for (int f = 0; f < d->field_count(); ++f) {
        if (rng() % 2) r.GetReflection()->ClearField(&r, d->field(f));
      }
      parts.push_back(r.SerializeAsString());
    }
    std::shuffle(parts.begin(), parts.end(), rng);
    std::string bytes;
    for (const std::string& p : parts) bytes += p;
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, RandomSplit(rng, bytes), "merged"));
  }
}

// Unknown fields of every wire type (a group with nested fields too) at the top level and inside
// the tensors, between the known ones; repeated ints unpacked.
TEST(AttendRequestDecoder, UnknownFieldsAndUnpackedRepeatedInts) {
  std::mt19937_64 rng(std::random_device{}());
  const auto unknown = [&](std::string* out) { AppendRandomUnknownField(rng, out); };
  for (int i = 0; i < 500; ++i) {
    std::string bytes;
    unknown(&bytes);
    for (int t = 1; t <= 3; ++t) {
      std::string tensor;
      unknown(&tensor);
      AppendTag(1, 0, &tensor);
      AppendVarint(rng() % 4, &tensor);
      for (int s = 0; s < 3; ++s) {  // shape unpacked
        AppendTag(2, 0, &tensor);
        AppendVarint(rng() % 300, &tensor);
      }
      unknown(&tensor);
      AppendLen(3, RandomBytes(rng, rng() % 200), &tensor);
      unknown(&tensor);
      AppendLen(t, tensor, &bytes);
      unknown(&bytes);
    }
    for (int s = 0; s < 3; ++s) {  // cu_seqlens_q unpacked, cu_seqlens_k packed
      AppendTag(4, 0, &bytes);
      AppendVarint(static_cast<uint64_t>(static_cast<int64_t>(rng() % 100) - 5), &bytes);
    }
    std::string packed;
    for (int s = 0; s < 3; ++s) AppendVarint(rng() % 100, &packed);
    AppendLen(5, packed, &bytes);
    unknown(&bytes);
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, RandomSplit(rng, bytes), "unknowns"));
    DecodedAttendRequest d;
    ASSERT_TRUE(DecodeAttendRequest(std::vector<std::string_view>{bytes}, &d).ok());
    EXPECT_EQ(d.header.cu_seqlens_q_size(), 3);
    EXPECT_EQ(d.header.q().shape_size(), 3);
  }
}

absl::Status DecodeBytes(const std::string& bytes) {
  DecodedAttendRequest d;
  return DecodeAttendRequest(std::vector<std::string_view>{bytes}, &d);
}

void ExpectMalformed(const std::string& bytes, const std::string& part) {
  const absl::Status st = DecodeBytes(bytes);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(part), std::string::npos) << "message: " << st.message()
                                                        << "\nwanted: " << part;
  v1::AttendRequest r;
  EXPECT_FALSE(r.ParseFromString(bytes)) << "protobuf accepts these bytes";
}

TEST(AttendRequestDecoder, BadInputsNameTheField) {
  std::string q_body;
  AppendTag(3, 2, &q_body);
  AppendVarint(100, &q_body);  // data claims 100 bytes, 5 follow
  q_body += "abcde";
  std::string bytes;
  AppendLen(1, q_body, &bytes);
  ExpectMalformed(bytes, "q.data: length 100 runs past the end of q");

  bytes.clear();
  std::string k_body;
  AppendTag(3, 2, &k_body);
  AppendVarint(~uint64_t{0}, &k_body);  // the largest length: must not overflow a position
  AppendLen(2, k_body, &bytes);
  ExpectMalformed(bytes, "k.data: length 18446744073709551615 runs past the end of k");

  bytes.clear();
  AppendTag(3, 2, &bytes);
  AppendVarint(1000, &bytes);
  bytes += "short";
  ExpectMalformed(bytes, "v: length 1000 runs past the end of the message");

  ExpectMalformed(std::string(11, '\x80') + '\x01',
                  "AttendRequest: truncated or over-long field tag");
  ExpectMalformed(std::string("\x30\x80\x80", 3), "causal: truncated or over-long varint");
  ExpectMalformed(std::string("\x00\x01", 2), "field number 0 out of range");
  ExpectMalformed(std::string("\x0f\x01", 2), "unknown wire type 7");
  ExpectMalformed(std::string("\x4c", 1), "return_lse: end of a group that was not started");
  ExpectMalformed(std::string("\xc3\x0c", 2), "field 200: group without its end");
  ExpectMalformed(std::string("\x3d\x01\x02", 3), "softmax_scale: truncated 4-byte value");
  ExpectMalformed(std::string(200, '\x0b'), "groups nested too deeply");

  bytes.clear();
  std::string slice;
  AppendLen(1, "\xff\xfe", &slice);  // RegionSlice.region: not UTF-8
  AppendLen(12, slice, &bytes);
  ExpectMalformed(bytes, "o_region: protobuf could not parse this field");

  bytes.clear();
  q_body.clear();
  AppendTag(2, 2, &q_body);
  AppendVarint(5, &q_body);
  q_body += "\x01\x02";
  AppendLen(1, q_body, &bytes);
  ExpectMalformed(bytes, "q.shape: length 5 runs past the end of its message");
}

TEST(WireReader, ReadsAcrossPiecesAndStopsAtItsLimit) {
  const std::string bytes = "\xac\x02" "abcdef";
  const std::vector<std::string_view> pieces = Split(bytes, {1, 1, 3, 5});
  WireReader r(pieces);
  uint64_t v = 0, outer = 0;
  ASSERT_TRUE(r.ReadVarint(&v));
  EXPECT_EQ(v, 300u);
  ASSERT_TRUE(r.PushLimit(4, &outer));
  std::vector<std::string_view> got;
  EXPECT_FALSE(r.ReadPieces(5, &got));  // past the limit: nothing read
  ASSERT_TRUE(r.ReadPieces(4, &got));
  std::string joined;
  for (std::string_view p : got) joined += p;
  EXPECT_EQ(joined, "abcd");
  EXPECT_GT(got.size(), 1u);  // the bytes were not gathered into one piece
  EXPECT_TRUE(r.AtLimit());
  r.PopLimit(outer);
  EXPECT_EQ(r.remaining(), 2u);
  EXPECT_FALSE(r.PushLimit(3, &outer));
}

// A random AttendResponse with o and lse data of the given sizes.
v1::AttendResponse RandomResponse(std::mt19937_64& rng, size_t o_bytes, size_t lse_bytes) {
  v1::AttendResponse r;
  v1::Tensor* o = r.mutable_o();
  o->set_dtype(static_cast<v1::DType>(1 + rng() % 3));
  for (int i = 0; i < 3; ++i) o->add_shape(1 + static_cast<int64_t>(rng() % 100000));
  o->set_data(RandomBytes(rng, o_bytes));
  if (lse_bytes > 0 || rng() % 2) {
    r.mutable_lse()->set_dtype(v1::DTYPE_FLOAT32);
    r.mutable_lse()->add_shape(static_cast<int64_t>(rng() % 64));
    r.mutable_lse()->add_shape(static_cast<int64_t>(rng() % 5000));
    r.mutable_lse()->set_data(RandomBytes(rng, lse_bytes));
  }
  r.mutable_timing()->set_queue_us(std::uniform_real_distribution<double>(0, 1e4)(rng));
  r.mutable_timing()->set_batch_requests(static_cast<int32_t>(rng() % 64));
  r.mutable_timing()->set_host_copy_us(rng() % 1000);
  r.set_request_id(rng());
  return r;
}

OutputBytes CopyOf(const std::string& s) {
  OutputBytes b = OutputBytes::Allocate(s.size());
  std::memcpy(b.data, s.data(), s.size());
  return b;
}

std::string Flatten(const grpc::ByteBuffer& buffer, size_t* slices) {
  std::vector<grpc::Slice> parts;
  EXPECT_TRUE(buffer.Dump(&parts).ok());
  *slices = parts.size();
  std::string out;
  for (const grpc::Slice& s : parts) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

TEST(AttendResponseEncoder, BytesEqualProtobufsSerialization) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 300; ++i) {
    // At least one byte of o: the slice count below is about o's bytes going out on their own.
    const size_t o_bytes = i % 50 == 0 ? (size_t{1} << 20) + rng() % 1000 : 1 + rng() % 3000;
    const size_t lse_bytes = rng() % 3 == 0 ? 0 : rng() % 3000;
    const v1::AttendResponse full = RandomResponse(rng, o_bytes, lse_bytes);
    v1::AttendResponse header = full;
    header.mutable_o()->clear_data();
    OutputBytes lse;
    if (header.has_lse()) {
      header.mutable_lse()->clear_data();
      lse = CopyOf(full.lse().data());
    }
    size_t slices = 0;
    const std::string got =
        Flatten(EncodeAttendResponse(header, CopyOf(full.o().data()), std::move(lse)), &slices);
    ASSERT_TRUE(got == full.SerializeAsString()) << "response " << i << " differs";
    // o's bytes went in as a slice of their own, not copied into a header slice.
    EXPECT_GE(slices, 3u);
    v1::AttendResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(got));
    EXPECT_TRUE(SameMessage(parsed, full));
  }
}

TEST(AttendResponseEncoder, TensorsWithoutBuffersAreSerializedAsTheyAre) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 100; ++i) {
    v1::AttendResponse r = RandomResponse(rng, rng() % 100, 0);
    if (i % 2) {  // o in a region: no data in the message
      r.mutable_o()->clear_data();
      r.mutable_o()->mutable_region()->set_region("out");
      r.mutable_o()->mutable_region()->set_bytes(rng());
    }
    if (i % 3 == 0) r.clear_o();
    r.set_status_code(static_cast<int32_t>(rng() % 17));
    r.set_status_message(RandomBytes(rng, 0) + "item " + std::to_string(i));
    size_t slices = 0;
    EXPECT_TRUE(Flatten(EncodeAttendResponse(r, OutputBytes(), OutputBytes()), &slices) ==
                r.SerializeAsString())
        << "response " << i << " differs";
  }
}

}  // namespace
}  // namespace attn
