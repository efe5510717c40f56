#include "sessions/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace attn {
namespace {

constexpr uint32_t kReflectedCastagnoli = 0x82F63B78u;

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ kReflectedCastagnoli : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = MakeTable();

// c is the inverted running value in both paths.
uint32_t ExtendByTable(uint32_t c, const unsigned char* p, size_t size) {
  for (size_t i = 0; i < size; ++i) c = kTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
// The SSE4.2 crc32 instruction computes the same polynomial, 8 bytes at a time.
__attribute__((target("sse4.2"))) uint32_t ExtendBySse42(uint32_t c, const unsigned char* p,
                                                         size_t size) {
  uint64_t c64 = c;
  while (size >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
    p += 8;
    size -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (size-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}

const bool kHasSse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (kHasSse42) return ~ExtendBySse42(~crc, p, size);
#endif
  return ~ExtendByTable(~crc, p, size);
}

uint32_t Crc32cExtendPortableForTest(uint32_t crc, const void* data, size_t size) {
  return ~ExtendByTable(~crc, static_cast<const unsigned char*>(data), size);
}

}  // namespace attn
