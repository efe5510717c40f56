// The import target (import_fuzzer.cc): bytes -> ImportSession streams (SessionTransferChunk
// sequences) fed to the server's own import path (SessionImportStream, with the session manager,
// page pool and CPU step device of SessionEngine), as the ImportSession reactor feeds it.
// A stream may carry several sessions (a fork family): headers after the first name pages sent
// before in the stream (shared_pages) instead of sending them again.
// Checked: a refusal has a code an import may answer (INVALID_ARGUMENT, DATA_LOSS,
// RESOURCE_EXHAUSTED, FAILED_PRECONDITION) and a message, and a refused or dropped stream leaves
// every page and session count as it was; an accepted stream makes one session per header whose
// token counts are the header's, the pool counts each page sent once (shared ones too), and each
// session's pages, read back by the exporter, hold the bytes of the pages sent (or named); once
// they are closed every page is free.
//
// Input: records of [op: 1 byte][length: 2 bytes, little-endian][payload]:
//   kChunk  the payload is a serialized SessionTransferChunk, sent as it is;
//   kPage   a page for the last header the stream took: payload [index delta: int8]
//           [size delta: int16 LE][CRC32C xor: uint8][fill...]: 2 x page_bytes (+ size delta)
//           of finite 16-bit values seeded by fill, at the stream's next index (+ delta), its
//           CRC32C (xor'd);
//   kEnd    the sender closes its side: the stream completes (or is refused), and the next
//           record starts a new stream;
//   kDrop   the sender goes away: the stream is dropped.
// A stream still open when the input ends completes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_env.h"

namespace attn::fuzz {

enum class ImportOp : uint8_t { kChunk = 0, kPage, kEnd, kDrop, kCount };

Outcome RunImportInput(const uint8_t* data, size_t size);

// Appends one record to an input (for seeds and tests).
void AppendImportRecord(std::string* input, ImportOp op, const std::string& payload);
// A kPage payload.
std::string ImportPagePayload(int8_t index_delta, int16_t size_delta, uint8_t crc_xor,
                              uint32_t fill);

}  // namespace attn::fuzz
