// A host shared-memory region of the client's: a memfd sized, backed (fallocate) and sealed
// against shrinking or growing, mapped read-write here. attnd maps the same memory once the
// region is registered (RegionClient), so that request tensors placed in it travel without a
// copy through the network stack.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace attn::client {

class HostRegion {
 public:
  // bytes > 0. RESOURCE_EXHAUSTED when the memory cannot be backed.
  static absl::StatusOr<std::unique_ptr<HostRegion>> Create(size_t bytes);
  ~HostRegion();
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // The memfd (owned by this object): what RegionClient passes to attnd.
  int fd() const { return fd_; }

 private:
  HostRegion(int fd, char* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  const int fd_;
  char* const data_;
  const size_t size_;
};

}  // namespace attn::client
