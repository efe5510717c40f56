// attnd's raw Echo coding (rpc/echo_wire.h) against protobuf, on fresh random messages: what the
// reader makes of any bytes protobuf accepts equals protobuf's message, however they are split
// into slices; the answer's bytes are exactly protobuf's serialization of the EchoResponse the
// contract asks for, and its payload is made of the request's slices, not a copy of them.
#include <gtest/gtest.h>

#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attn/v1/attention.pb.h"
#include "rpc/echo_wire.h"
#include "common/wire_test_util.h"

namespace attn {
namespace {

using attn::testing::RandomBytes;
using attn::testing::RandomSplit;
using attn::testing::SeededRng;

// The bytes as gRPC might hand them over: slices (copies) cut at random points.
std::vector<grpc::Slice> RandomSlices(std::mt19937_64& rng, const std::string& bytes) {
  std::vector<grpc::Slice> slices;
  for (std::string_view piece : RandomSplit(rng, bytes)) {
    slices.emplace_back(piece.data(), piece.size());
  }
  return slices;
}

std::vector<std::string_view> Pieces(const std::vector<grpc::Slice>& slices) {
  std::vector<std::string_view> pieces;
  for (const grpc::Slice& s : slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return pieces;
}

std::string Flatten(const std::vector<grpc::Slice>& slices) {
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

v1::EchoRequest RandomRequest(std::mt19937_64& rng) {
  v1::EchoRequest r;
  r.set_payload(RandomBytes(rng, rng() % 4 == 0 ? 0 : rng() % 3000));
  const int64_t cases[] = {0, -1, 1, static_cast<int64_t>(r.payload().size()),
                           static_cast<int64_t>(rng() % 4000), std::numeric_limits<int64_t>::min(),
                           std::numeric_limits<int64_t>::max()};
  r.set_response_bytes(cases[rng() % std::size(cases)]);
  return r;
}

// Decodes bytes (randomly sliced) and answers; checks both against protobuf.
void ExpectAgreesWithProtobuf(std::mt19937_64& rng, const std::string& bytes, bool may_refuse) {
  v1::EchoRequest expected;
  const bool protobuf_ok = expected.ParseFromString(bytes);
  const std::vector<grpc::Slice> slices = RandomSlices(rng, bytes);
  DecodedEchoRequest decoded;
  const absl::Status st = DecodeEchoRequest(Pieces(slices), &decoded);
  if (!st.ok()) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("EchoRequest is malformed: "), std::string::npos) << st;
    EXPECT_FALSE(protobuf_ok) << "protobuf parsed what the reader refused: " << st;
    return;
  }
  if (!protobuf_ok) {
    EXPECT_TRUE(may_refuse) << "the reader took bytes protobuf refuses";
    return;
  }
  EXPECT_EQ(decoded.response_bytes, expected.response_bytes());
  EXPECT_EQ(decoded.payload_size, expected.payload().size());
  const grpc::ByteBuffer answer = EncodeEchoResponse(slices, decoded);
  std::vector<grpc::Slice> out;
  ASSERT_TRUE(answer.Valid());
  ASSERT_TRUE(answer.Dump(&out).ok());
  const std::string& payload = expected.payload();
  const int64_t want = expected.response_bytes();
  v1::EchoResponse response;
  response.set_payload(want > 0 ? payload.substr(0, static_cast<size_t>(std::min<uint64_t>(
                                                     payload.size(), static_cast<uint64_t>(want))))
                                : payload);
  EXPECT_EQ(Flatten(out), response.SerializeAsString());
  // Payload slices longer than gRPC inlines are the request's bytes, not copies.
  for (const grpc::Slice& s : out) {
    if (s.size() <= 64) continue;
    const auto* p = reinterpret_cast<const char*>(s.begin());
    EXPECT_TRUE(std::any_of(slices.begin(), slices.end(), [p](const grpc::Slice& in) {
      const auto* b = reinterpret_cast<const char*>(in.begin());
      return std::less_equal<>()(b, p) && std::less<>()(p, b + in.size());
    })) << "a payload slice of the answer is a copy";
  }
}

TEST(EchoWire, RandomRequestsAnsweredAsProtobufWould) {
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 3000; ++i) {
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(rng, RandomRequest(rng).SerializeAsString(), false));
  }
}

// Repeated and reordered fields merge as in protobuf (the last payload wins), unknown fields are
// skipped.
TEST(EchoWire, MergedAndUnknownFields) {
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 1000; ++i) {
    std::string bytes;
    const int parts = 1 + static_cast<int>(rng() % 4);
    for (int p = 0; p < parts; ++p) {
      v1::EchoRequest r = RandomRequest(rng);
      if (rng() % 2) r.clear_payload();
      if (rng() % 2) r.clear_response_bytes();
      bytes += r.SerializeAsString();
      if (rng() % 2) bytes += std::string("\x98\x06\x07", 3);  // field 99, varint
      if (rng() % 2) bytes += std::string("\xa2\x06\x02zz", 5);  // field 100, 2 bytes
    }
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(rng, bytes, false));
  }
}

TEST(EchoWire, MutatedBytesNeverCrash) {
  google::protobuf::LogSilencer quiet;
  std::mt19937_64 rng = SeededRng();
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = RandomRequest(rng).SerializeAsString();
    if (bytes.empty()) continue;
    for (int f = 0; f < 1 + static_cast<int>(rng() % 3); ++f) {
      bytes[rng() % bytes.size()] = static_cast<char>(rng());
    }
    // The reader may take tags protobuf refuses (over 5 bytes); never the other way round.
    ASSERT_NO_FATAL_FAILURE(ExpectAgreesWithProtobuf(rng, bytes, true));
  }
}

TEST(EchoWire, EmptyRequestGetsAnEmptyButValidAnswer) {
  DecodedEchoRequest decoded;
  ASSERT_TRUE(DecodeEchoRequest({}, &decoded).ok());
  const grpc::ByteBuffer answer = EncodeEchoResponse({}, decoded);
  EXPECT_TRUE(answer.Valid());  // an invalid buffer would send no message at all
  EXPECT_EQ(answer.Length(), 0u);
}

}  // namespace
}  // namespace attn
