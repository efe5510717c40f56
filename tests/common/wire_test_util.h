// Random bytes and random splits of them, for the tests of the hand-written wire codings (a
// message must decode alike however gRPC happens to slice it).
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace attn::testing {

// The protobuf wire format by hand, for encodings protobuf's serializer never writes.
inline void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
inline void AppendTag(uint64_t number, int type, std::string* out) { AppendVarint(number << 3 | type, out); }
inline void AppendLen(uint64_t number, const std::string& body, std::string* out) {
  AppendTag(number, 2, out);
  AppendVarint(body.size(), out);
  *out += body;
}

// A generator with a fresh seed, printed so that a failure can be replayed.
inline std::mt19937_64 SeededRng() {
  const uint64_t seed =
      std::random_device{}() * uint64_t{0x9e3779b97f4a7c15} ^ std::random_device{}();
  std::printf("random seed %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

inline std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// A field no message of ours declares, of a random wire type (varint, fixed64, length-delimited,
// fixed32, or a group holding two fields), numbered 100 and up: decoders must skip it.
inline void AppendRandomUnknownField(std::mt19937_64& rng, std::string* out) {
  const uint64_t number = 100 + rng() % 100000;
  switch (rng() % 5) {
    case 0: AppendTag(number, 0, out); AppendVarint(rng(), out); break;
    case 1: AppendTag(number, 1, out); *out += RandomBytes(rng, 8); break;
    case 2: AppendLen(number, RandomBytes(rng, rng() % 50), out); break;
    case 3: AppendTag(number, 5, out); *out += RandomBytes(rng, 4); break;
    case 4:
      AppendTag(number, 3, out);
      AppendTag(7, 0, out);
      AppendVarint(rng(), out);
      AppendLen(8, RandomBytes(rng, 5), out);
      AppendTag(number, 4, out);
      break;
  }
}

// Up to 11 cut points within [0, size], unsorted, repeats allowed.
inline std::vector<size_t> RandomCuts(std::mt19937_64& rng, size_t size) {
  std::vector<size_t> cuts(rng() % 12);
  for (size_t& c : cuts) c = size == 0 ? 0 : rng() % (size + 1);
  return cuts;
}

// Splits bytes into pieces at the given cut points (any order, within [0, size]).
inline std::vector<std::string_view> Split(const std::string& bytes, std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::string_view> pieces;
  size_t at = 0;
  for (size_t c : cuts) {
    pieces.push_back(std::string_view(bytes).substr(at, c - at));
    at = c;
  }
  pieces.push_back(std::string_view(bytes).substr(at));
  return pieces;
}

inline std::vector<std::string_view> RandomSplit(std::mt19937_64& rng, const std::string& bytes) {
  return Split(bytes, RandomCuts(rng, bytes.size()));
}

// The bytes of a buffer, back to back.
inline std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

}  // namespace attn::testing
