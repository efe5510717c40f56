// An output tensor's bytes where they were computed or brought back to, kept alive by whoever
// owns that memory: a buffer of its own, or a part of a launch's output staging (pinned memory
// on the CUDA backend) shared by the outputs of that launch. The wire path sends them from there
// as they are (rpc/response_encoder.h), so no output is copied on its way to the network.
#pragma once

#include <cstddef>
#include <memory>

namespace attn {

struct OutputBytes {
  char* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> owner;  // keeps data valid; null when data is

  // A buffer of its own (heap, uninitialised).
  static OutputBytes Allocate(size_t size) {
    std::shared_ptr<char[]> buffer(new char[size]);
    return {buffer.get(), size, std::move(buffer)};
  }
  // A part of this one, sharing its owner.
  OutputBytes Part(size_t offset, size_t bytes) const { return {data + offset, bytes, owner}; }
  bool empty() const { return data == nullptr; }
};

}  // namespace attn
