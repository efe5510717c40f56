#include "bench_region.h"

#include <cstring>

#ifdef ATTN_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/str_cat.h"

namespace attn::client {
namespace {

v1::Tensor InRegion(const v1::Tensor& t, const std::string& name, uint64_t offset) {
  v1::Tensor out;
  out.set_dtype(t.dtype());
  *out.mutable_shape() = t.shape();
  *out.mutable_region() = RegionSliceOf(name, offset, t.data().size());
  return out;
}

// GPU memory of `bytes` on device 0 holding `host`'s bytes at its start, and its IPC handle.
absl::Status MakeGpuRegion([[maybe_unused]] uint64_t bytes, [[maybe_unused]] const std::string& host,
                           [[maybe_unused]] void** device, [[maybe_unused]] std::string* handle) {
#ifdef ATTN_BENCH_CUDA
  if (cudaSetDevice(0) != cudaSuccess || cudaMalloc(device, bytes) != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes failed"));
  }
  if (cudaMemcpy(*device, host.data(), host.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
    return absl::InternalError("cudaMemcpy into the GPU region failed");
  }
  cudaIpcMemHandle_t h;
  if (cudaIpcGetMemHandle(&h, *device) != cudaSuccess) {
    return absl::InternalError("cudaIpcGetMemHandle failed");
  }
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return absl::OkStatus();
#else
  return absl::UnimplementedError("this attn-bench was built without CUDA: no --transport cuda-ipc");
#endif
}

}  // namespace

bool BenchGpuRegionsAvailable() {
#ifdef ATTN_BENCH_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<BenchRegion>> BenchRegion::Create(
    RegionClient* regions, Kind kind, const std::string& name,
    const v1::AttendRequest* inline_request) {
  const v1::AttendRequest& r = *inline_request;
  const uint64_t q = r.q().data().size(), k = r.k().data().size(), v = r.v().data().size();
  const uint64_t lse = r.return_lse() ? 4 * uint64_t(r.q().shape(0)) * r.q().shape(1) : 0;
  // lse's offset a multiple of 4 (its element size) whatever the tensors' sizes.
  const uint64_t lse_at = (q + k + v + q + 3) / 4 * 4;
  const uint64_t bytes = lse_at + lse;
  std::unique_ptr<BenchRegion> b(new BenchRegion(inline_request));
  if (kind == Kind::kHost) {
    auto region = HostRegion::Create(bytes);
    if (!region.ok()) return region.status();
    b->host_ = std::move(*region);
    auto info = regions->Register(name, *b->host_);
    if (!info.ok()) return info.status();
    b->WriteInputs();
  } else {
    std::string handle;
    const std::string inputs = r.q().data() + r.k().data() + r.v().data();
    if (absl::Status st = MakeGpuRegion(bytes, inputs, &b->device_, &handle); !st.ok()) return st;
    auto info = regions->RegisterCuda(name, handle, 0, bytes);
    if (!info.ok()) return info.status();
  }
  b->regions_ = regions;
  b->name_ = name;
  b->request_ = r;
  *b->request_.mutable_q() = InRegion(r.q(), name, 0);
  *b->request_.mutable_k() = InRegion(r.k(), name, q);
  *b->request_.mutable_v() = InRegion(r.v(), name, q + k);
  *b->request_.mutable_o_region() = RegionSliceOf(name, q + k + v, q);
  if (lse > 0) *b->request_.mutable_lse_region() = RegionSliceOf(name, lse_at, lse);
  return b;
}

BenchRegion::~BenchRegion() {
#ifdef ATTN_BENCH_CUDA
  if (device_ != nullptr) {
    // Unregistered before it is freed: attnd must close its import first.
    if (regions_ != nullptr) (void)regions_->Unregister(name_);
    cudaFree(device_);
  }
#endif
}

absl::StatusOr<std::string> BenchRegion::ReadOutput() const {
  const v1::RegionSlice& o = request_.o_region();
  std::string out(o.bytes(), '\0');
  if (host_) {
    std::memcpy(out.data(), host_->data() + o.offset(), o.bytes());
    return out;
  }
#ifdef ATTN_BENCH_CUDA
  if (cudaMemcpy(out.data(), static_cast<char*>(device_) + o.offset(), o.bytes(),
                 cudaMemcpyDeviceToHost) != cudaSuccess) {
    return absl::InternalError("cudaMemcpy of o out of the GPU region failed");
  }
  return out;
#else
  return absl::InternalError("no region");
#endif
}

void BenchRegion::WriteInputs() {
  if (!host_) return;
  char* p = host_->data();
  for (const v1::Tensor* t : {&inline_->q(), &inline_->k(), &inline_->v()}) {
    std::memcpy(p, t->data().data(), t->data().size());
    p += t->data().size();
  }
}

}  // namespace attn::client
