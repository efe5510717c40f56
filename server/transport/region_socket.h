// attnd's region socket: a Unix-domain SOCK_SEQPACKET listener over which same-host clients hand
// their memfds to attnd (gRPC cannot carry file descriptors). Only peers of attnd's own user (or
// root) are served, checked with SO_PEERCRED. Each message is the 8 bytes "ATTNFD01" with one fd
// as SCM_RIGHTS (or "ATTNVM01" with a CUDA VMM allocation's fd, or "ATTNLS01" alone for a lease);
// the answer is one line, "OK <handle>\n" or "ERR <reason>\n". A connection stays
// open for as long as its client uses the regions: when it closes, the registry drops them.
// One thread serves every connection (poll); mapping a memfd is quick and never blocks on the
// client.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "transport/region_registry.h"

namespace attn {

class RegionSocket {
 public:
  // Listens on path (an existing file there is replaced), mode 0600. registry must outlive it.
  static absl::StatusOr<std::unique_ptr<RegionSocket>> Listen(const std::string& path,
                                                              RegionRegistry* registry);
  ~RegionSocket();
  const std::string& path() const { return path_; }

 private:
  RegionSocket(std::string path, int listen_fd, int wake_fd[2], RegionRegistry* registry);
  void Loop();
  void Accept();
  // Serves one message of connection fd; false when the connection is over.
  bool Serve(int fd, uint64_t connection);

  const std::string path_;
  const int listen_fd_;
  const int wake_read_fd_;
  const int wake_write_fd_;
  RegionRegistry* const registry_;
  static constexpr size_t kMaxConnections = 1024;
  std::map<int, uint64_t> connections_;  // fd -> connection id; used by the loop thread only
  uint64_t next_connection_ = 1;
  std::thread thread_;
};

// The 8 bytes that go with each memfd sent to the region socket.
inline constexpr char kRegionSocketMagic[] = "ATTNFD01";
// The 8 bytes that go with the POSIX file descriptor of a CUDA VMM allocation
// (REGION_KIND_CUDA_VMM): attnd keeps the descriptor, unmapped, until RegisterRegion imports it.
inline constexpr char kRegionSocketVmm[] = "ATTNVM01";
// The 8 bytes (no descriptor) that ask for a lease: a handle that ties a GPU region registered
// with it to this connection.
inline constexpr char kRegionSocketLease[] = "ATTNLS01";

}  // namespace attn
