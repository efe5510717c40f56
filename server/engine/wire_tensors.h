// Request tensors as they lie in a received gRPC message: each one's bytes as a list of pieces
// of the message's slices, in order. The pieces borrow the slices; whoever holds a WireTensors
// keeps the slices alive until the bytes have been copied out (Backend::StageWireInputs).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/container/inlined_vector.h"

namespace attn {

struct WireBytes {
  // Held in place up to two (a tensor rarely spans more slices): a BatchStep's many tensors then
  // take no allocation each.
  absl::InlinedVector<std::string_view, 2> pieces;
  uint64_t size = 0;  // the pieces' sizes summed

  // Copies the pieces back to back into dst, which holds size bytes.
  void CopyTo(char* dst) const {
    for (std::string_view p : pieces) {
      std::memcpy(dst, p.data(), p.size());
      dst += p.size();
    }
  }
};

// q, k and v of an AttendRequest; a tensor given as a region (Tensor.region) has no pieces.
struct WireTensors {
  WireBytes q, k, v;
};

}  // namespace attn
