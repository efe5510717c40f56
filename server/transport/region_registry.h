// The shared-memory regions attnd holds, per client identity. Regions arrive in two steps: the
// region socket maps a client's memfd (or keeps the file descriptor of a CUDA VMM allocation)
// and parks it under a one-time handle (AddPending, AddPendingVmm); the client then claims the
// handle with RegisterRegion over gRPC, where its identity is known (Register). Requests look regions up by (identity, name) and hold them by shared_ptr, so that
// unregistering (or the client's socket closing) never unmaps memory a request still uses.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/v1/attention.pb.h"
#include "transport/shared_region.h"

namespace attn {

class Metrics;

class RegionRegistry {
 public:
  struct Options {
    int64_t max_regions_per_client = 64;
    int64_t max_bytes_per_client = int64_t{64} << 30;
    // How long a handle from the region socket waits to be claimed.
    std::chrono::seconds pending_ttl{60};
    // Most unclaimed handles per socket connection.
    int max_pending_per_connection = 64;
    // Imports a GPU region (its fields already checked) on the backend's GPU: REGION_KIND_CUDA
    // from the request's cuda_ipc_handle (vmm_fd -1), REGION_KIND_CUDA_VMM from vmm_fd (borrowed:
    // the registry closes it). Null: the backend has no GPU, and such regions are refused.
    std::function<absl::StatusOr<std::unique_ptr<SharedRegion>>(
        const v1::RegisterRegionRequest&, int vmm_fd)>
        import_gpu;
    // Registers a host region's mapping (data, bytes) with the backend's device for direct
    // transfers and returns what undoes it (Backend::RegisterHostMemory); null: host regions are
    // read and written by the backend as plain host memory (the CPU backend, or staging).
    std::function<absl::StatusOr<std::function<void()>>(char*, uint64_t)> register_host;
    // Most host-region bytes registered with the device at once, over every client (they are
    // page-locked: resident, never swapped). A region past it is used through the backend's
    // staging instead, and counted. 0: none is registered.
    int64_t max_registered_host_bytes = int64_t{32} << 30;
  };
  // metrics (borrowed, may be null) gets the registered regions' totals on every change; it must
  // outlive every region, including those requests still hold after the registry is gone.
  RegionRegistry(Options options, Metrics* metrics) : options_(options), metrics_(metrics) {
    PublishLocked();
  }

  const Options& options() const { return options_; }

  // Parks a mapped region under a fresh handle, tied to socket connection `connection` (for
  // DropConnection). A null region makes a lease: a handle that ties a GPU region, registered
  // with it, to the connection. RESOURCE_EXHAUSTED past max_pending_per_connection.
  absl::StatusOr<std::string> AddPending(std::shared_ptr<SharedRegion> region, uint64_t connection);
  // Parks fd, the POSIX file descriptor of a CUDA VMM allocation (taken: closed when the handle
  // is claimed, expires or its connection closes), likewise.
  absl::StatusOr<std::string> AddPendingVmm(int fd, uint64_t connection);

  // Claims `handle` as region `name` of `owner`. Errors name the field (name, handle, kind).
  absl::StatusOr<v1::RegionInfo> Register(const std::string& owner,
                                          const v1::RegisterRegionRequest& request);
  // NOT_FOUND when owner has no region of that name.
  absl::Status Unregister(const std::string& owner, const std::string& name);
  std::vector<v1::RegionInfo> List(const std::string& owner) const;
  // The region, held for the caller; NOT_FOUND (naming `field`) when owner has none of that name.
  absl::StatusOr<std::shared_ptr<SharedRegion>> Find(const std::string& owner,
                                                     const std::string& name,
                                                     const std::string& field) const;
  // The socket connection is gone (its client exited): its pending handles and every region
  // registered with one of its handles are dropped (unmapped once no request holds them).
  void DropConnection(uint64_t connection);

  // Regions registered now, over all identities (for tests and metrics).
  int64_t RegionCount() const;
  // Host-region bytes registered with the device now, including regions already unregistered
  // that requests still hold.
  int64_t RegisteredHostBytes() const { return registered_host_bytes_->load(); }

 private:
  // A descriptor the registry owns, closed with the last copy of its shared_ptr.
  struct OwnedFd {
    explicit OwnedFd(int f) : fd(f) {}
    ~OwnedFd();
    OwnedFd(const OwnedFd&) = delete;
    OwnedFd& operator=(const OwnedFd&) = delete;
    const int fd;
  };
  struct Pending {
    std::shared_ptr<SharedRegion> region;
    std::shared_ptr<const OwnedFd> vmm_fd;  // a VMM allocation's descriptor instead of a region
    uint64_t connection = 0;
    std::chrono::steady_clock::time_point expires;
    // A Register call is registering it with the device (outside the lock); it stays here
    // meanwhile so that DropConnection still reaches it, and no other call can claim it.
    bool claiming = false;
  };
  struct Entry {
    std::shared_ptr<SharedRegion> region;
    uint64_t connection = 0;
    v1::RegionKind kind = v1::REGION_KIND_HOST;
  };
  struct Owner {
    std::map<std::string, Entry> regions;
    uint64_t bytes = 0;
  };

  // Sends the totals per kind to metrics_ (mu_ held, or during construction).
  void PublishLocked() const;
  void ExpirePendingLocked(std::chrono::steady_clock::time_point now);
  // The checks of a new region under mu_: its name is free and the owner's limits hold with it.
  absl::Status CheckRoomLocked(const Owner& o, const std::string& name, uint64_t size) const;
  absl::StatusOr<v1::RegionInfo> RegisterGpu(const std::string& owner,
                                             const v1::RegisterRegionRequest& request);
  // Takes the pending handle of a GPU region: a lease (REGION_KIND_CUDA, optional) or a VMM
  // descriptor's (REGION_KIND_CUDA_VMM, into *vmm_fd); its connection into *connection.
  absl::Status ClaimGpuHandle(const v1::RegisterRegionRequest& request, uint64_t* connection,
                              std::shared_ptr<const OwnedFd>* vmm_fd);
  absl::StatusOr<std::string> AddPendingLocked(Pending p);
  v1::RegionInfo InsertLocked(const std::string& owner, const std::string& name, Entry e);
  static v1::RegionInfo InfoOf(const std::string& name, const Entry& e);
  // Registers region (claimed by the caller, not yet visible to requests) with the device when
  // options_.register_host is set, it is not registered yet and max_registered_host_bytes has
  // room; otherwise, or when the backend refuses, leaves it unregistered (served through
  // staging) and counts why.
  void RegisterWithDevice(SharedRegion& region) const;

  const Options options_;
  Metrics* const metrics_;
  mutable std::mutex mu_;
  std::map<std::string, Pending> pending_;  // by handle
  std::map<std::string, Owner> owners_;     // by identity
  // Shared with each registration's undo, which may run after the registry is gone (the last
  // request holding an unregistered region lets go of it).
  const std::shared_ptr<std::atomic<int64_t>> registered_host_bytes_ =
      std::make_shared<std::atomic<int64_t>>(0);
};

// Checks a region name: 1-64 characters of [A-Za-z0-9_.-].
absl::Status CheckRegionName(const std::string& name, const std::string& field);

}  // namespace attn
