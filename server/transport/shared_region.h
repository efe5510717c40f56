// One shared-memory region as attnd holds it: a sealed memfd of a client's mapped read-write into
// attnd (host), or a client's GPU allocation imported through CUDA IPC (GPU). Destroyed (unmapped,
// or its import closed) when the last holder lets go: the registry while it is registered, and
// every request that reads or writes it (deferred unmapping).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"

namespace attn {

class SharedRegion {
 public:
  // Maps fd (not taken: the caller closes it) after checking that it is a memfd sealed against
  // shrinking, of 1 to max_bytes bytes, opened read-write. The seal is what makes every later
  // access safe: the file cannot lose pages under the mapping, so no access past its end (and no
  // SIGBUS) can happen, whatever the client does with its own descriptor or mapping.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> MapMemfd(int fd, uint64_t max_bytes);
  // GPU memory a backend imported; release (closing the import) runs on destruction.
  static std::unique_ptr<SharedRegion> Gpu(char* device_data, uint64_t size,
                                           std::function<void()> release);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  // Host address, or device address when on_gpu.
  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool on_gpu() const { return static_cast<bool>(release_); }

  // A host region's mapping registered with the backend's device (CUDA backend: page-locked by
  // cudaHostRegister), so that requests copy straight between it and the GPU. unregister undoes
  // it and runs on destruction, before the unmapping: only once no request holds the region. Set
  // at most once, by the registry before any request can see the region (readers then take
  // the region from the registry under its lock, and need none of their own).
  void SetDeviceRegistration(std::function<void()> unregister);
  bool device_registered() const { return static_cast<bool>(unregister_); }

 private:
  SharedRegion(char* data, uint64_t size, std::function<void()> release)
      : data_(data), size_(size), release_(std::move(release)) {}

  char* const data_;
  const uint64_t size_;
  const std::function<void()> release_;  // GPU regions only
  std::function<void()> unregister_;     // host regions registered with the device only
};

}  // namespace attn
