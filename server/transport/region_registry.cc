#include "transport/region_registry.h"

#include <unistd.h>

#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "observability/metrics.h"

namespace attn {
namespace {

// 128 random bits as hex: a handle is a capability for one mapped memfd until claimed, so it
// must not be guessable by another local client.
std::string NewHandle() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

}  // namespace

absl::Status CheckRegionName(const std::string& name, const std::string& field) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must have 1 to 64 characters, got ", name.size()));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " may hold only A-Z, a-z, 0-9, '_', '.' and '-'"));
    }
  }
  return absl::OkStatus();
}

void RegionRegistry::ExpirePendingLocked(std::chrono::steady_clock::time_point now) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = it->second.expires <= now ? pending_.erase(it) : std::next(it);
  }
}

RegionRegistry::OwnedFd::~OwnedFd() { ::close(fd); }

absl::StatusOr<std::string> RegionRegistry::AddPending(std::shared_ptr<SharedRegion> region,
                                                       uint64_t connection) {
  Pending p;
  p.region = std::move(region);
  p.connection = connection;
  std::lock_guard<std::mutex> lock(mu_);
  return AddPendingLocked(std::move(p));
}

absl::StatusOr<std::string> RegionRegistry::AddPendingVmm(int fd, uint64_t connection) {
  Pending p;
  p.vmm_fd = std::make_shared<const OwnedFd>(fd);
  p.connection = connection;
  std::lock_guard<std::mutex> lock(mu_);
  return AddPendingLocked(std::move(p));
}

absl::StatusOr<std::string> RegionRegistry::AddPendingLocked(Pending p) {
  const auto now = std::chrono::steady_clock::now();
  ExpirePendingLocked(now);
  int on_connection = 0;
  for (const auto& [handle, q] : pending_) on_connection += q.connection == p.connection;
  if (on_connection >= options_.max_pending_per_connection) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection has ", on_connection, " unclaimed handles; claim them with "
        "RegisterRegion first"));
  }
  std::string handle = NewHandle();
  p.expires = now + options_.pending_ttl;
  pending_[handle] = std::move(p);
  return handle;
}

v1::RegionInfo RegionRegistry::InfoOf(const std::string& name, const Entry& e) {
  v1::RegionInfo info;
  info.set_name(name);
  info.set_kind(e.kind);
  info.set_bytes(e.region->size());
  // The registry's own reference is not a request's.
  info.set_in_flight(e.region.use_count() - 1);
  return info;
}

absl::StatusOr<v1::RegionInfo> RegionRegistry::Register(const std::string& owner,
                                                        const v1::RegisterRegionRequest& r) {
  if (absl::Status st = CheckRegionName(r.name(), "name"); !st.ok()) return st;
  if (r.kind() == v1::REGION_KIND_CUDA || r.kind() == v1::REGION_KIND_CUDA_VMM) {
    return RegisterGpu(owner, r);
  }
  if (r.kind() != v1::REGION_KIND_HOST) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind must be REGION_KIND_HOST, REGION_KIND_CUDA or REGION_KIND_CUDA_VMM, got ", r.kind()));
  }
  if (r.handle().empty()) {
    return absl::InvalidArgumentError(
        "handle is empty: pass the memfd over the region socket (ListRegions.socket_path) first");
  }
  std::shared_ptr<SharedRegion> region;
  {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    ExpirePendingLocked(now);
    auto p = pending_.find(r.handle());
    if (p == pending_.end() || p->second.claiming) {
      return absl::InvalidArgumentError(
          "handle is unknown, expired (60 s) or already claimed; pass the memfd over the region "
          "socket again");
    }
    if (p->second.vmm_fd != nullptr) {
      return absl::InvalidArgumentError(
          "handle is a CUDA VMM allocation's (kind REGION_KIND_CUDA_VMM), not a memfd's");
    }
    if (p->second.region == nullptr) {
      return absl::InvalidArgumentError(
          "handle is a lease for a GPU region (kind REGION_KIND_CUDA), not a memfd's");
    }
    if (absl::Status st = CheckRoomLocked(owners_[owner], r.name(), p->second.region->size());
        !st.ok()) {
      return st;  // the handle stays pending: the client may claim it under another name
    }
    p->second.claiming = true;
    region = p->second.region;
  }
  // Page-locking takes time in proportion to the size (every page is faulted in and locked):
  // paid here once per region rather than on every request, outside the lock, on this
  // RegisterRegion call's thread. No request can reach the region meanwhile.
  RegisterWithDevice(*region);
  std::lock_guard<std::mutex> lock(mu_);
  auto p = pending_.find(r.handle());
  if (p == pending_.end()) {
    // DropConnection (or the handle's expiry) took it meanwhile: the client is gone.
    return absl::FailedPreconditionError(
        "handle: the region socket connection that passed the memfd closed while it was being "
        "registered");
  }
  p->second.claiming = false;
  if (absl::Status st = CheckRoomLocked(owners_[owner], r.name(), region->size()); !st.ok()) {
    return st;  // another call took the name or the room meanwhile; the handle stays pending
  }
  Entry e{std::move(p->second.region), p->second.connection, v1::REGION_KIND_HOST};
  pending_.erase(p);
  return InsertLocked(owner, r.name(), std::move(e));
}

// Why the GPU may DMA straight into a client's memfd: MapMemfd maps only memfds sealed against
// shrinking, so the file keeps at least the mapped size for the mapping's life and no access
// inside it can meet a page past the end of the file (no SIGBUS, for the CPU nor for the DMA
// engine). The one way left to take pages from under the mapping is punching a hole
// (fallocate FALLOC_FL_PUNCH_HOLE, which F_SEAL_SHRINK does not forbid): the kernel then drops
// those pages from the file, but pages that cudaHostRegister pinned keep their reference and stay
// allocated until cudaHostUnregister, so the GPU goes on reading and writing the now-orphaned
// pages. That only makes this client's own requests see stale inputs or lose their outputs:
// nothing of attnd's or of another client's is touched (and a later CPU access of a punched page
// faults in a fresh zero page, the size being unchanged). Unregistering runs before unmapping,
// once no request holds the region (SharedRegion's destructor).
void RegionRegistry::RegisterWithDevice(SharedRegion& region) const {
  // Registered already when an earlier claim of its handle was refused after registering it.
  if (!options_.register_host || region.device_registered()) return;
  const auto bytes = static_cast<int64_t>(region.size());
  // Reserve the bytes first, so that concurrent registrations cannot overshoot the cap.
  const int64_t before = registered_host_bytes_->fetch_add(bytes);
  if (before + bytes > options_.max_registered_host_bytes) {
    registered_host_bytes_->fetch_sub(bytes);
    if (metrics_ != nullptr) metrics_->AddSharedMemoryRegistrationFallback("limit");
    return;
  }
  absl::StatusOr<std::function<void()>> undo = options_.register_host(region.data(), region.size());
  if (!undo.ok()) {
    registered_host_bytes_->fetch_sub(bytes);
    if (metrics_ != nullptr) metrics_->AddSharedMemoryRegistrationFallback("error");
    std::fprintf(stderr, "attnd: a host region of %lld bytes is served through staging: %s\n",
                 static_cast<long long>(bytes), std::string(undo.status().message()).c_str());
    return;
  }
  if (metrics_ != nullptr) metrics_->AddSharedMemoryRegisteredBytes(bytes);
  // metrics_ outlives every region (attnd destroys the registry, and drains the requests that
  // hold regions, before its metrics).
  region.SetDeviceRegistration(
      [undo = std::move(*undo), total = registered_host_bytes_, metrics = metrics_, bytes] {
        undo();
        total->fetch_sub(bytes);
        if (metrics != nullptr) metrics->AddSharedMemoryRegisteredBytes(-bytes);
      });
}

absl::Status RegionRegistry::CheckRoomLocked(const Owner& o, const std::string& name,
                                             uint64_t size) const {
  if (o.regions.count(name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("name: a region named '", name,
                                                 "' is already registered; unregister it first"));
  }
  if (static_cast<int64_t>(o.regions.size()) >= options_.max_regions_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this client has ", o.regions.size(), " regions, the most allowed "
        "(attnd's --shm_max_regions_per_client)"));
  }
  if (size > static_cast<uint64_t>(options_.max_bytes_per_client) ||
      o.bytes + size > static_cast<uint64_t>(options_.max_bytes_per_client)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this client's regions would map ", o.bytes, " + ", size, " bytes, over the ",
        options_.max_bytes_per_client, "-byte limit (attnd's --shm_max_bytes_per_client)"));
  }
  return absl::OkStatus();
}

v1::RegionInfo RegionRegistry::InsertLocked(const std::string& owner, const std::string& name,
                                            Entry e) {
  Owner& o = owners_[owner];
  o.bytes += e.region->size();
  auto [it, inserted] = o.regions.emplace(name, std::move(e));
  PublishLocked();
  return InfoOf(it->first, it->second);
}

void RegionRegistry::PublishLocked() const {
  if (metrics_ == nullptr) return;
  Metrics::RegionTotals t;
  for (const auto& [owner, o] : owners_) {
    for (const auto& [name, e] : o.regions) {
      const auto bytes = static_cast<int64_t>(e.region->size());
      if (e.region->on_gpu()) {
        ++t.cuda_regions;
        t.cuda_bytes += bytes;
      } else {
        ++t.host_regions;
        t.host_bytes += bytes;
      }
    }
  }
  metrics_->SetSharedMemoryRegions(t);
}

absl::Status RegionRegistry::ClaimGpuHandle(const v1::RegisterRegionRequest& r,
                                            uint64_t* connection,
                                            std::shared_ptr<const OwnedFd>* vmm_fd) {
  const bool vmm = r.kind() == v1::REGION_KIND_CUDA_VMM;
  if (vmm && r.handle().empty()) {
    return absl::InvalidArgumentError(
        "handle is empty: pass the allocation's file descriptor over the region socket "
        "(ATTNVM01) first");
  }
  if (r.handle().empty()) return absl::OkStatus();  // kept until unregistered (or attnd exits)
  std::lock_guard<std::mutex> lock(mu_);
  ExpirePendingLocked(std::chrono::steady_clock::now());
  auto p = pending_.find(r.handle());
  const bool fits = p != pending_.end() && !p->second.claiming && p->second.region == nullptr &&
                    (p->second.vmm_fd != nullptr) == vmm;
  if (!fits) {
    return absl::InvalidArgumentError(
        vmm ? "handle is unknown, expired (60 s), already claimed or not a CUDA VMM "
              "allocation's; pass the file descriptor over the region socket (ATTNVM01) again"
            : "handle is unknown, expired (60 s), already claimed or not a lease; ask the region "
              "socket for a lease (ATTNLS01) or leave handle empty");
  }
  // The region goes when the socket connection that carried the handle closes.
  *connection = p->second.connection;
  *vmm_fd = std::move(p->second.vmm_fd);
  pending_.erase(p);
  return absl::OkStatus();
}

// GPU regions are imported at registration; that costs about a millisecond, so it runs outside
// the lock, between a check of the room and a second one.
absl::StatusOr<v1::RegionInfo> RegionRegistry::RegisterGpu(const std::string& owner,
                                                           const v1::RegisterRegionRequest& r) {
  const bool vmm = r.kind() == v1::REGION_KIND_CUDA_VMM;
  if (vmm && !r.cuda_ipc_handle().empty()) {
    return absl::InvalidArgumentError(
        "cuda_ipc_handle must be empty for kind REGION_KIND_CUDA_VMM (its memory comes as a file "
        "descriptor over the region socket)");
  }
  if (!vmm && r.cuda_ipc_handle().size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc_handle must be the 64 bytes of a cudaIpcMemHandle_t, got ",
        r.cuda_ipc_handle().size()));
  }
  if (r.bytes() == 0) return absl::InvalidArgumentError("bytes must be > 0 for a GPU region");
  if (r.device_id() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device_id must be >= 0, got ", r.device_id()));
  }
  uint64_t connection = 0;
  std::shared_ptr<const OwnedFd> vmm_fd;  // closed as this returns: a mapping keeps the memory
  RETURN_IF_ERROR(ClaimGpuHandle(r, &connection, &vmm_fd));
  if (!options_.import_gpu) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kind ", v1::RegionKind_Name(r.kind()), ": GPU regions need attnd's CUDA backend; this "
        "attnd has no GPU (use REGION_KIND_HOST)"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto o = owners_.find(owner);
    if (absl::Status st = CheckRoomLocked(o == owners_.end() ? Owner() : o->second, r.name(),
                                          r.bytes());
        !st.ok()) {
      return st;
    }
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      options_.import_gpu(r, vmm_fd != nullptr ? vmm_fd->fd : -1);
  if (!region.ok()) return region.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status st = CheckRoomLocked(owners_[owner], r.name(), (*region)->size()); !st.ok()) {
    return st;  // another call took the name or the room meanwhile; the import is closed
  }
  return InsertLocked(owner, r.name(), Entry{std::move(*region), connection, r.kind()});
}

absl::Status RegionRegistry::Unregister(const std::string& owner, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto o = owners_.find(owner);
  if (o == owners_.end() || o->second.regions.count(name) == 0) {
    return absl::NotFoundError(absl::StrCat("name: no region named '", name, "' is registered"));
  }
  auto it = o->second.regions.find(name);
  o->second.bytes -= it->second.region->size();
  o->second.regions.erase(it);  // requests holding it keep it mapped until they finish
  if (o->second.regions.empty()) owners_.erase(o);
  PublishLocked();
  return absl::OkStatus();
}

std::vector<v1::RegionInfo> RegionRegistry::List(const std::string& owner) const {
  std::vector<v1::RegionInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  auto o = owners_.find(owner);
  if (o == owners_.end()) return out;
  for (const auto& [name, e] : o->second.regions) out.push_back(InfoOf(name, e));
  return out;
}

absl::StatusOr<std::shared_ptr<SharedRegion>> RegionRegistry::Find(const std::string& owner,
                                                                   const std::string& name,
                                                                   const std::string& field) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto o = owners_.find(owner);
  if (o != owners_.end()) {
    auto it = o->second.regions.find(name);
    if (it != o->second.regions.end()) return it->second.region;
  }
  // Another identity's region is reported exactly as a missing one: its name is not disclosed.
  return absl::NotFoundError(absl::StrCat(field, ": no region named '", name,
                                          "' is registered by this client"));
}

void RegionRegistry::DropConnection(uint64_t connection) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = it->second.connection == connection ? pending_.erase(it) : std::next(it);
  }
  for (auto o = owners_.begin(); o != owners_.end();) {
    auto& regions = o->second.regions;
    for (auto it = regions.begin(); it != regions.end();) {
      if (it->second.connection == connection) {
        o->second.bytes -= it->second.region->size();
        it = regions.erase(it);
      } else {
        ++it;
      }
    }
    o = regions.empty() ? owners_.erase(o) : std::next(o);
  }
  PublishLocked();
}

int64_t RegionRegistry::RegionCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [owner, o] : owners_) n += static_cast<int64_t>(o.regions.size());
  return n;
}

}  // namespace attn
