#include "fuzz_env.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn/kernels/cpu_attention.h"
#include "engine/backend.h"
#include "rpc/attend_validation.h"

namespace attn::fuzz {
namespace {

// A sealed memfd of `bytes`, mapped, parked in registry and claimed as host region `name`.
char* RegisterHost(RegionRegistry& registry, const char* name, uint64_t bytes) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    std::abort();
  }
  auto region = SharedRegion::MapMemfd(fd, bytes);
  close(fd);
  if (!region.ok()) std::abort();
  char* data = (*region)->data();
  auto handle = registry.AddPending(std::move(*region), 1);
  v1::RegisterRegionRequest r;
  r.set_name(name);
  r.set_kind(v1::REGION_KIND_HOST);
  r.set_handle(handle.value());
  if (!registry.Register(FuzzRegions::kOwner, r).ok()) std::abort();
  return data;
}

RegionRegistry::Options RegistryOptions(char* gpu_memory) {
  RegionRegistry::Options o;
  o.import_gpu = [gpu_memory](const v1::RegisterRegionRequest& r,
                              int) -> absl::StatusOr<std::unique_ptr<SharedRegion>> {
    return SharedRegion::Gpu(gpu_memory, r.bytes(), [] {});
  };
  return o;
}

}  // namespace

FuzzRegions& FuzzRegions::Get() {
  static FuzzRegions* regions = new FuzzRegions();
  return *regions;
}

FuzzRegions::FuzzRegions()
    : gpu_memory_(static_cast<char*>(std::aligned_alloc(256, kG0Bytes)), &std::free),
      registry_(RegistryOptions(gpu_memory_.get()), nullptr) {
  r0_ = {RegisterHost(registry_, "r0", kR0Bytes), kR0Bytes};
  r1_ = {RegisterHost(registry_, "r1", kR1Bytes), kR1Bytes};
  v1::RegisterRegionRequest g;
  g.set_name("g0");
  g.set_kind(v1::REGION_KIND_CUDA);
  g.set_cuda_ipc_handle(std::string(64, '\1'));
  g.set_bytes(kG0Bytes);
  if (!registry_.Register(kOwner, g).ok()) std::abort();
  g0_ = {gpu_memory_.get(), kG0Bytes};
}

void FuzzRegions::Fill(uint32_t seed) {
  // Windows of one pattern, made once: a copy per input instead of a generator per byte.
  constexpr uint64_t kShifts = 1 << 16;
  static const std::vector<char>* pattern = [] {
    auto* p = new std::vector<char>(kShifts + kR0Bytes + kR1Bytes + kG0Bytes);
    uint32_t x = 12345;
    for (char& c : *p) {
      x = x * 1664525u + 1013904223u;
      const uint8_t r = static_cast<uint8_t>(x >> 24);
      // Sign bit random, the next bit 0: no 16-bit half (and no float32) has an all-ones
      // exponent, and magnitudes stay below about 2.
      c = static_cast<char>((r & 0x80) | (r & 0x3f));
    }
    return p;
  }();
  const char* from = pattern->data() + (uint64_t{seed} * 7919) % kShifts;
  for (const Span& s : {r0_, r1_, g0_}) {
    std::memcpy(s.data, from, s.bytes);
    from += s.bytes;
  }
}

std::string FuzzRegions::CheckResolved(const Job& job) const {
  const uint64_t elem = kernels::DTypeSize(job.key.wire_dtype);
  const uint64_t o_bytes = job.q_bytes.size();
  const uint64_t lse_bytes = 4 * uint64_t(job.total_q) * job.key.num_heads;
  struct Tensor {
    const char* data;
    uint64_t bytes, align;
    const char* name;
  };
  std::vector<Tensor> tensors = {{job.q_bytes.data(), job.q_bytes.size(), elem, "q"},
                                 {job.k_bytes.data(), job.k_bytes.size(), elem, "k"},
                                 {job.v_bytes.data(), job.v_bytes.size(), elem, "v"}};
  if (job.o_out != nullptr) tensors.push_back({job.o_out, o_bytes, elem, "o"});
  if (job.lse_out != nullptr) tensors.push_back({job.lse_out, lse_bytes, 4, "lse"});
  for (const Tensor& t : tensors) {
    if (reinterpret_cast<uintptr_t>(t.data) % t.align != 0) {
      return absl::StrCat(t.name, " resolved to an address that is not a multiple of ", t.align);
    }
    for (const Span& s : {r0_, r1_, g0_}) {
      const bool starts_inside = t.data >= s.data && t.data < s.data + s.bytes;
      if (starts_inside && t.bytes > uint64_t(s.data + s.bytes - t.data)) {
        return absl::StrCat(t.name, " resolved past the end of its region");
      }
    }
  }
  return "";
}

std::string ComputeAttendOnCpu(AttendJob& job, const v1::AttendRequest& request,
                               v1::AttendResponse* response) {
  const bool o_in_region = job.o_out != nullptr;
  const bool lse_in_region = job.lse_out != nullptr;
  PrepareAttendResponse(job, request, response);
  PrepareHostOutputs(job);  // as the CPU backend's Prepare
  const kernels::AttentionArgs args = job.HostArgs();
  if (kernels::Status st = kernels::ValidateCommon(args); !st.ok()) {
    return absl::StrCat("validated request fails kernels::ValidateCommon: ", st.message());
  }
  if (kernels::Status st = kernels::cpu::CanImplement(args); !st.ok()) {
    return absl::StrCat("validated request fails cpu::CanImplement: ", st.message());
  }
  std::vector<char> workspace(kernels::cpu::WorkspaceBytes(args, 1) + 64);
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data()) + 63) &
                                     ~uintptr_t{63});
  if (kernels::Status st = kernels::cpu::Run(args, ws, nullptr); !st.ok()) {
    return absl::StrCat("cpu::Run failed on a validated request: ", st.message());
  }
  if (!o_in_region) {
    response->mutable_o()->set_data(job.o.data, job.o.size);
    job.o_out = nullptr;
  }
  if (job.return_lse && !lse_in_region) {
    response->mutable_lse()->set_data(job.lse.data, job.lse.size);
    job.lse_out = nullptr;
  }
  return "";
}

std::vector<std::string_view> PiecesOf(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> pieces;
  size_t start = 0;
  for (size_t i = 0; i < size; ++i) {
    if ((data[i] & 7) == 5 || i == size / 3 || i == 2 * size / 3) {
      pieces.push_back(bytes.substr(start, i + 1 - start));
      start = i + 1;
    }
  }
  pieces.push_back(bytes.substr(start));
  return pieces;
}

}  // namespace attn::fuzz
