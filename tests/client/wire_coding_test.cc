// The client library's wire coding (attn/client/wire_coding.h) against protobuf's own serializer
// and parser, on fresh random inputs, with no server: the request bytes it writes must be exactly
// the generated serializer's bytes of Client::BuildAttendRequest's message (every field that sets,
// with lse, varlen, window and priority), with each tensor's data a slice over the caller's memory;
// what it reads from a response, however it is split into slices, in whatever order its fields
// come, with unknown fields and unpacked shapes, must equal protobuf's parse followed by
// Client::ParseAttendResponse; malformed bytes give INTERNAL naming the field, never a crash.
#include <gtest/gtest.h>

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attn/client/client.h"
#include "attn/client/wire_coding.h"
#include "common/wire_test_util.h"

namespace attn::client {
namespace {

using attn::testing::AppendLen;
using attn::testing::AppendRandomUnknownField;
using attn::testing::AppendTag;
using attn::testing::AppendVarint;
using attn::testing::Flatten;
using attn::testing::RandomBytes;
using attn::testing::RandomCuts;
using attn::testing::RandomSplit;
using attn::testing::SeededRng;
using attn::testing::Split;

using google::protobuf::util::MessageDifferencer;

// A tensor of random dtype and rank; its data matches the shape unless `any_size`.
Tensor RandomTensor(std::mt19937_64& rng, size_t max_elements, bool any_size = false) {
  Tensor t;
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3};
  t.dtype = dtypes[rng() % 4];
  const int rank = static_cast<int>(rng() % 4);
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    const int64_t left = static_cast<int64_t>(max_elements) / std::max<int64_t>(elements, 1);
    const int64_t s = static_cast<int64_t>(rng() % (std::min<int64_t>(left, 64) + 1));
    t.shape.push_back(s);
    elements *= s;
  }
  if (rng() % 8 == 0) t.shape.clear(), elements = 1;  // a scalar
  const size_t bytes = any_size ? rng() % (max_elements * 4 + 1)
                                : static_cast<size_t>(elements) * DTypeBytes(t.dtype);
  t.data = RandomBytes(rng, bytes);
  return t;
}

AttendOptions RandomOptions(std::mt19937_64& rng) {
  AttendOptions o;
  if (rng() % 2) {
    const int n = static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      // Any int32, negatives too (sign-extended on the wire).
      o.cu_seqlens_q.push_back(static_cast<int32_t>(rng()));
      o.cu_seqlens_k.push_back(static_cast<int32_t>(rng() % 3 ? rng() % 5000 : rng()));
    }
    if (rng() % 4 == 0) o.cu_seqlens_k.clear();
  }
  o.causal = rng() % 2;
  switch (rng() % 5) {
    case 0: o.softmax_scale = 0.0f; break;
    case 1: o.softmax_scale = -0.0f; break;
    case 2: o.softmax_scale = std::numeric_limits<float>::quiet_NaN(); break;
    default: o.softmax_scale = std::uniform_real_distribution<float>(-4, 4)(rng); break;
  }
  const int32_t sides[] = {-1, 0, 1, 7, 4096, -5, std::numeric_limits<int32_t>::max()};
  o.window_left = sides[rng() % std::size(sides)];
  o.window_right = sides[rng() % std::size(sides)];
  o.return_lse = rng() % 2;
  o.high_priority = rng() % 2;
  if (rng() % 3 == 0) {  // FP8 descales and output type (any values: the server judges them)
    for (auto* list : {&o.q_descale, &o.k_descale, &o.v_descale}) {
      const int n = static_cast<int>(rng() % 4);
      for (int i = 0; i < n; ++i) list->push_back(std::uniform_real_distribution<float>(-2, 2)(rng));
    }
    if (rng() % 2) o.o_dtype = rng() % 2 ? DType::kFloat16 : DType::kBFloat16;
  }
  return o;
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

TEST(WireCoding, MethodNamesAreTheServices) {
  const auto* service =
      v1::AttendRequest::descriptor()->file()->FindServiceByName("Attention");
  ASSERT_NE(service, nullptr);
  EXPECT_EQ(kAttendMethod, "/" + service->full_name() + "/" +
                               service->FindMethodByName("Attend")->name());
  EXPECT_EQ(kEchoMethod, "/" + service->full_name() + "/" +
                             service->FindMethodByName("Echo")->name());
}

// ---- Requests ---------------------------------------------------------------------------------

TEST(AttendRequestEncoder, BytesAreProtobufsSerializationOfBuildAttendRequest) {
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 3000; ++i) {
    // Some tensors empty (no data field), data not matching the shape (the encoder does not
    // judge; the server does), large ones now and then.
    const size_t max = i % 50 == 0 ? 200000 : 300;
    const Tensor q = RandomTensor(rng, max, rng() % 8 == 0);
    const Tensor k = RandomTensor(rng, max, rng() % 8 == 0);
    const Tensor v = RandomTensor(rng, max, rng() % 8 == 0);
    const AttendOptions o = RandomOptions(rng);
    const uint64_t request_id = rng() % 2 ? rng() : 0;
    v1::AttendRequest expected = Client::BuildAttendRequest(q, k, v, o);
    expected.set_request_id(request_id);

    BorrowedSlices borrowed;
    std::string bytes;
    {
      const grpc::ByteBuffer buffer = EncodeAttendRequest(q, k, v, o, &borrowed, request_id);
      bytes = Flatten(buffer);
      // Each tensor's data is a slice over the caller's string, not a copy.
      std::vector<grpc::Slice> slices;
      ASSERT_TRUE(buffer.Dump(&slices).ok());
      for (const Tensor* t : {&q, &k, &v}) {
        if (t->data.empty()) continue;
        EXPECT_TRUE(std::any_of(slices.begin(), slices.end(), [t](const grpc::Slice& s) {
          return reinterpret_cast<const char*>(s.begin()) == t->data.data() &&
                 s.size() == t->data.size();
        })) << "request " << i << ": a tensor's data was copied";
      }
      const int64_t spliced = !q.data.empty() + !k.data.empty() + !v.data.empty();
      EXPECT_EQ(borrowed.outstanding(), spliced);
    }
    EXPECT_EQ(borrowed.outstanding(), 0) << "the buffer is gone: nothing may stay borrowed";
    ASSERT_EQ(bytes, expected.SerializeAsString()) << "request " << i;
    v1::AttendRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes)) << "request " << i;
    EXPECT_TRUE(SameMessage(parsed, expected)) << "request " << i;
  }
}

TEST(EchoRequestEncoder, BytesAreProtobufsSerialization) {
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 500; ++i) {
    const std::string payload = RandomBytes(rng, rng() % 4 == 0 ? 0 : rng() % 5000);
    const int64_t back[] = {0, -1, 1, static_cast<int64_t>(rng()), std::numeric_limits<int64_t>::min()};
    const int64_t response_bytes = back[rng() % std::size(back)];
    v1::EchoRequest expected;
    expected.set_payload(payload);
    expected.set_response_bytes(response_bytes);
    BorrowedSlices borrowed;
    const std::string bytes = Flatten(EncodeEchoRequest(payload, response_bytes, &borrowed));
    ASSERT_EQ(bytes, expected.SerializeAsString()) << i;
  }
}

// A copy of the buffer held elsewhere (as gRPC may hold a sent message's slices) keeps Wait
// waiting until it is dropped.
TEST(BorrowedSlices, WaitReturnsOnceEveryHolderHasLetGo) {
  const std::string data(1000, 'x');
  BorrowedSlices borrowed;
  std::promise<void> copied;
  std::atomic<bool> dropped{false};
  std::thread holder;
  {
    grpc::ByteBuffer buffer = EncodeEchoRequest(data, 0, &borrowed);
    holder = std::thread([copy = grpc::ByteBuffer(buffer), &copied, &dropped]() mutable {
      copied.set_value();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      dropped = true;
      copy.Clear();
    });
    copied.get_future().wait();
  }
  borrowed.Wait();
  EXPECT_TRUE(dropped.load());
  EXPECT_EQ(borrowed.outstanding(), 0);
  holder.join();
}

// ---- Responses --------------------------------------------------------------------------------

void SetTensor(std::mt19937_64& rng, v1::Tensor* out, bool any_size) {
  const Tensor t = RandomTensor(rng, 400, any_size);
  ToWireTensor(t, out);
  if (rng() % 16 == 0) out->set_dtype(static_cast<v1::DType>(rng() % 6));  // unknown ones too
}

// A random AttendResponse; `valid` keeps o and lse consistent with their shapes.
v1::AttendResponse RandomResponse(std::mt19937_64& rng, bool valid) {
  v1::AttendResponse r;
  if (!valid || rng() % 16) SetTensor(rng, r.mutable_o(), !valid && rng() % 2);
  if (rng() % 2) SetTensor(rng, r.mutable_lse(), !valid && rng() % 2);
  if (rng() % 2) {
    v1::ServerTiming* t = r.mutable_timing();
    t->set_queue_us(std::uniform_real_distribution<double>(0, 1e6)(rng));
    t->set_compute_us(rng() % 1000);
    t->set_batch_requests(static_cast<int32_t>(rng() % 64));
    t->set_batch_tokens(static_cast<int64_t>(rng()));
  }
  if (rng() % 2) r.set_request_id(rng());
  if (rng() % 4 == 0) r.set_status_code(static_cast<int32_t>(rng() % 17));
  if (rng() % 4 == 0) r.set_status_message("item " + std::to_string(rng() % 1000));
  return r;
}

// What the protobuf coding makes of bytes: parse, then Client::ParseAttendResponse. (A parse
// failure is INTERNAL, as gRPC reports a response it cannot parse.)
absl::StatusOr<AttendResult> ThroughProtobuf(const std::string& bytes) {
  v1::AttendResponse message;
  if (!message.ParseFromString(bytes)) return absl::InternalError("protobuf cannot parse it");
  return Client::ParseAttendResponse(message);
}

// A result left from an earlier call, to decode into: the decoder must overwrite all of it.
AttendResult Poisoned() {
  static std::mt19937_64 rng(1);
  AttendResult r;
  r.o = RandomTensor(rng, 1000, true);
  std::fill(r.o.data.begin(), r.o.data.end(), '\xEE');
  if (rng() % 2) r.lse = RandomTensor(rng, 50, true);
  r.timing.set_queue_us(-1);
  r.timing.set_batch_requests(-1);
  return r;
}

::testing::AssertionResult SameTensor(const Tensor& a, const Tensor& b);

// Decodes into a poisoned result; on an error it must be left as it was.
absl::StatusOr<AttendResult> ThroughWire(const std::vector<std::string_view>& pieces) {
  DecodedAttendResponse decoded;
  if (absl::Status st = DecodeAttendResponse(pieces, &decoded); !st.ok()) return st;
  const AttendResult before = Poisoned();
  AttendResult result = before;
  if (absl::Status st = ReadAttendResult(decoded, &result); !st.ok()) {
    EXPECT_TRUE(SameTensor(result.o, before.o)) << "a failed read changed o";
    EXPECT_EQ(result.lse.has_value(), before.lse.has_value()) << "a failed read changed lse";
    return st;
  }
  return result;
}

::testing::AssertionResult SameTensor(const Tensor& a, const Tensor& b) {
  if (a.dtype != b.dtype) return ::testing::AssertionFailure() << "dtypes differ";
  if (a.shape != b.shape) return ::testing::AssertionFailure() << "shapes differ";
  if (a.data != b.data) return ::testing::AssertionFailure() << "data differ";
  return ::testing::AssertionSuccess();
}

// The wire decoding of bytes (split into pieces) against the protobuf coding's: both fail, or
// both succeed with equal results. After decoding, the input is overwritten: the result must be
// a copy, not a view of it.
void ExpectAgreesWithProtobuf(std::string bytes, std::vector<size_t> cuts, const std::string& what) {
  const absl::StatusOr<AttendResult> expected = ThroughProtobuf(bytes);
  absl::StatusOr<AttendResult> got = ThroughWire(Split(bytes, std::move(cuts)));
  std::fill(bytes.begin(), bytes.end(), '\xA5');  // poison the input
  ASSERT_EQ(got.ok(), expected.ok()) << what << ": wire " << got.status() << ", protobuf "
                                     << expected.status();
  if (!got.ok()) {
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << what << ": " << got.status();
    return;
  }
  EXPECT_TRUE(SameTensor(got->o, expected->o)) << what << ": o";
  ASSERT_EQ(got->lse.has_value(), expected->lse.has_value()) << what;
  if (got->lse) EXPECT_TRUE(SameTensor(*got->lse, *expected->lse)) << what << ": lse";
  EXPECT_TRUE(SameMessage(got->timing, expected->timing)) << what;
}

TEST(AttendResponseDecoder, RandomResponsesRandomlySplitEqualTheProtobufCoding) {
  std::mt19937_64 rng = SeededRng();
  int ok = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::string bytes = RandomResponse(rng, i % 2 == 0).SerializeAsString();
    ASSERT_NO_FATAL_FAILURE(
        ExpectAgreesWithProtobuf(bytes, RandomCuts(rng, bytes.size()), "response " + std::to_string(i)));
    ok += ThroughProtobuf(bytes).ok();
  }
  EXPECT_GT(ok, 1000);  // enough of them were good answers to mean something
}

TEST(AttendResponseDecoder, EverySplitPointAndEveryPrefix) {
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 30; ++i) {
    const std::string bytes = RandomResponse(rng, true).SerializeAsString();
    for (size_t cut = 0; cut <= bytes.size(); ++cut) {
      ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, {cut}, "cut " + std::to_string(cut)));
      ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes.substr(0, cut),
                                                       RandomCuts(rng, cut),
                                                       "prefix " + std::to_string(cut)));
    }
  }
}

TEST(AttendResponseDecoder, MutatedBytesNeverCrashAndAgreeWhereProtobufAccepts) {
  google::protobuf::LogSilencer quiet;  // protobuf logs each string that is not UTF-8
  std::mt19937_64 rng = SeededRng();
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = RandomResponse(rng, true).SerializeAsString();
    if (bytes.empty()) continue;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    const absl::StatusOr<AttendResult> expected = ThroughProtobuf(bytes);
    const absl::StatusOr<AttendResult> got = ThroughWire(RandomSplit(rng, bytes));
    if (!got.ok()) {
      // The reader may refuse more than protobuf (tags over 5 bytes); never with another code.
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
      v1::AttendResponse parsed;
      if (parsed.ParseFromString(bytes)) {
        EXPECT_FALSE(expected.ok()) << "the protobuf coding accepted what the reader refused: "
                                    << got.status();
      }
      continue;
    }
    if (!expected.ok()) continue;
    ++accepted;
    EXPECT_TRUE(SameTensor(got->o, expected->o));
  }
  EXPECT_GT(accepted, 1000);
}

// Concatenated messages merge (protobuf's rule): fields in any order, repeated tensors and
// scalars, a later data field replacing an earlier one, shapes appended.
TEST(AttendResponseDecoder, FieldsInAnyOrderAndRepeatedMerge) {
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 1000; ++i) {
    std::vector<std::string> parts;
    const int n = 1 + static_cast<int>(rng() % 5);
    for (int p = 0; p < n; ++p) {
      v1::AttendResponse r = RandomResponse(rng, true);
      const auto* d = r.GetDescriptor();
      for (int f = 0; f < d->field_count(); ++f) {
        if (rng() % 2) r.GetReflection()->ClearField(&r, d->field(f));
      }
      parts.push_back(r.SerializeAsString());
    }
    std::shuffle(parts.begin(), parts.end(), rng);
    std::string bytes;
    for (const std::string& p : parts) bytes += p;
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, RandomCuts(rng, bytes.size()), "merged"));
  }
}

// Unknown fields of every wire type (a group with nested fields too) at the top level and inside
// the tensors, between the known ones; shapes unpacked; o sent as two occurrences.
TEST(AttendResponseDecoder, UnknownFieldsUnpackedShapesAndSplitTensors) {
  std::mt19937_64 rng = SeededRng();
  const auto unknown = [&](std::string* out) { AppendRandomUnknownField(rng, out); };
  for (int i = 0; i < 500; ++i) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 40), cols = 1 + rng() % 8;
    std::string bytes;
    unknown(&bytes);
    // o, in two parts: the first with its dtype, shape (unpacked) and data that the second
    // replaces.
    std::string first, second;
    AppendTag(1, 0, &first);
    AppendVarint(v1::DTYPE_BFLOAT16, &first);
    unknown(&first);
    AppendTag(2, 0, &first);
    AppendVarint(rows, &first);
    AppendLen(3, RandomBytes(rng, rng() % 100), &first);
    AppendTag(2, 0, &second);
    AppendVarint(cols, &second);
    unknown(&second);
    const std::string data = RandomBytes(rng, rows * cols * 2);
    AppendLen(3, data, &second);
    unknown(&second);
    AppendLen(1, first, &bytes);
    unknown(&bytes);
    AppendLen(1, second, &bytes);
    unknown(&bytes);
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(bytes, RandomCuts(rng, bytes.size()), "unknowns"));
    const absl::StatusOr<AttendResult> r = ThroughWire({bytes});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->o.shape, (std::vector<int64_t>{rows, cols}));
    EXPECT_EQ(r->o.data, data);
  }
}

void ExpectMalformed(const std::string& bytes, const std::string& part) {
  const absl::StatusOr<AttendResult> r = ThroughWire({bytes});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_NE(r.status().message().find(part), std::string::npos)
      << "message: " << r.status().message() << "\nwanted: " << part;
  EXPECT_FALSE(ThroughProtobuf(bytes).ok()) << "the protobuf coding accepts these bytes";
}

// o as a whole: dtype bf16, the given shape, data of `data_bytes` bytes (claimed by its length).
std::string OField(const std::vector<int64_t>& shape, const std::string& data, int dtype = 3) {
  std::string body;
  AppendTag(1, 0, &body);
  AppendVarint(dtype, &body);
  std::string packed;
  for (int64_t s : shape) AppendVarint(static_cast<uint64_t>(s), &packed);
  if (!shape.empty()) AppendLen(2, packed, &body);
  AppendLen(3, data, &body);
  std::string out;
  AppendLen(1, body, &out);
  return out;
}

TEST(AttendResponseDecoder, MalformedResponsesGetAClearStatus) {
  std::string o_body;
  AppendTag(3, 2, &o_body);
  AppendVarint(100, &o_body);  // data claims 100 bytes, 5 follow
  o_body += "abcde";
  std::string bytes;
  AppendLen(1, o_body, &bytes);
  ExpectMalformed(bytes, "AttendResponse is malformed: o.data: length 100 runs past the end");

  std::string huge;  // the largest length: must not overflow a position
  AppendTag(3, 2, &huge);
  AppendVarint(~uint64_t{0}, &huge);
  bytes.clear();
  AppendLen(2, huge, &bytes);
  ExpectMalformed(bytes, "lse.data: length 18446744073709551615 runs past the end");

  bytes = OField({2}, "abcd");
  bytes.pop_back();  // o's own length now runs past the message
  ExpectMalformed(bytes, "o: length");

  bytes = OField({2}, "abcd");
  bytes.push_back(static_cast<char>(0x1f));  // field 3, wire type 7
  ExpectMalformed(bytes, "unknown wire type 7");

  bytes = OField({2}, "abcd");
  AppendTag(20, 3, &bytes);  // a group that never ends
  AppendTag(1, 0, &bytes);
  AppendVarint(5, &bytes);
  ExpectMalformed(bytes, "field 20: group without its end");

  bytes = OField({2}, "abcd");
  bytes += "\x80\x80\x80";  // a tag cut short
  ExpectMalformed(bytes, "truncated or over-long field tag");

  bytes = OField({2}, "abcd");
  std::string timing;
  AppendTag(1, 1, &timing);
  timing += "abc";  // queue_us: 3 of its 8 bytes
  AppendLen(3, timing, &bytes);
  ExpectMalformed(bytes, "timing: protobuf could not parse this field");

  bytes = OField({2}, "abcd");
  AppendLen(6, "\xff\xfe", &bytes);  // status_message that is not UTF-8
  {
    google::protobuf::LogSilencer quiet;
    ExpectMalformed(bytes, "status_message: protobuf could not parse");
  }
}

// Responses protobuf parses but that are not a usable answer: the same status from both codings.
TEST(AttendResponseDecoder, ImpossibleTensorsAreRefused) {
  const auto expect = [](const std::string& bytes, const std::string& part) {
    const absl::StatusOr<AttendResult> r = ThroughWire({bytes});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status();
  };
  expect("", "has no o");
  expect(OField({2, 3}, "abcd"), "the server sent 4 bytes of o where its shape [2, 3] and dtype need 12");
  expect(OField({2}, "abcd", 9), "unknown dtype 9");
  expect(OField({-2, -2}, ""), "impossible shape [-2, -2]");
  expect(OField({int64_t{1} << 40, int64_t{1} << 40}, ""), "impossible shape");
  std::string with_region = OField({2}, "abcd");
  std::string region_body;
  AppendLen(1, "o-region", &region_body);
  std::string region;
  AppendLen(4, region_body, &region);
  AppendLen(1, region, &with_region);
  expect(with_region, "into region 'o-region'");
  // lse, as o.
  std::string lse = OField({2}, "abcd");
  std::string lse_body;
  AppendTag(1, 0, &lse_body);
  AppendVarint(v1::DTYPE_FLOAT32, &lse_body);
  AppendLen(3, "xyz", &lse_body);
  AppendLen(2, lse_body, &lse);
  expect(lse, "3 bytes of lse");
}

TEST(AttendResponseDecoder, EmptyTensors) {
  v1::AttendResponse r;
  r.mutable_o()->set_dtype(v1::DTYPE_FLOAT16);
  r.mutable_o()->add_shape(0);
  r.mutable_o()->add_shape(16);
  r.mutable_lse()->set_dtype(v1::DTYPE_FLOAT32);
  r.mutable_lse()->add_shape(16);
  r.mutable_lse()->add_shape(0);
  const absl::StatusOr<AttendResult> got = ThroughWire({r.SerializeAsString()});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->o.shape, (std::vector<int64_t>{0, 16}));
  EXPECT_TRUE(got->o.data.empty());
  ASSERT_TRUE(got->lse.has_value());
  EXPECT_EQ(got->lse->shape, (std::vector<int64_t>{16, 0}));
  EXPECT_TRUE(got->lse->data.empty());
  // No shape is a scalar, which holds one element: without data both codings refuse it.
  r.mutable_lse()->clear_shape();
  ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(r.SerializeAsString(), {}, "scalar lse"));
  EXPECT_FALSE(ThroughWire({r.SerializeAsString()}).ok());
}

// ---- Echo -------------------------------------------------------------------------------------

absl::StatusOr<std::string> EchoFromPieces(const std::vector<std::string_view>& pieces) {
  std::vector<grpc::Slice> slices;
  for (std::string_view p : pieces) slices.emplace_back(p.data(), p.size());
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  return EchoPayloadFromWire(&buffer);
}

TEST(EchoResponseDecoder, AgreesWithProtobufOnRandomAndMutatedBytes) {
  google::protobuf::LogSilencer quiet;
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 5000; ++i) {
    std::string bytes;
    const int fields = static_cast<int>(rng() % 4);
    for (int f = 0; f < fields; ++f) {
      if (rng() % 2) {
        AppendLen(1, RandomBytes(rng, rng() % 300), &bytes);
      } else {
        AppendTag(2 + rng() % 1000, 0, &bytes);
        AppendVarint(rng(), &bytes);
      }
    }
    if (i % 2 && !bytes.empty()) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    v1::EchoResponse expected;
    const bool protobuf_ok = expected.ParseFromString(bytes);
    const absl::StatusOr<std::string> got = EchoFromPieces(RandomSplit(rng, bytes));
    if (!got.ok()) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal);
      EXPECT_NE(got.status().message().find("EchoResponse is malformed"), std::string::npos);
      EXPECT_FALSE(protobuf_ok) << got.status();
      continue;
    }
    if (protobuf_ok) EXPECT_EQ(*got, expected.payload()) << i;
  }
}

}  // namespace
}  // namespace attn::client
