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

// Element i of an array of T at p, and its store: through memcpy, so that a source or
// destination at any byte address is read and written without undefined behaviour (compilers
// make these plain loads and stores).
template <typename T>
T LoadAt(const char* p, size_t i) {
  T x;
  std::memcpy(&x, p + i * sizeof(T), sizeof(T));
  return x;
}
template <typename T>
void StoreAt(char* p, size_t i, T x) {
  std::memcpy(p + i * sizeof(T), &x, sizeof(T));
}

// Elements [first, first + count) of c.
void CopyPart(const HostCopy& c, size_t first, size_t count) {
  const char* src = static_cast<const char*>(c.src) + first * SourceElementBytes(c.cast);
  char* dst = static_cast<char*>(c.dst) + first * DestElementBytes(c.cast);
  using kernels::cpu::Bf16BitsToFloat;
  using kernels::cpu::FloatToBf16Bits;
  using kernels::cpu::FloatToHalfBits;
  using kernels::cpu::HalfBitsToFloat;
  switch (c.cast) {
    case ElementCast::kNone:
      std::memcpy(dst, src, count);
      return;
    case ElementCast::kFloatToHalf:
      for (size_t i = 0; i < count; ++i) StoreAt(dst, i, FloatToHalfBits(LoadAt<float>(src, i)));
      return;
    case ElementCast::kFloatToBf16:
      for (size_t i = 0; i < count; ++i) StoreAt(dst, i, FloatToBf16Bits(LoadAt<float>(src, i)));
      return;
    case ElementCast::kHalfToFloat:
      for (size_t i = 0; i < count; ++i) StoreAt(dst, i, HalfBitsToFloat(LoadAt<uint16_t>(src, i)));
      return;
    case ElementCast::kBf16ToFloat:
      for (size_t i = 0; i < count; ++i) StoreAt(dst, i, Bf16BitsToFloat(LoadAt<uint16_t>(src, i)));
      return;
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
