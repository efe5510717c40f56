// A cursor over a protobuf message that lies in pieces (the slices gRPC received it in): reads
// varints and fixed-size values across piece boundaries, hands out byte ranges as pieces of the
// input without copying them, and never reads past its limit (the end of the message, or of an
// embedded message being read). Every read checks the bytes left first, so a length from the
// wire cannot overflow a position or point outside the input. Borrows the pieces.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace attn {

class WireReader {
 public:
  explicit WireReader(std::span<const std::string_view> pieces);

  // Bytes from the start of the input.
  uint64_t position() const { return pos_; }
  // Bytes left before the current limit.
  uint64_t remaining() const { return limit_ - pos_; }
  bool AtLimit() const { return pos_ == limit_; }

  // A varint of at most 10 bytes (bits past the 64th dropped); false when it runs past the limit
  // or is longer (what was consumed is not given back: the caller reports the input malformed).
  bool ReadVarint(uint64_t* value);
  // The next n bytes appended to out as pieces of the input; false when fewer than n are left.
  bool ReadPieces(uint64_t n, std::vector<std::string_view>* out);
  // The next n bytes appended to out (a copy: for small fields); false when fewer are left.
  bool AppendTo(uint64_t n, std::string* out);

  // Narrows the limit to the next n bytes (false when fewer are left); *outer receives the
  // limit to restore with PopLimit once those bytes have been read.
  bool PushLimit(uint64_t n, uint64_t* outer);
  void PopLimit(uint64_t outer) { limit_ = outer; }

 private:
  // Moves past empty pieces and the end of the current one.
  void SkipEmpty();

  std::span<const std::string_view> pieces_;
  size_t piece_ = 0;   // the piece the next byte is in
  size_t offset_ = 0;  // its offset there
  uint64_t pos_ = 0;
  uint64_t limit_ = 0;
};

}  // namespace attn
