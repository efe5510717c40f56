// A server with shared memory allowed, a client with its region socket, and one request whose
// q, k, v lie in region "in" and whose o and lse may go to region "out": the common rig of
// shared_memory_test.cc and region_bad_input_test.cc.
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attn/client/region_client.h"
#include "test_util.h"

namespace attn::testing {

struct RegionRigOptions {
  int seq = 64;      // query and key tokens (one sequence), 4 heads, 2 KV heads, d = 64, bf16
  int threads = 2;   // CPU backend threads
  std::vector<std::string> tokens;  // bearer tokens (the rig's client uses the first)
  int64_t max_regions = 4;
  int64_t max_bytes = int64_t{1} << 30;
};

class RegionRig {
 public:
  explicit RegionRig(RegionRigOptions options = {}) : options_(std::move(options)) {}
  ~RegionRig();
  // Bytes of "out" past o and lse: room to move a slice by a few bytes and still fit.
  static constexpr size_t kOutSlack = 16;

  // Starts everything and registers "in" (q, k, v filled in, back to back, no room to spare) and
  // "out" (room for o and lse, then kOutSlack bytes).
  bool Start();

  v1::AttendRequest InlineRequest(bool lse) const;
  // q, k, v from "in"; o (and lse when asked) into "out" when o_in_region.
  v1::AttendRequest RegionRequest(bool o_in_region, bool lse) const;
  absl::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response);
  absl::Status Register(const v1::RegisterRegionRequest& request);

  client::RegionClient& regions() { return *regions_; }
  client::Client& client() { return *client_; }
  client::HostRegion& in() const { return *in_; }
  client::HostRegion& out() const { return *out_; }
  size_t q_bytes() const { return random_.q.data.size(); }
  size_t kv_bytes() const { return random_.k.data.size(); }
  size_t o_bytes() const { return q_bytes(); }
  size_t lse_bytes() const { return 4 * 4 * size_t(options_.seq); }
  size_t lse_offset() const { return o_bytes(); }
  const RandomRequest& random() const { return random_; }
  const std::string& socket_path() const { return socket_path_; }
  int64_t RegionCount() const { return server_.server->SharedMemoryRegions(); }
  int metrics_port() const { return server_.server->metrics_port(); }
  // The client unmaps and closes its "in" memfd.
  void DropInputRegion() { in_.reset(); }
  // The client's region socket closes, as when its process exits.
  void CloseRegionSocket() { regions_.reset(); }
  // Another client of the same server with the given bearer token.
  std::unique_ptr<client::Client> ClientWithToken(const std::string& token) const;

 private:
  RegionRigOptions options_;
  std::string dir_, socket_path_;
  LoopbackServer server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::RegionClient> regions_;
  std::unique_ptr<client::HostRegion> in_, out_;
  RandomRequest random_;
};

}  // namespace attn::testing
