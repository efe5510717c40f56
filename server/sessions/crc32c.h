// CRC32C (Castagnoli polynomial, the checksum of iSCSI and ext4), for checking KV pages end to
// end as they move between replicas. Incremental; the SSE4.2 instruction where the CPU has it,
// a table otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace attn {

// The CRC32C of `data` continuing from `crc` (the value of the bytes before it; 0 to start).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);
// The table path alone, so that tests compare the two on one machine.
uint32_t Crc32cExtendPortableForTest(uint32_t crc, const void* data, size_t size);
inline uint32_t Crc32c(std::string_view bytes) { return Crc32cExtend(0, bytes.data(), bytes.size()); }

}  // namespace attn
