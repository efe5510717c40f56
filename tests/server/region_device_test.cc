// Regions as a device backend meets them, with the device faked (no GPU needed): host regions
// registered with the device once at RegisterRegion and unregistered only after the last request
// holding them, before the unmapping; the cap and a refusal leaving a region to staging; and GPU
// regions named by a session step or an Attend (all or nothing, bounds, overlap, offsets that are
// not a multiple of the element size, refused by name where the backend has no GPU); CUDA VMM
// descriptors handed to the import once and closed after it, or with their connection, and not
// claimable as another kind.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/attend_job.h"
#include "sessions/step_job.h"
#include "transport/region_registry.h"
#include "transport/tensor_source.h"

namespace attn {
namespace {

constexpr uint64_t kHostBytes = 1 << 16;
constexpr uint64_t kGpuBytes = 1 << 16;

// Step shape of every test: 3 new tokens, 4 heads, 2 KV heads, d = 64, bf16.
constexpr int32_t kTokens = 3, kHeads = 4, kKvHeads = 2, kDim = 64;
constexpr uint64_t kQBytes = uint64_t{kTokens} * kHeads * kDim * 2;
constexpr uint64_t kKvBytes = uint64_t{kTokens} * kKvHeads * kDim * 2;
constexpr uint64_t kLseBytes = uint64_t{kTokens} * kHeads * 4;

// What the fake device saw.
struct FakeDevice {
  int registered = 0;
  int unregistered = 0;
  bool mapped_at_unregister = true;
  bool refuse = false;
  int vmm_fd = -1;  // the descriptor the last VMM import got
};

// True when the page at p is mapped in this process.
bool Mapped(const void* p) {
  const long page = sysconf(_SC_PAGESIZE);
  unsigned char vec = 0;
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(page - 1));
  return mincore(start, 1, &vec) == 0;
}

std::string MemfdHandle(RegionRegistry& registry, uint64_t bytes) {
  const int fd = memfd_create("r", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  auto region = SharedRegion::MapMemfd(fd, bytes);
  close(fd);
  EXPECT_TRUE(region.ok()) << region.status();
  auto handle = registry.AddPending(std::move(*region), 1);
  EXPECT_TRUE(handle.ok()) << handle.status();
  return *handle;
}

RegionRegistry::Options DeviceOptions(FakeDevice* device, int64_t cap = int64_t{1} << 30) {
  RegionRegistry::Options o;
  o.max_registered_host_bytes = cap;
  o.register_host = [device](char* data,
                             uint64_t) -> absl::StatusOr<std::function<void()>> {
    if (device->refuse) return absl::ResourceExhaustedError("no more page-locked memory");
    ++device->registered;
    return std::function<void()>([device, data] {
      ++device->unregistered;
      device->mapped_at_unregister = device->mapped_at_unregister && Mapped(data);
    });
  };
  // GPU regions at a host address that nothing dereferences: only their bounds are used here.
  o.import_gpu = [device](const v1::RegisterRegionRequest& r, int vmm_fd)
      -> absl::StatusOr<std::unique_ptr<SharedRegion>> {
    static char fake_device_memory[4 * kGpuBytes];
    if (vmm_fd >= 0) {
      // Open while the import runs.
      EXPECT_NE(fcntl(vmm_fd, F_GETFD), -1);
      device->vmm_fd = vmm_fd;
    }
    return SharedRegion::Gpu(fake_device_memory, r.bytes(), [] {});
  };
  return o;
}

v1::RegisterRegionRequest HostRegistration(const std::string& name, const std::string& handle) {
  v1::RegisterRegionRequest r;
  r.set_name(name);
  r.set_kind(v1::REGION_KIND_HOST);
  r.set_handle(handle);
  return r;
}

v1::RegisterRegionRequest GpuRegistration(const std::string& name) {
  v1::RegisterRegionRequest r;
  r.set_name(name);
  r.set_kind(v1::REGION_KIND_CUDA);
  r.set_cuda_ipc_handle(std::string(64, '\1'));
  r.set_bytes(kGpuBytes);
  return r;
}

v1::RegisterRegionRequest VmmRegistration(const std::string& name, const std::string& handle) {
  v1::RegisterRegionRequest r;
  r.set_name(name);
  r.set_kind(v1::REGION_KIND_CUDA_VMM);
  r.set_handle(handle);
  r.set_bytes(kGpuBytes);
  return r;
}

bool Open(int fd) { return fcntl(fd, F_GETFD) != -1; }

v1::RegionSlice Slice(const std::string& region, uint64_t offset, uint64_t bytes) {
  v1::RegionSlice s;
  s.set_region(region);
  s.set_offset(offset);
  s.set_bytes(bytes);
  return s;
}

// A step whose q, k_new, v_new lie back to back in `in` and whose o then lse lie back to back
// in `out` (from offset out_at).
v1::StepRequest StepIn(const std::string& in, const std::string& out, uint64_t out_at = 0) {
  v1::StepRequest r;
  *r.mutable_q()->mutable_region() = Slice(in, 0, kQBytes);
  *r.mutable_k_new()->mutable_region() = Slice(in, kQBytes, kKvBytes);
  *r.mutable_v_new()->mutable_region() = Slice(in, kQBytes + kKvBytes, kKvBytes);
  *r.mutable_o_region() = Slice(out, out_at, kQBytes);
  r.set_return_lse(true);
  *r.mutable_lse_region() = Slice(out, out_at + kQBytes, kLseBytes);
  return r;
}

std::unique_ptr<StepJob> MakeStepJob() {
  auto job = std::make_unique<StepJob>();
  job->total_q = kTokens;
  job->return_lse = true;
  job->key.wire_dtype = kernels::DType::kBFloat16;
  job->key.num_heads = kHeads;
  job->key.num_kv_heads = kKvHeads;
  job->key.head_dim = kDim;
  return job;
}

TEST(VmmRegionTest, TheDescriptorGoesToTheImportOnceAndIsClosedAfterIt) {
  FakeDevice device;
  RegionRegistry registry(DeviceOptions(&device), nullptr);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  const int fd = pipe_fds[0];
  auto handle = registry.AddPendingVmm(fd, 1);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_TRUE(Open(fd));  // parked, not imported yet
  auto info = registry.Register("me", VmmRegistration("gpu", *handle));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->kind(), v1::REGION_KIND_CUDA_VMM);
  EXPECT_EQ(info->bytes(), kGpuBytes);
  EXPECT_EQ(device.vmm_fd, fd);
  EXPECT_FALSE(Open(fd));  // the mapping keeps the memory; the descriptor is gone
  // Claimed once.
  EXPECT_EQ(registry.Register("me", VmmRegistration("again", *handle)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The region goes with the connection that carried its descriptor.
  registry.DropConnection(1);
  EXPECT_EQ(registry.RegionCount(), 0);
  close(pipe_fds[1]);
}

TEST(VmmRegionTest, AnUnclaimedDescriptorIsClosedWithItsConnection) {
  FakeDevice device;
  RegionRegistry registry(DeviceOptions(&device), nullptr);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  ASSERT_TRUE(registry.AddPendingVmm(pipe_fds[0], 3).ok());
  EXPECT_TRUE(Open(pipe_fds[0]));
  registry.DropConnection(3);
  EXPECT_FALSE(Open(pipe_fds[0]));
  EXPECT_EQ(device.vmm_fd, -1);
  close(pipe_fds[1]);
}

TEST(VmmRegionTest, HandlesAreNotClaimableAsAnotherKind) {
  FakeDevice device;
  RegionRegistry registry(DeviceOptions(&device), nullptr);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  auto vmm = registry.AddPendingVmm(pipe_fds[0], 1);
  ASSERT_TRUE(vmm.ok());
  const std::string memfd = MemfdHandle(registry, kHostBytes);
  auto lease = registry.AddPending(nullptr, 1);
  ASSERT_TRUE(lease.ok());
  auto expect = [&](const v1::RegisterRegionRequest& r, const std::string& part) {
    auto st = registry.Register("me", r).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find(part), std::string::npos) << st;
  };
  expect(HostRegistration("h", *vmm), "handle is a CUDA VMM allocation's");
  v1::RegisterRegionRequest legacy = GpuRegistration("c");
  legacy.set_handle(*vmm);
  expect(legacy, "not a lease");
  expect(VmmRegistration("v", memfd), "not a CUDA VMM allocation's");
  expect(VmmRegistration("v", *lease), "not a CUDA VMM allocation's");
  expect(VmmRegistration("v", ""), "handle is empty");
  v1::RegisterRegionRequest with_ipc = VmmRegistration("v", *vmm);
  with_ipc.set_cuda_ipc_handle(std::string(64, '\1'));
  expect(with_ipc, "cuda_ipc_handle must be empty for kind REGION_KIND_CUDA_VMM");
  // None of that claimed the VMM handle, nor closed its descriptor.
  EXPECT_TRUE(Open(pipe_fds[0]));
  EXPECT_TRUE(registry.Register("me", VmmRegistration("v", *vmm)).ok());
  EXPECT_EQ(device.vmm_fd, pipe_fds[0]);
  close(pipe_fds[1]);
}

TEST(HostRegionDeviceTest, RegisteredOnceAndUnregisteredAfterTheLastRequestBeforeUnmapping) {
  FakeDevice device;
  RegionRegistry registry(DeviceOptions(&device), nullptr);
  ASSERT_TRUE(registry.Register("alice", HostRegistration("in", MemfdHandle(registry, kHostBytes)))
                  .ok());
  ASSERT_TRUE(registry.Register("alice", HostRegistration("out", MemfdHandle(registry, kHostBytes)))
                  .ok());
  EXPECT_EQ(device.registered, 2);
  EXPECT_EQ(registry.RegisteredHostBytes(), int64_t{2} * kHostBytes);

  auto job = MakeStepJob();
  ASSERT_TRUE(ResolveStepTensors(StepIn("in", "out"), "alice", &registry, false, job.get()).ok());
  const Job::HostRegistered& r = job->host_registered;
  EXPECT_TRUE(r.q && r.k && r.v && r.o && r.lse);
  EXPECT_FALSE(job->device_tensors);

  // Unregistered while the step holds both: still registered (and mapped) until it lets go.
  ASSERT_TRUE(registry.Unregister("alice", "in").ok());
  ASSERT_TRUE(registry.Unregister("alice", "out").ok());
  EXPECT_EQ(device.unregistered, 0);
  EXPECT_EQ(registry.RegisteredHostBytes(), int64_t{2} * kHostBytes);
  job.reset();
  EXPECT_EQ(device.unregistered, 2);
  EXPECT_TRUE(device.mapped_at_unregister);
  EXPECT_EQ(registry.RegisteredHostBytes(), 0);
}

TEST(HostRegionDeviceTest, RegionsPastTheCapAreLeftToStaging) {
  FakeDevice device;
  RegionRegistry registry(DeviceOptions(&device, kHostBytes + kHostBytes / 2), nullptr);
  ASSERT_TRUE(registry.Register("alice", HostRegistration("in", MemfdHandle(registry, kHostBytes)))
                  .ok());
  // The second would pass the cap: registered as a region, not with the device.
  ASSERT_TRUE(registry.Register("alice", HostRegistration("out", MemfdHandle(registry, kHostBytes)))
                  .ok());
  EXPECT_EQ(device.registered, 1);
  EXPECT_EQ(registry.RegisteredHostBytes(), int64_t{kHostBytes});
  auto job = MakeStepJob();
  ASSERT_TRUE(ResolveStepTensors(StepIn("in", "out"), "alice", &registry, false, job.get()).ok());
  EXPECT_TRUE(job->host_registered.q);
  EXPECT_FALSE(job->host_registered.o);
  EXPECT_FALSE(job->host_registered.lse);
  job.reset();
  // Room again once the first goes.
  ASSERT_TRUE(registry.Unregister("alice", "in").ok());
  ASSERT_TRUE(
      registry.Register("alice", HostRegistration("in2", MemfdHandle(registry, kHostBytes))).ok());
  EXPECT_EQ(device.registered, 2);
}

TEST(HostRegionDeviceTest, ARefusalLeavesTheRegionToStaging) {
  FakeDevice device;
  device.refuse = true;
  RegionRegistry registry(DeviceOptions(&device), nullptr);
  ASSERT_TRUE(registry.Register("alice", HostRegistration("in", MemfdHandle(registry, kHostBytes)))
                  .ok());
  ASSERT_TRUE(registry.Register("alice", HostRegistration("out", MemfdHandle(registry, kHostBytes)))
                  .ok());
  EXPECT_EQ(registry.RegisteredHostBytes(), 0);
  auto job = MakeStepJob();
  ASSERT_TRUE(ResolveStepTensors(StepIn("in", "out"), "alice", &registry, false, job.get()).ok());
  EXPECT_FALSE(job->host_registered.q);
  job.reset();
  ASSERT_TRUE(registry.Unregister("alice", "in").ok());
  EXPECT_EQ(device.unregistered, 0);  // nothing to undo
}

TEST(HostRegionDeviceTest, AClaimRefusedForItsNameKeepsTheHandleAndRegistersNothing) {
  FakeDevice device;
  RegionRegistry registry(DeviceOptions(&device), nullptr);
  ASSERT_TRUE(registry.Register("alice", HostRegistration("in", MemfdHandle(registry, kHostBytes)))
                  .ok());
  const std::string handle = MemfdHandle(registry, kHostBytes);
  EXPECT_EQ(registry.Register("alice", HostRegistration("in", handle)).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(device.registered, 1);
  EXPECT_TRUE(registry.Register("alice", HostRegistration("in2", handle)).ok());
  EXPECT_EQ(device.registered, 2);
}

TEST(HostRegionDeviceTest, AClientGoneWhileItsRegionIsRegisteredLeavesNothingBehind) {
  FakeDevice device;
  RegionRegistry::Options o = DeviceOptions(&device);
  RegionRegistry* registry_ptr = nullptr;
  auto register_host = o.register_host;
  // The client's socket closes while its region is being page-locked.
  o.register_host = [&](char* data, uint64_t bytes) {
    registry_ptr->DropConnection(1);
    return register_host(data, bytes);
  };
  RegionRegistry registry(o, nullptr);
  registry_ptr = &registry;
  const absl::StatusOr<v1::RegionInfo> info =
      registry.Register("alice", HostRegistration("in", MemfdHandle(registry, kHostBytes)));
  EXPECT_EQ(info.status().code(), absl::StatusCode::kFailedPrecondition) << info.status();
  EXPECT_NE(info.status().message().find("handle: the region socket connection"),
            std::string::npos)
      << info.status();
  EXPECT_EQ(registry.RegionCount(), 0);
  EXPECT_EQ(device.registered, 1);
  EXPECT_EQ(device.unregistered, 1);
  EXPECT_EQ(registry.RegisteredHostBytes(), 0);
}

// A registry with GPU region "g" and host region "h" of alice's.
class StepGpuRegionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(registry_.Register("alice", GpuRegistration("g")).ok());
    ASSERT_TRUE(
        registry_.Register("alice", HostRegistration("h", MemfdHandle(registry_, kHostBytes)))
            .ok());
  }
  absl::Status Resolve(const v1::StepRequest& r, bool gpu_regions = true) {
    job_ = MakeStepJob();
    return ResolveStepTensors(r, "alice", &registry_, gpu_regions, job_.get());
  }
  int64_t InFlight(const std::string& name) {
    for (const v1::RegionInfo& info : registry_.List("alice")) {
      if (info.name() == name) return info.in_flight();
    }
    return -1;
  }

  FakeDevice device_;
  RegionRegistry registry_{DeviceOptions(&device_), nullptr};
  std::unique_ptr<StepJob> job_;
};

TEST_F(StepGpuRegionTest, AllInGpuRegionsIsADeviceStep) {
  const uint64_t out_at = 2 * kQBytes;  // o and lse after the inputs, in the same region
  ASSERT_TRUE(Resolve(StepIn("g", "g", out_at)).ok());
  EXPECT_TRUE(job_->device_tensors);
  const char* base = registry_.Find("alice", "g", "g").value()->data();
  EXPECT_EQ(job_->q_bytes.data(), base);
  EXPECT_EQ(job_->k_bytes.data(), base + kQBytes);
  EXPECT_EQ(job_->v_bytes.data(), base + kQBytes + kKvBytes);
  EXPECT_EQ(job_->o_out, base + out_at);
  EXPECT_EQ(job_->lse_out, base + out_at + kQBytes);
  EXPECT_EQ(job_->region_holds.size(), 1u);
  EXPECT_EQ(InFlight("g"), 1);
  job_.reset();
  EXPECT_EQ(InFlight("g"), 0);
  // Without lse: lse_region is not needed.
  v1::StepRequest r = StepIn("g", "g", out_at);
  r.set_return_lse(false);
  r.clear_lse_region();
  EXPECT_TRUE(Resolve(r).ok());
}

struct BadCase {
  std::string name;
  std::function<void(v1::StepRequest&)> corrupt;
  absl::StatusCode code;
  std::string message;  // a part of it, naming the field
};

TEST_F(StepGpuRegionTest, BadGpuStepsAreRefusedByName) {
  constexpr uint64_t kOut = 2 * kQBytes;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const std::vector<BadCase> cases = {
      {"k_new in a host region", [](auto& r) { r.mutable_k_new()->mutable_region()->set_region("h"); },
       absl::StatusCode::kInvalidArgument, "k_new.region must name a GPU region (REGION_KIND_CUDA) too"},
      {"q in a host region", [](auto& r) { r.mutable_q()->mutable_region()->set_region("h"); },
       absl::StatusCode::kInvalidArgument, "q.region must name a GPU region"},
      {"v_new as data",
       [](auto& r) {
         r.mutable_v_new()->clear_region();
         r.mutable_v_new()->set_data(std::string(kKvBytes, 'x'));
       },
       absl::StatusCode::kInvalidArgument, "v_new.region must name a GPU region"},
      {"o into the response", [](auto& r) { r.clear_o_region(); },
       absl::StatusCode::kInvalidArgument, "o_region must name a GPU region"},
      {"o in a host region", [](auto& r) { r.mutable_o_region()->set_region("h"); },
       absl::StatusCode::kInvalidArgument, "o_region must name a GPU region"},
      {"lse into the response", [](auto& r) { r.clear_lse_region(); },
       absl::StatusCode::kInvalidArgument, "lse_region must name a GPU region"},
      {"lse in a host region", [](auto& r) { r.mutable_lse_region()->set_region("h"); },
       absl::StatusCode::kInvalidArgument, "lse_region must name a GPU region"},
      {"q past the end", [](auto& r) { r.mutable_q()->mutable_region()->set_offset(kGpuBytes - 8); },
       absl::StatusCode::kInvalidArgument, "q.region: offset"},
      {"k_new offset overflows",
       [](auto& r) { r.mutable_k_new()->mutable_region()->set_offset(kMax - 4); },
       absl::StatusCode::kInvalidArgument, "k_new.region: offset"},
      {"o past the end", [](auto& r) { r.mutable_o_region()->set_offset(kGpuBytes - 16); },
       absl::StatusCode::kInvalidArgument, "o_region: offset"},
      {"v_new bytes short", [](auto& r) { r.mutable_v_new()->mutable_region()->set_bytes(16); },
       absl::StatusCode::kInvalidArgument, "v_new.region.bytes is 16"},
      {"lse too small", [](auto& r) { r.mutable_lse_region()->set_bytes(4); },
       absl::StatusCode::kInvalidArgument, "lse_region.bytes is 4"},
      {"o overlaps q", [](auto& r) { r.mutable_o_region()->set_offset(8); },
       absl::StatusCode::kInvalidArgument, "o_region overlaps q.region"},
      {"lse overlaps v_new",
       [](auto& r) { r.mutable_lse_region()->set_offset(kQBytes + kKvBytes); },
       absl::StatusCode::kInvalidArgument, "lse_region overlaps v_new.region"},
      {"unknown GPU region", [](auto& r) { r.mutable_k_new()->mutable_region()->set_region("gg"); },
       absl::StatusCode::kNotFound, "k_new.region.region: no region named 'gg'"},
      // Offsets that are not a multiple of the element size (2 for bf16, 4 for lse).
      {"q at an odd offset", [](auto& r) { r.mutable_q()->mutable_region()->set_offset(1); },
       absl::StatusCode::kInvalidArgument,
       "q.region: offset 1 is not a multiple of 2, the size of the tensor's elements"},
      {"k_new at an odd offset",
       [](auto& r) { r.mutable_k_new()->mutable_region()->set_offset(kQBytes + 1); },
       absl::StatusCode::kInvalidArgument, "k_new.region: offset 1537 is not a multiple of 2"},
      {"v_new at an odd offset",
       [](auto& r) { r.mutable_v_new()->mutable_region()->set_offset(kQBytes + kKvBytes + 7); },
       absl::StatusCode::kInvalidArgument, "v_new.region: offset 2311 is not a multiple of 2"},
      {"o at an odd offset", [](auto& r) { r.mutable_o_region()->set_offset(kOut + 1); },
       absl::StatusCode::kInvalidArgument, "o_region: offset 3073 is not a multiple of 2"},
      {"lse at 2 mod 4",
       [](auto& r) { r.mutable_lse_region()->set_offset(kOut + kQBytes + 2); },
       absl::StatusCode::kInvalidArgument, "lse_region: offset 4610 is not a multiple of 4"},
      {"lse at an odd offset",
       [](auto& r) { r.mutable_lse_region()->set_offset(kOut + kQBytes + 3); },
       absl::StatusCode::kInvalidArgument, "lse_region: offset 4611 is not a multiple of 4"},
  };
  for (const BadCase& c : cases) {
    v1::StepRequest r = StepIn("g", "g", kOut);
    c.corrupt(r);
    const absl::Status st = Resolve(r);
    EXPECT_EQ(st.code(), c.code) << c.name << ": " << st;
    EXPECT_NE(st.message().find(c.message), std::string::npos) << c.name << ": " << st;
    job_.reset();
    EXPECT_EQ(InFlight("g"), 0) << c.name << ": a refused step holds nothing";
  }
}

// Element-aligned offsets that are not multiples of 16 are taken (the CUDA backend serves them
// through device copies instead of in place): resolution points at exactly those bytes.
TEST_F(StepGpuRegionTest, ElementAlignedGpuOffsetsAreTaken) {
  constexpr uint64_t kOut = 2 * kQBytes + 34;  // 2 mod 16, past the inputs
  v1::StepRequest r = StepIn("g", "g", kOut);
  r.mutable_q()->mutable_region()->set_offset(2);
  r.mutable_k_new()->mutable_region()->set_offset(kQBytes + 6);
  r.mutable_v_new()->mutable_region()->set_offset(kQBytes + kKvBytes + 10);
  r.mutable_lse_region()->set_offset(kOut + kQBytes + 2);  // 4 mod 16
  const absl::Status st = Resolve(r);
  ASSERT_TRUE(st.ok()) << st;
  const char* base = registry_.Find("alice", "g", "g").value()->data();
  EXPECT_EQ(job_->q_bytes.data(), base + 2);
  EXPECT_EQ(job_->k_bytes.data(), base + kQBytes + 6);
  EXPECT_EQ(job_->v_bytes.data(), base + kQBytes + kKvBytes + 10);
  EXPECT_EQ(job_->o_out, base + kOut);
  EXPECT_EQ(job_->lse_out, base + kOut + kQBytes + 2);
  EXPECT_TRUE(job_->device_tensors);
}

// Attend's tensors in GPU regions: the same offset rule, float32 refused by name as before it.
TEST_F(StepGpuRegionTest, AttendGpuOffsetsFollowTheElementRule) {
  auto attend = [](uint64_t q_at, uint64_t k_at, uint64_t v_at, uint64_t o_at, uint64_t lse_at) {
    v1::AttendRequest r;
    for (auto [t, at, bytes] : {std::tuple{r.mutable_q(), q_at, kQBytes},
                                std::tuple{r.mutable_k(), k_at, kKvBytes},
                                std::tuple{r.mutable_v(), v_at, kKvBytes}}) {
      t->set_dtype(v1::DTYPE_BFLOAT16);
      *t->mutable_region() = Slice("g", at, bytes);
    }
    *r.mutable_o_region() = Slice("g", o_at, kQBytes);
    r.set_return_lse(true);
    *r.mutable_lse_region() = Slice("g", lse_at, kLseBytes);
    return r;
  };
  std::unique_ptr<AttendJob> job;
  auto resolve = [&](const v1::AttendRequest& r) {
    job = std::make_unique<AttendJob>();
    job->total_q = job->total_k = kTokens;
    job->return_lse = true;
    job->key.wire_dtype = kernels::DType::kBFloat16;
    job->key.num_heads = kHeads;
    job->key.num_kv_heads = kKvHeads;
    job->key.head_dim = kDim;
    return ResolveAttendTensors(r, "alice", &registry_, job.get());
  };
  constexpr uint64_t kK = kQBytes, kV = kQBytes + kKvBytes, kO = 2 * kQBytes,
                     kLse = 3 * kQBytes;
  EXPECT_TRUE(resolve(attend(0, kK, kV, kO, kLse)).ok());
  EXPECT_TRUE(resolve(attend(2, kK + 2, kV + 2, kO + 2, kLse + 4)).ok());
  const std::vector<std::pair<v1::AttendRequest, std::string>> bad = {
      {attend(1, kK, kV, kO, kLse), "q.region: offset 1 is not a multiple of 2"},
      {attend(0, kK + 1, kV, kO, kLse), "k.region: offset 1537 is not a multiple of 2"},
      {attend(0, kK, kV + 3, kO, kLse), "v.region: offset 2307 is not a multiple of 2"},
      {attend(0, kK, kV, kO + 1, kLse), "o_region: offset 3073 is not a multiple of 2"},
      {attend(0, kK, kV, kO, kLse + 2), "lse_region: offset 4610 is not a multiple of 4"},
  };
  for (const auto& [r, message] : bad) {
    const absl::Status st = resolve(r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << message << ": " << st;
    EXPECT_NE(st.message().find(message), std::string::npos) << st;
    job.reset();
    EXPECT_EQ(InFlight("g"), 0) << message << ": a refused request holds nothing";
  }
}

TEST_F(StepGpuRegionTest, ABackendWithoutAGpuRefusesGpuStepsByName) {
  for (const std::string field : {"q", "o_region", "lse_region"}) {
    v1::StepRequest r = StepIn("h", "h", 2 * kQBytes);
    if (field == "q") r.mutable_q()->mutable_region()->set_region("g");
    if (field == "o_region") r.mutable_o_region()->set_region("g");
    if (field == "lse_region") r.mutable_lse_region()->set_region("g");
    const absl::Status st = Resolve(r, /*gpu_regions=*/false);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    const std::string named = field == "q" ? "q.region" : field;
    EXPECT_NE(st.message().find(named + " names a GPU region, but this attnd's backend has no GPU"),
              std::string::npos)
        << st;
  }
  // Host regions alone are fine there.
  EXPECT_TRUE(Resolve(StepIn("h", "h", 2 * kQBytes), false).ok());
}

}  // namespace
}  // namespace attn
