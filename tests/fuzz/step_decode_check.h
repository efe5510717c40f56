// attnd's StepRequest / BatchStepRequest decoder (rpc/step_request_decoder.h) against protobuf's
// parser on the same bytes: used by the session target on every Step and BatchStep record, and
// by the decoder's own tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace attn::fuzz {

// Decodes bytes (a BatchStepRequest when batch, else a StepRequest) cut into pieces where the
// bytes say (after each byte whose low 3 bits are 0b101, and at 1/3 and 2/3 of them), and parses
// them with protobuf. Both must accept or both refuse (the decoder with INVALID_ARGUMENT naming
// the message); accepted, each step's header must equal protobuf's message without its tensors'
// data (unknown fields included), and those data the decoder's pieces joined. "" when all holds,
// else what broke.
std::string CheckStepDecoder(const uint8_t* data, size_t size, bool batch);

}  // namespace attn::fuzz
