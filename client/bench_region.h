// attn-bench --transport shm: a worker's host region holding its request's q, k and v and room
// for o (and lse), registered with attnd, and the request that names it instead of carrying the
// bytes.
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
  // inline_request (borrowed; must outlive this) gives the shapes and the input bytes.
  static absl::StatusOr<std::unique_ptr<BenchRegion>> Create(RegionClient* regions,
                                                             const std::string& name,
                                                             const v1::AttendRequest* inline_request);
  // The request with q, k, v in the region and o (and lse) written into it.
  const v1::AttendRequest& request() const { return request_; }
  // Copies q, k and v into the region: the one copy a client that produces them pays.
  void WriteInputs();

 private:
  BenchRegion(const v1::AttendRequest* inline_request, std::unique_ptr<HostRegion> region)
      : inline_(inline_request), region_(std::move(region)) {}

  const v1::AttendRequest* const inline_;
  std::unique_ptr<HostRegion> region_;
  v1::AttendRequest request_;
};

}  // namespace attn::client
