#include "rpc/wire_reader.h"

#include <algorithm>

namespace attn {

WireReader::WireReader(std::span<const std::string_view> pieces) : pieces_(pieces) {
  for (std::string_view p : pieces_) limit_ += p.size();
  SkipEmpty();
}

void WireReader::SkipEmpty() {
  while (piece_ < pieces_.size() && offset_ == pieces_[piece_].size()) {
    ++piece_;
    offset_ = 0;
  }
}

bool WireReader::ReadVarint(uint64_t* value) {
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

bool WireReader::ReadPieces(uint64_t n, std::vector<std::string_view>* out) {
  if (n > remaining()) return false;
  pos_ += n;
  while (n > 0) {
    const std::string_view p = pieces_[piece_];
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, p.size() - offset_));
    out->push_back(p.substr(offset_, take));
    offset_ += take;
    n -= take;
    SkipEmpty();
  }
  return true;
}

bool WireReader::AppendTo(uint64_t n, std::string* out) {
  if (n > remaining()) return false;
  pos_ += n;
  while (n > 0) {
    const std::string_view p = pieces_[piece_];
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, p.size() - offset_));
    out->append(p.data() + offset_, take);
    offset_ += take;
    n -= take;
    SkipEmpty();
  }
  return true;
}

bool WireReader::PushLimit(uint64_t n, uint64_t* outer) {
  if (n > remaining()) return false;
  *outer = limit_;
  limit_ = pos_ + n;
  return true;
}

}  // namespace attn
