// Field-level helpers of the protobuf wire format over a WireReader: tags, varints, and copying
// (or skipping) one whole field as it lies on the wire, with the checks protobuf's parser makes
// (wire types 6 and 7, field number 0, unmatched groups, lengths past the end). Decoders that
// keep their large bytes fields as pieces of the input hand every other field, so copied, to
// protobuf's own MergeFromString. Header-only, for the server and the client library alike.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attn/util/wire_reader.h"

namespace attn::wire {

enum WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5,
};

// Groups nested deeper than this inside an unknown field are refused (protobuf's own parser
// stops at 100 levels of nesting).
inline constexpr int kMaxGroupDepth = 64;

struct Tag {
  uint64_t number = 0;
  uint32_t type = 0;
};

constexpr uint32_t MakeTag(uint32_t number, WireType type) { return number << 3 | type; }

inline void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

inline size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Reads a tag; false with *error set when it is truncated, over-long, has field number 0, or a
// wire type that does not exist.
inline bool ReadTag(WireReader& r, Tag* tag, std::string* error) {
  uint64_t raw;
  if (!r.ReadVarint(&raw)) {
    *error = "truncated or over-long field tag";
    return false;
  }
  // Tags are 32 bits: protobuf's parser drops any higher bits of the varint, and so does this.
  tag->number = (raw & 0xffffffffu) >> 3;
  tag->type = static_cast<uint32_t>(raw & 7);
  if (tag->number == 0) {
    *error = "field number 0";
    return false;
  }
  if (tag->type > kFixed32) {
    *error = "unknown wire type " + std::to_string(tag->type);
    return false;
  }
  return true;
}

// The value of the field whose tag was just read, appended to out as it lies on the wire, tag
// first (out null: skipped). False with *error set when it is malformed.
inline bool CopyField(WireReader& r, const Tag& tag, std::string* out, std::string* error,
                      int depth = 0) {
  std::string scratch;
  std::string* to = out != nullptr ? out : &scratch;
  AppendVarint(tag.number << 3 | tag.type, to);
  switch (tag.type) {
    case kVarint: {
      uint64_t v;
      if (!r.ReadVarint(&v)) {
        *error = "truncated or over-long varint";
        return false;
      }
      AppendVarint(v, to);
      return true;
    }
    case kFixed64:
      if (r.AppendTo(8, to)) return true;
      *error = "truncated 8-byte value";
      return false;
    case kFixed32:
      if (r.AppendTo(4, to)) return true;
      *error = "truncated 4-byte value";
      return false;
    case kLengthDelimited: {
      uint64_t n;
      if (!r.ReadVarint(&n)) {
        *error = "truncated or over-long length";
        return false;
      }
      AppendVarint(n, to);
      const uint64_t left = r.remaining();
      // A skipped field's bytes are not copied, only stepped over.
      std::vector<std::string_view> pieces;
      if (out != nullptr ? !r.AppendTo(n, to) : !r.ReadPieces(n, &pieces)) {
        *error = "length " + std::to_string(n) + " runs past the end of its message (" +
                 std::to_string(left) + " bytes left)";
        return false;
      }
      return true;
    }
    case kStartGroup: {
      if (depth >= kMaxGroupDepth) {
        *error = "groups nested too deeply";
        return false;
      }
      for (;;) {
        if (r.AtLimit()) {
          *error = "group without its end";
          return false;
        }
        Tag inner;
        if (!ReadTag(r, &inner, error)) return false;
        if (inner.type == kEndGroup) {
          if (inner.number != tag.number) {
            *error = "mismatched end of group";
            return false;
          }
          AppendVarint(inner.number << 3 | kEndGroup, to);
          return true;
        }
        if (!CopyField(r, inner, to, error, depth + 1)) return false;
      }
    }
    default:  // kEndGroup outside a group
      *error = "end of a group that was not started";
      return false;
  }
}

}  // namespace attn::wire
