// A cursor over a protobuf message that lies in pieces (the slices gRPC received it in): reads
// varints and fixed-size values across piece boundaries, hands out byte ranges as pieces of the
// input without copying them, and never reads past its limit (the end of the message, or of an
// embedded message being read). Every read checks the bytes left first, so a length from the
// wire cannot overflow a position or point outside the input. Borrows the pieces.
// Header-only: attnd's request decoder and the client library's response decoder share it, and
// neither may depend on the other.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace attn {

class WireReader {
 public:
  explicit WireReader(std::span<const std::string_view> pieces) : pieces_(pieces) {
    for (std::string_view p : pieces_) limit_ += p.size();
    SkipEmpty();
  }

  // Bytes from the start of the input.
  uint64_t position() const { return pos_; }
  // Bytes left before the current limit.
  uint64_t remaining() const { return limit_ - pos_; }
  bool AtLimit() const { return pos_ == limit_; }

  // A varint of at most 10 bytes (bits past the 64th dropped); false when it runs past the limit
  // or is longer (what was consumed is not given back: the caller reports the input malformed).
  bool ReadVarint(uint64_t* value) {
    // Where the next 10 bytes lie in one piece and inside the limit (most varints): read in place.
    if (piece_ < pieces_.size() && pieces_[piece_].size() - offset_ >= 10 && remaining() >= 10) {
      const auto* s = reinterpret_cast<const uint8_t*>(pieces_[piece_].data() + offset_);
      uint64_t v = 0;
      for (int i = 0; i < 10; ++i) {
        v |= uint64_t{s[i] & 0x7fu} << (7 * i);
        if ((s[i] & 0x80) == 0) {
          Advance(i + 1);
          *value = v;
          return true;
        }
      }
      Advance(10);
      return false;
    }
    uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      if (AtLimit()) return false;
      const uint8_t b = static_cast<uint8_t>(pieces_[piece_][offset_]);
      ++offset_;
      ++pos_;
      SkipEmpty();
      // Bits past the 64th (in the tenth byte) are dropped, as protobuf's parser drops them.
      v |= uint64_t{b & 0x7fu} << (7 * i);
      if ((b & 0x80) == 0) {
        *value = v;
        return true;
      }
    }
    return false;
  }
  // The next n bytes appended to out (a vector of string_view, or any container with push_back)
  // as pieces of the input; false when fewer than n are left.
  template <typename Pieces>
  bool ReadPieces(uint64_t n, Pieces* out) {
    if (n > remaining()) return false;
    Consume(n, [out](std::string_view p) { out->push_back(p); });
    return true;
  }
  // The next n bytes appended to out (a copy: for small fields); false when fewer are left.
  bool AppendTo(uint64_t n, std::string* out) {
    if (n > remaining()) return false;
    Consume(n, [out](std::string_view p) { out->append(p); });
    return true;
  }

  // The next n bytes copied to dst (small values: fixed-size fields); false when fewer are left.
  bool CopyTo(uint64_t n, char* dst) {
    if (n > remaining()) return false;
    Consume(n, [&dst](std::string_view p) {
      std::memcpy(dst, p.data(), p.size());
      dst += p.size();
    });
    return true;
  }
  // Steps over the next n bytes; false when fewer are left.
  bool Skip(uint64_t n) {
    if (n > remaining()) return false;
    Consume(n, [](std::string_view) {});
    return true;
  }

  // Narrows the limit to the next n bytes (false when fewer are left); *outer receives the
  // limit to restore with PopLimit once those bytes have been read.
  bool PushLimit(uint64_t n, uint64_t* outer) {
    if (n > remaining()) return false;
    *outer = limit_;
    limit_ = pos_ + n;
    return true;
  }
  void PopLimit(uint64_t outer) { limit_ = outer; }

 private:
  // Moves past empty pieces and the end of the current one.
  void SkipEmpty() {
    while (piece_ < pieces_.size() && offset_ == pieces_[piece_].size()) {
      ++piece_;
      offset_ = 0;
    }
  }
  // Moves n bytes on inside the current piece (n <= what is left of it).
  void Advance(size_t n) {
    offset_ += n;
    pos_ += n;
    SkipEmpty();
  }
  // Hands the next n bytes (n <= remaining()) to take, piece by piece.
  template <typename Take>
  void Consume(uint64_t n, Take take) {
    pos_ += n;
    while (n > 0) {
      const std::string_view p = pieces_[piece_];
      const size_t len = static_cast<size_t>(std::min<uint64_t>(n, p.size() - offset_));
      take(p.substr(offset_, len));
      offset_ += len;
      n -= len;
      SkipEmpty();
    }
  }

  std::span<const std::string_view> pieces_;
  size_t piece_ = 0;   // the piece the next byte is in
  size_t offset_ = 0;  // its offset there
  uint64_t pos_ = 0;
  uint64_t limit_ = 0;
};

}  // namespace attn
