// The region target (region_fuzzer.cc): Attends and session steps whose tensors the input places
// in shared-memory regions (FuzzRegions: host "r0" and "r1", GPU "g0") at offsets and sizes of its
// choosing, starting from one of a few valid requests. A request that attnd accepts must resolve
// inside its regions at addresses aligned for its elements, and its answer (the CPU kernel's for
// an Attend, the CPU backend's for a step) must equal, bit for bit, the answer to the same request
// with the bytes it read sent inline (a step on a twin session); a refusal must carry a message.
//
// Input: [template][fill][flags], then up to kMaxRegionEdits edits of kRegionEditBytes each:
//   [slot: q, k (k_new), v (v_new), o, lse (modulo 5)]
//   [region: none (inline data / output in the response), "r0", "r1", "g0", "r9" (unknown)]
//   [offset: 4 bytes, little-endian][bytes minus the tensor's size: 2 bytes, little-endian, signed]
// fill picks the regions' contents; flags bit 0 flips the template's return_lse, bit 1 lets a
// step resolve GPU regions (a device backend's; resolved only, never run here).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_env.h"

namespace attn::fuzz {

constexpr size_t kRegionEditBytes = 8;
constexpr size_t kMaxRegionEdits = 16;

Outcome RunRegionInput(const uint8_t* data, size_t size);

enum class RegionSlot : uint8_t { kQ = 0, kK, kV, kO, kLse };
enum class RegionName : uint8_t { kNone = 0, kR0, kR1, kG0, kUnknown };
struct RegionEdit {
  RegionSlot slot;
  RegionName region;
  uint32_t offset = 0;
  int16_t bytes_delta = 0;
};

// An input of the region target (for seeds and tests).
std::string RegionInput(uint8_t template_index, uint8_t fill, uint8_t flags,
                        const std::vector<RegionEdit>& edits);

// What a template is (for seeds placing its tensors).
struct RegionTemplateInfo {
  bool step = false;
  bool lse = false;             // returned (unless the input's flags flip it)
  uint64_t element_bytes = 2;   // of q, k, v and o
  std::vector<uint64_t> bytes;  // of q, k, v, o and lse, in slot order
};
size_t RegionTemplateCount();
RegionTemplateInfo DescribeRegionTemplate(uint8_t template_index);

}  // namespace attn::fuzz
