#include "backends/host_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attn/kernels/dtype_convert.h"

namespace attn {
namespace {

size_t SourceElementBytes(ElementCast cast) {
  switch (cast) {
    case ElementCast::kNone: return 1;
    case ElementCast::kFloatToHalf:
    case ElementCast::kFloatToBf16: return 4;
    case ElementCast::kHalfToFloat:
    case ElementCast::kBf16ToFloat: return 2;
  }
  return 1;
}

size_t DestElementBytes(ElementCast cast) {
  switch (cast) {
    case ElementCast::kNone: return 1;
    case ElementCast::kFloatToHalf:
    case ElementCast::kFloatToBf16: return 2;
    case ElementCast::kHalfToFloat:
    case ElementCast::kBf16ToFloat: return 4;
  }
  return 1;
}

// Elements [first, first + count) of c.
void CopyPart(const HostCopy& c, size_t first, size_t count) {
  const char* src = static_cast<const char*>(c.src) + first * SourceElementBytes(c.cast);
  char* dst = static_cast<char*>(c.dst) + first * DestElementBytes(c.cast);
  switch (c.cast) {
    case ElementCast::kNone:
      std::memcpy(dst, src, count);
      return;
    case ElementCast::kFloatToHalf:
    case ElementCast::kFloatToBf16: {
      const float* in = reinterpret_cast<const float*>(src);
      uint16_t* out = reinterpret_cast<uint16_t*>(dst);
      if (c.cast == ElementCast::kFloatToHalf) {
        for (size_t i = 0; i < count; ++i) out[i] = kernels::cpu::FloatToHalfBits(in[i]);
      } else {
        for (size_t i = 0; i < count; ++i) out[i] = kernels::cpu::FloatToBf16Bits(in[i]);
      }
      return;
    }
    case ElementCast::kHalfToFloat:
    case ElementCast::kBf16ToFloat: {
      const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
      float* out = reinterpret_cast<float*>(dst);
      if (c.cast == ElementCast::kHalfToFloat) {
        for (size_t i = 0; i < count; ++i) out[i] = kernels::cpu::HalfBitsToFloat(in[i]);
      } else {
        for (size_t i = 0; i < count; ++i) out[i] = kernels::cpu::Bf16BitsToFloat(in[i]);
      }
      return;
    }
  }
}

struct Piece {
  const HostCopy* copy;
  size_t first, count;
};

}  // namespace

void HostCopier::Run(std::span<const HostCopy> copies) const {
  size_t bytes = 0;
  for (const HostCopy& c : copies) bytes += c.elements * SourceElementBytes(c.cast);
  if (pool_ == nullptr || bytes < parallel_min_bytes_) {
    for (const HostCopy& c : copies) CopyPart(c, 0, c.elements);
    return;
  }
  std::vector<Piece> pieces;
  for (const HostCopy& c : copies) {
    const size_t step = std::max<size_t>(chunk_bytes_ / SourceElementBytes(c.cast), 1);
    for (size_t first = 0; first < c.elements; first += step) {
      pieces.push_back({&c, first, std::min(step, c.elements - first)});
    }
  }
  const auto copy_piece = [&](int64_t i, int) {
    CopyPart(*pieces[i].copy, pieces[i].first, pieces[i].count);
  };
  // While another request has the pool, this one copies on its own thread: with many requests in
  // flight their callers' threads already share the work, and waiting in turn would only idle them.
  if (!pool_->TryParallelFor(static_cast<int64_t>(pieces.size()), copy_piece)) {
    for (size_t i = 0; i < pieces.size(); ++i) copy_piece(static_cast<int64_t>(i), 0);
  }
}

}  // namespace attn
