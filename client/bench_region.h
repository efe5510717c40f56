// attn-bench --transport shm|cuda-ipc: a worker's region holding its request's q, k and v and room
// for o (and lse), registered with attnd, and the request that names it instead of carrying the
// bytes. shm: a host memfd region; cuda-ipc: GPU memory on device 0 shared by a CUDA IPC handle.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attn/client/host_region.h"
#include "attn/client/region_client.h"
#include "attn/v1/attention.pb.h"

namespace attn::client {

class BenchRegion {
 public:
  enum class Kind { kHost, kGpu };
  // inline_request (borrowed; must outlive this) gives the shapes and the input bytes.
  static absl::StatusOr<std::unique_ptr<BenchRegion>> Create(RegionClient* regions, Kind kind,
                                                             const std::string& name,
                                                             const v1::AttendRequest* inline_request);
  ~BenchRegion();
  // The request with q, k, v in the region and o (and lse) written into it.
  const v1::AttendRequest& request() const { return request_; }
  // Copies q, k and v into the region: the one copy a client that produces them on the host
  // pays (host regions; GPU regions are written once, as a model's tensors already live there).
  void WriteInputs();
  // The o the last call wrote into the region.
  absl::StatusOr<std::string> ReadOutput() const;

 private:
  explicit BenchRegion(const v1::AttendRequest* inline_request) : inline_(inline_request) {}

  const v1::AttendRequest* const inline_;
  std::unique_ptr<HostRegion> host_;
  void* device_ = nullptr;  // cudaMalloc'd (GPU regions)
  RegionClient* regions_ = nullptr;
  std::string name_;
  v1::AttendRequest request_;
};

// True when this attn-bench can make GPU regions (built with CUDA).
bool BenchGpuRegionsAvailable();

}  // namespace attn::client
