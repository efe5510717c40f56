// Same-host regions on the CUDA backend, with attnd as a process of its own (a CUDA IPC handle
// cannot be opened in the process that exported it; $ATTND_BIN names the attnd to run, else this
// build's):
// - session steps whose q, k_new and v_new lie in GPU memory this test cudaMalloc'ed and shared
//   through CUDA IPC, with o and lse written into GPU memory, checked against the float64
//   reference over several steps (outputs poisoned first), aligned (the launch in place) and not
//   (device-to-device copies);
// - a BatchStep of one launch mixing a GPU-region item, a host-region item and an inline one, and
//   one of many steps in GPU regions (gathered and scattered by one kernel each);
// - a CUDA VMM allocation passed as a file descriptor: an Attend in place through it, and the
//   registrations refused (past the allocation, another device, not a VMM allocation's);
// - Attends whose tensors all lie in GPU regions, large and aligned (the kernel reading and
//   writing the region in place) and not (gathered by device-to-device copies), checked against
//   the float64 reference; offsets that are not a multiple of the element size refused by name;
// - Attend and a large step through host regions registered with the GPU (copied straight
//   between the region and the device), and the same through staging when attnd registers none
//   (--shm_max_registered_bytes=0), with the metrics of each.
// Skips where no GPU is found.
#include <cuda.h>  // VMM types; the functions are looked up through the runtime
#include <cuda_runtime_api.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <grpcpp/client_context.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attn/client/region_client.h"
#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using client::RegionSliceOf;
using testing::SessionShadow;
using testing::SessionSpec;

// d = 128: the head dimension every CUDA build compiles.
const SessionSpec kSpec{2, 8, 2, 128, v1::DTYPE_BFLOAT16};
constexpr double kOTolerance = 2e-2;  // bf16, P in the input dtype (cuda_session_test's)
constexpr double kLseTolerance = 2e-3;
constexpr uint64_t kGpuBytes = uint64_t{8} << 20;

std::string NoGpuReason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(err);
  if (n == 0) return "no CUDA device found";
  return "";
}

// GPU memory of this process's, shared with attnd as a region: cudaMalloc'ed (a legacy CUDA IPC
// handle) or a CUDA VMM allocation (a POSIX file descriptor).
class GpuBuffer {
 public:
  virtual ~GpuBuffer() = default;
  void Write(uint64_t at, const std::string& bytes) {
    ASSERT_EQ(cudaMemcpy(data_ + at, bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::string Read(uint64_t at, uint64_t bytes) const {
    std::string out(bytes, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), data_ + at, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  // 0xFF bytes: NaN in bf16 and fp32, so that an output left unwritten fails the check.
  void Poison() { ASSERT_EQ(cudaMemset(data_, 0xFF, bytes_), cudaSuccess); }
  uint64_t bytes() const { return bytes_; }

 protected:
  char* data_ = nullptr;
  uint64_t bytes_ = 0;
};

class MallocBuffer : public GpuBuffer {
 public:
  ~MallocBuffer() override {
    if (data_ != nullptr) cudaFree(data_);
  }
  bool Allocate(uint64_t bytes) {
    bytes_ = bytes;
    return cudaMalloc(reinterpret_cast<void**>(&data_), bytes) == cudaSuccess;
  }
  std::string IpcHandle() const {
    cudaIpcMemHandle_t h;
    EXPECT_EQ(cudaIpcGetMemHandle(&h, data_), cudaSuccess);
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
};

template <typename Fn>
Fn DriverFunction(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  EXPECT_EQ(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found),
            cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointSuccess) << name;
  return reinterpret_cast<Fn>(p);
}

// A cuMemCreate allocation of device 0, mapped here, exportable as a POSIX file descriptor.
class VmmBuffer : public GpuBuffer {
 public:
  ~VmmBuffer() override {
    if (fd_ >= 0) close(fd_);
    if (data_ != nullptr) {
      const auto ptr = reinterpret_cast<CUdeviceptr>(data_);
      DriverFunction<decltype(&cuMemUnmap)>("cuMemUnmap")(ptr, bytes_);
      DriverFunction<decltype(&cuMemAddressFree)>("cuMemAddressFree")(ptr, bytes_);
    }
    if (handle_ != 0) DriverFunction<decltype(&cuMemRelease)>("cuMemRelease")(handle_);
  }
  // bytes rounded up to the allocation granularity.
  bool Allocate(uint64_t bytes) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (DriverFunction<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity")(
            &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) {
      return false;
    }
    const uint64_t size = (bytes + granularity - 1) / granularity * granularity;
    if (DriverFunction<decltype(&cuMemCreate)>("cuMemCreate")(&handle_, size, &prop, 0) !=
        CUDA_SUCCESS) {
      return false;
    }
    CUdeviceptr ptr = 0;
    if (DriverFunction<decltype(&cuMemAddressReserve)>("cuMemAddressReserve")(&ptr, size, 0, 0,
                                                                             0) != CUDA_SUCCESS) {
      return false;
    }
    data_ = reinterpret_cast<char*>(ptr);
    bytes_ = size;
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return DriverFunction<decltype(&cuMemMap)>("cuMemMap")(ptr, size, 0, handle_, 0) ==
               CUDA_SUCCESS &&
           DriverFunction<decltype(&cuMemSetAccess)>("cuMemSetAccess")(ptr, size, &access, 1) ==
               CUDA_SUCCESS &&
           DriverFunction<decltype(&cuMemExportToShareableHandle)>("cuMemExportToShareableHandle")(
               &fd_, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS;
  }
  int fd() const { return fd_; }

 private:
  CUmemGenericAllocationHandle handle_ = 0;
  int fd_ = -1;
};

class CudaRegionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = NoGpuReason(); !why.empty()) GTEST_SKIP() << why;
  }
  // Freed in this order: the client first, then attnd (closing its imports), then the memory.
  void TearDown() override {
    regions_.reset();
    client_.reset();
    attnd_.reset();
  }
  // attnd on the CUDA backend with shared memory allowed, and a client with its region socket.
  void StartAttnd(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--backend=cuda", "--allow_shared_memory",
                                      "--kv_cache_bytes=1073741824",
                                      "--device_pool_bytes=1073741824", "--kv_page_tokens=4"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    attnd_ = testing::AttndProcess::Start(flags);
    ASSERT_NE(attnd_, nullptr);
    client::ClientOptions co;
    co.target = attnd_->target();
    auto c = client::Client::Create(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto r = client::RegionClient::Connect(client_.get());
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << attnd_->Log();
    regions_ = std::move(*r);
  }
  // GPU memory of kGpuBytes registered as region `name`; freed after attnd has exited.
  GpuBuffer& RegisterGpu(const std::string& name) {
    auto buffer = std::make_unique<MallocBuffer>();
    EXPECT_TRUE(buffer->Allocate(kGpuBytes));
    auto info = regions_->RegisterCuda(name, buffer->IpcHandle(), 0, buffer->bytes());
    EXPECT_TRUE(info.ok()) << info.status() << "\n" << attnd_->Log();
    buffers_.push_back(std::move(buffer));
    return *buffers_.back();
  }
  // The same through a CUDA VMM allocation and its file descriptor.
  GpuBuffer& RegisterVmm(const std::string& name) {
    auto buffer = std::make_unique<VmmBuffer>();
    EXPECT_TRUE(buffer->Allocate(kGpuBytes));
    auto info = regions_->RegisterCudaVmm(name, buffer->fd(), 0, buffer->bytes());
    EXPECT_TRUE(info.ok()) << info.status() << "\n" << attnd_->Log();
    if (info.ok()) EXPECT_EQ(info->kind(), v1::REGION_KIND_CUDA_VMM);
    buffers_.push_back(std::move(buffer));
    return *buffers_.back();
  }
  std::string CreateSession() {
    v1::CreateSessionResponse created;
    const grpc::Status st = testing::CreateSession(client_->stub(), kSpec, &created);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return created.session_id();
  }
  double Metric(const std::string& name, const std::vector<std::string>& labels = {}) {
    return testing::ScrapeMetric(attnd_->metrics_port(), name, labels);
  }

  std::vector<std::unique_ptr<GpuBuffer>> buffers_;  // declared first: freed last
  std::unique_ptr<testing::AttndProcess> attnd_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::RegionClient> regions_;
  std::mt19937_64 rng_{std::random_device{}()};
};

// The first multiple of 4 from at on: where lse (float32) may start.
uint64_t LseOffsetFrom(uint64_t at) { return (at + 3) / 4 * 4; }

// Where a step's tensors go: q, k_new, v_new back to back in `in` from in_at; o then lse in
// `out` from out_at (lse at the first multiple of 4 after o).
struct Placement {
  std::string in, out;
  uint64_t in_at = 0, out_at = 0;
};

uint64_t LseBytes(const v1::StepRequest& step) {
  return 4 * uint64_t(step.q().shape(0)) * uint64_t(step.q().shape(1));
}

// step rewritten to name its regions, its tensors written there by `write`.
template <typename Write>
v1::StepRequest InRegions(const v1::StepRequest& step, const Placement& at, Write write) {
  v1::StepRequest r = step;
  uint64_t in = at.in_at;
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_k_new(), r.mutable_v_new()}) {
    const std::string data = std::move(*t->mutable_data());
    t->clear_data();
    write(in, data);
    *t->mutable_region() = RegionSliceOf(at.in, in, data.size());
    in += data.size();
  }
  const uint64_t o_bytes = step.q().data().size();
  *r.mutable_o_region() = RegionSliceOf(at.out, at.out_at, o_bytes);
  if (r.return_lse()) {
    *r.mutable_lse_region() =
        RegionSliceOf(at.out, LseOffsetFrom(at.out_at + o_bytes), LseBytes(step));
  }
  return r;
}

// response with o (and lse) read back from where region_step had them written, by `read`.
template <typename Read>
v1::StepResponse ReadBack(const v1::StepRequest& region_step, v1::StepResponse response,
                          Read read) {
  EXPECT_TRUE(response.o().data().empty());
  EXPECT_EQ(response.o().region().region(), region_step.o_region().region());
  const v1::RegionSlice& o = region_step.o_region();
  response.mutable_o()->set_data(read(o.offset(), o.bytes()));
  if (region_step.return_lse()) {
    const v1::RegionSlice& lse = region_step.lse_region();
    response.mutable_lse()->set_data(read(lse.offset(), lse.bytes()));
  }
  return response;
}

TEST_F(CudaRegionTest, StepsWithTensorsInGpuRegionsMatchTheReference) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  GpuBuffer& in = RegisterGpu("gin");
  GpuBuffer& out = RegisterGpu("gout");
  ASSERT_FALSE(HasFailure());
  const std::string id = CreateSession();
  SessionShadow shadow(kSpec);
  auto write = [&](uint64_t at, const std::string& bytes) { in.Write(at, bytes); };
  auto read = [&](uint64_t at, uint64_t bytes) { return out.Read(at, bytes); };
  struct Case {
    int layer, tokens;
    uint64_t skew;  // 0: every tensor 16-byte aligned (in place); else copied on the device
  };
  // Chunked prefills and decode steps on both layers, a page boundary crossed (16 tokens a page).
  const std::vector<Case> cases = {{0, 37, 0}, {1, 37, 2}, {0, 1, 0}, {0, 1, 2},  {1, 1, 0},
                                   {0, 16, 0}, {1, 5, 6},  {0, 1, 0}, {1, 1, 10}, {0, 40, 2}};
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case c = cases[i];
    v1::StepRequest step = testing::RandomStep(id, c.layer, c.tokens, kSpec, rng_);
    step.set_return_lse(i % 3 != 1);
    // The tensors back to back; skew > 0 also misaligns k_new (q's size is a multiple of 16).
    const Placement at{"gin", "gout", 4096 * i + c.skew, 8192 * i + c.skew};
    const v1::StepRequest region_step = InRegions(step, at, write);
    out.Poison();
    v1::StepResponse response;
    const grpc::Status st = testing::Step(client_->stub(), region_step, &response);
    ASSERT_TRUE(st.ok()) << "step " << i << ": " << st.error_message() << "\n" << attnd_->Log();
    shadow.Append(step);
    EXPECT_EQ(response.cached_tokens(), shadow.Tokens(c.layer)) << "step " << i;
    const SessionShadow::Error err = shadow.Check(step, ReadBack(region_step, response, read));
    EXPECT_EQ(err.non_finite, 0) << "step " << i;
    EXPECT_LT(err.o, kOTolerance) << "step " << i;
    EXPECT_LT(err.lse, kLseTolerance) << "step " << i;
    std::printf("step %zu (layer %d, %d tokens, %s): o error %.2e, lse error %.2e, kernel %.1f us, "
                "transfer %.1f us\n",
                i, c.layer, c.tokens, c.skew == 0 ? "in place" : "D2D copies", err.o, err.lse,
                response.timing().compute_us(), response.timing().transfer_us());
  }
  // A refused step (k_new from a host-only place: inline data) changes nothing.
  v1::StepRequest step = testing::RandomStep(id, 0, 3, kSpec, rng_);
  v1::StepRequest bad = InRegions(step, {"gin", "gout"}, write);
  *bad.mutable_k_new() = step.k_new();
  v1::StepResponse response;
  grpc::Status st = testing::Step(client_->stub(), bad, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("k_new.region must name a GPU region"), std::string::npos)
      << st.error_message();
  const v1::StepRequest good = InRegions(step, {"gin", "gout"}, write);
  st = testing::Step(client_->stub(), good, &response);
  ASSERT_TRUE(st.ok()) << st.error_message();
  shadow.Append(step);
  EXPECT_EQ(response.cached_tokens(), shadow.Tokens(0));
  EXPECT_LT(shadow.Check(step, ReadBack(good, response, read)).o, kOTolerance);
}

TEST_F(CudaRegionTest, OneLaunchMixesGpuRegionHostRegionAndInlineSteps) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  GpuBuffer& gin = RegisterGpu("gin");
  GpuBuffer& gout = RegisterGpu("gout");
  ASSERT_FALSE(HasFailure());
  auto host = client::HostRegion::Create(4 << 20);
  ASSERT_TRUE(host.ok());
  ASSERT_TRUE(regions_->Register("host", **host).ok());
  char* h = (*host)->data();
  const std::string a = CreateSession(), b = CreateSession(), c = CreateSession();
  SessionShadow sa(kSpec), sb(kSpec), sc(kSpec);
  // 40 tokens: b's q and o (80 KiB) go straight between its registered region and the GPU.
  for (int round = 0; round < 3; ++round) {
    v1::StepRequest step_a = testing::RandomStep(a, 0, 40, kSpec, rng_);
    v1::StepRequest step_b = testing::RandomStep(b, 0, 40, kSpec, rng_);
    v1::StepRequest step_c = testing::RandomStep(c, 0, 40, kSpec, rng_);
    step_a.set_return_lse(true);
    step_b.set_return_lse(round != 1);
    v1::BatchStepRequest batch;
    const v1::StepRequest region_a = InRegions(
        step_a, {"gin", "gout"}, [&](uint64_t at, const std::string& d) { gin.Write(at, d); });
    const v1::StepRequest region_b =
        InRegions(step_b, {"host", "host", 0, 2 << 20},
                  [&](uint64_t at, const std::string& d) { std::memcpy(h + at, d.data(), d.size()); });
    gout.Poison();
    std::memset(h + (2 << 20), 0xFF, 2 << 20);
    *batch.add_steps() = region_a;
    *batch.add_steps() = region_b;
    *batch.add_steps() = step_c;
    v1::BatchStepResponse response;
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx, std::chrono::milliseconds(30000));
    const grpc::Status st = client_->stub()->BatchStep(&ctx, batch, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(response.results_size(), 3);
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(response.results(i).status_code(), 0) << response.results(i).status_message();
      EXPECT_EQ(response.results(i).response().timing().batch_requests(), 3) << "one launch";
    }
    sa.Append(step_a);
    sb.Append(step_b);
    sc.Append(step_c);
    const auto ea = sa.Check(step_a, ReadBack(region_a, response.results(0).response(),
                                              [&](uint64_t at, uint64_t n) { return gout.Read(at, n); }));
    const auto eb = sb.Check(step_b, ReadBack(region_b, response.results(1).response(),
                                              [&](uint64_t at, uint64_t n) {
                                                return std::string(h + at, n);
                                              }));
    const auto ec = sc.Check(step_c, response.results(2).response());
    for (const auto& [e, name] : {std::pair{ea, "gpu"}, std::pair{eb, "host"}, std::pair{ec, "inline"}}) {
      EXPECT_EQ(e.non_finite, 0) << name << ", round " << round;
      EXPECT_LT(e.o, kOTolerance) << name << ", round " << round;
      EXPECT_LT(e.lse, kLseTolerance) << name << ", round " << round;
    }
  }
}

// A BatchStep of many steps in GPU regions is one launch whose tensors one kernel gathers and
// scatters: decode steps and chunks, aligned and not, with lse and without, among inline steps.
TEST_F(CudaRegionTest, ManyGpuRegionStepsInOneLaunchMatchTheReference) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  GpuBuffer& gin = RegisterGpu("gin");
  GpuBuffer& gout = RegisterGpu("gout");
  ASSERT_FALSE(HasFailure());
  constexpr int kSteps = 24;
  std::vector<std::string> ids;
  std::vector<SessionShadow> shadows;
  for (int i = 0; i < kSteps; ++i) {
    ids.push_back(CreateSession());
    shadows.emplace_back(kSpec);
  }
  for (int round = 0; round < 4; ++round) {
    v1::BatchStepRequest batch;
    std::vector<v1::StepRequest> steps, sent;
    for (int i = 0; i < kSteps; ++i) {
      const int tokens = round == 0 ? 9 + i % 7 : (i + round) % 5 == 0 ? 3 : 1;
      v1::StepRequest step = testing::RandomStep(ids[i], i % 2, tokens, kSpec, rng_);
      step.set_return_lse((i + round) % 3 != 0);
      // Every fourth inline; the others in the GPU regions, every third of those off 16 bytes.
      const uint64_t skew = i % 3 == 1 ? 2 * uint64_t(1 + i % 4) : 0;
      const Placement at{"gin", "gout", 65536 * uint64_t(i) + skew, 65536 * uint64_t(i) + skew};
      sent.push_back(i % 4 == 3 ? step : InRegions(step, at, [&](uint64_t where, const std::string& d) {
        gin.Write(where, d);
      }));
      steps.push_back(std::move(step));
      *batch.add_steps() = sent.back();
    }
    gout.Poison();
    v1::BatchStepResponse response;
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx, std::chrono::milliseconds(30000));
    const grpc::Status st = client_->stub()->BatchStep(&ctx, batch, &response);
    ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << attnd_->Log();
    ASSERT_EQ(response.results_size(), kSteps);
    for (int i = 0; i < kSteps; ++i) {
      const v1::StepResult& result = response.results(i);
      ASSERT_EQ(result.status_code(), 0) << "step " << i << ": " << result.status_message();
      shadows[i].Append(steps[i]);
      EXPECT_EQ(result.response().cached_tokens(), shadows[i].Tokens(i % 2)) << "step " << i;
      const v1::StepResponse answer =
          i % 4 == 3 ? result.response()
                     : ReadBack(sent[i], result.response(),
                                [&](uint64_t at, uint64_t n) { return gout.Read(at, n); });
      const SessionShadow::Error err = shadows[i].Check(steps[i], answer);
      EXPECT_EQ(err.non_finite, 0) << "round " << round << ", step " << i;
      EXPECT_LT(err.o, kOTolerance) << "round " << round << ", step " << i;
      EXPECT_LT(err.lse, kLseTolerance) << "round " << round << ", step " << i;
    }
    std::printf("round %d: %d steps, launch of %d, kernel %.1f us, transfer %.1f us\n", round,
                kSteps, response.results(0).response().timing().batch_requests(),
                response.results(0).response().timing().compute_us(),
                response.results(0).response().timing().transfer_us());
  }
}

// Attend of 512 tokens, 8 heads (4 KV heads), d = 128, bf16, through host regions "in" and "out".
struct HostAttend {
  testing::RandomRequest random;
  std::unique_ptr<client::HostRegion> in, out;
  size_t q = 0, kv = 0, lse = 0;
};

HostAttend MakeHostAttend(std::mt19937_64& rng) {
  HostAttend h;
  h.random = testing::MakeRandomRequest(
      {.seq_q = 512, .seq_k = 512, .heads = 8, .kv_heads = 4, .head_dim = 128, .causal = true},
      rng);
  h.q = h.random.q.data.size();
  h.kv = h.random.k.data.size();
  h.lse = 4 * 8 * 512;
  h.in = std::move(client::HostRegion::Create(h.q + 2 * h.kv).value());
  h.out = std::move(client::HostRegion::Create(h.q + h.lse).value());
  std::memcpy(h.in->data(), h.random.q.data.data(), h.q);
  std::memcpy(h.in->data() + h.q, h.random.k.data.data(), h.kv);
  std::memcpy(h.in->data() + h.q + h.kv, h.random.v.data.data(), h.kv);
  return h;
}

// Attends through the regions (o and lse poisoned first) and checks o against the reference.
void AttendThroughHostRegions(client::Client& client, HostAttend& h) {
  v1::AttendRequest r = client::Client::BuildAttendRequest(h.random.q, h.random.k, h.random.v,
                                                           h.random.options);
  r.set_return_lse(true);
  *r.mutable_q() = client::RegionTensor(h.random.q.dtype, h.random.q.shape, "in", 0);
  *r.mutable_k() = client::RegionTensor(h.random.k.dtype, h.random.k.shape, "in", h.q);
  *r.mutable_v() = client::RegionTensor(h.random.v.dtype, h.random.v.shape, "in", h.q + h.kv);
  *r.mutable_o_region() = RegionSliceOf("out", 0, h.q);
  *r.mutable_lse_region() = RegionSliceOf("out", h.q, h.lse);
  const testing::ReferenceResult ref = testing::ReferenceFor(h.random);
  for (int i = 0; i < 3; ++i) {
    std::memset(h.out->data(), 0xFF, h.out->size());
    v1::AttendResponse response;
    grpc::ClientContext ctx;
    client.PrepareContext(&ctx, std::chrono::milliseconds(30000));
    const grpc::Status st = client.stub()->Attend(&ctx, r, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    client::Tensor o{h.random.q.dtype, h.random.q.shape, std::string(h.out->data(), h.q)};
    EXPECT_LT(testing::ErrorAgainstReference(h.random, o), kOTolerance);
    const float* lse = reinterpret_cast<const float*>(h.out->data() + h.q);
    double worst = 0;
    for (size_t j = 0; j < ref.lse.size(); ++j) worst = std::max(worst, std::fabs(lse[j] - ref.lse[j]));
    EXPECT_LT(worst, kLseTolerance);
    std::printf("Attend 512 tokens through host regions: transfer %.1f us, kernel %.1f us\n",
                response.timing().transfer_us(), response.timing().compute_us());
  }
}

// An Attend whose q, k, v, o and lse lie in GPU region `name` from byte `at` on (q, k, v, then
// o back to back, lse at the first multiple of 4 after o), its inputs written there.
struct GpuAttend {
  testing::RandomRequest random;
  v1::AttendRequest request;
  GpuBuffer* buffer = nullptr;
  uint64_t o_at = 0, o_bytes = 0, lse_at = 0, lse_bytes = 0;
};

GpuAttend MakeGpuAttend(int32_t seq, const std::string& name, GpuBuffer& buffer, uint64_t at,
                        std::mt19937_64& rng) {
  GpuAttend g;
  g.buffer = &buffer;
  g.random = testing::MakeRandomRequest(
      {.seq_q = seq, .seq_k = seq, .heads = 8, .kv_heads = 4, .head_dim = 128, .causal = true},
      rng);
  g.request = client::Client::BuildAttendRequest(g.random.q, g.random.k, g.random.v,
                                                 g.random.options);
  g.request.set_return_lse(true);
  uint64_t next = at;
  for (auto [t, field] : {std::pair{&g.random.q, g.request.mutable_q()},
                          std::pair{&g.random.k, g.request.mutable_k()},
                          std::pair{&g.random.v, g.request.mutable_v()}}) {
    buffer.Write(next, t->data);
    *field = client::RegionTensor(t->dtype, t->shape, name, next);
    next += t->data.size();
  }
  g.o_at = next;
  g.o_bytes = g.random.q.data.size();
  g.lse_at = LseOffsetFrom(g.o_at + g.o_bytes);
  g.lse_bytes = 4 * 8 * uint64_t(seq);
  *g.request.mutable_o_region() = RegionSliceOf(name, g.o_at, g.o_bytes);
  *g.request.mutable_lse_region() = RegionSliceOf(name, g.lse_at, g.lse_bytes);
  EXPECT_LE(g.lse_at + g.lse_bytes, buffer.bytes());
  return g;
}

// o and lse as attnd wrote them into the region, against the float64 reference.
void CheckGpuAttend(const GpuAttend& g, const testing::ReferenceResult& ref) {
  client::Tensor o{g.random.q.dtype, g.random.q.shape, g.buffer->Read(g.o_at, g.o_bytes)};
  EXPECT_LT(testing::ErrorAgainstReference(g.random, o), kOTolerance);
  const std::string lse_bytes = g.buffer->Read(g.lse_at, g.lse_bytes);
  const float* lse = reinterpret_cast<const float*>(lse_bytes.data());
  ASSERT_EQ(lse_bytes.size(), 4 * ref.lse.size());
  double worst = 0;
  for (size_t j = 0; j < ref.lse.size(); ++j) {
    worst = std::max(worst, std::fabs(lse[j] - ref.lse[j]));
  }
  EXPECT_LT(worst, kLseTolerance);
}

// Three Attends at once, all tensors in GPU regions: a large aligned one (run in place, its
// kernel reading and writing the region), a large one at an odd offset and a small one (both
// gathered into a packed launch by device-to-device copies). Outputs poisoned each round.
TEST_F(CudaRegionTest, AttendWithTensorsInGpuRegionsMatchesTheReference) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  GpuBuffer& aligned = RegisterGpu("aligned");
  GpuBuffer& odd = RegisterGpu("odd");
  GpuBuffer& small = RegisterGpu("small");
  std::vector<GpuAttend> attends;
  attends.push_back(MakeGpuAttend(1024, "aligned", aligned, 0, rng_));  // q: 2 MiB
  attends.push_back(MakeGpuAttend(1000, "odd", odd, 2, rng_));
  attends.push_back(MakeGpuAttend(96, "small", small, 256, rng_));
  std::vector<testing::ReferenceResult> refs;
  for (const GpuAttend& g : attends) refs.push_back(testing::ReferenceFor(g.random));
  for (int round = 0; round < 3; ++round) {
    for (GpuBuffer* b : {&aligned, &odd, &small}) b->Poison();
    for (const GpuAttend& g : attends) {  // the inputs again, over the poison
      uint64_t at = g.request.q().region().offset();
      for (const client::Tensor* t : {&g.random.q, &g.random.k, &g.random.v}) {
        g.buffer->Write(at, t->data);
        at += t->data.size();
      }
    }
    std::vector<v1::AttendResponse> responses(attends.size());
    std::vector<grpc::Status> status(attends.size());
    std::vector<std::thread> callers;
    for (size_t i = 0; i < attends.size(); ++i) {
      callers.emplace_back([&, i] {
        grpc::ClientContext ctx;
        client_->PrepareContext(&ctx, std::chrono::milliseconds(30000));
        status[i] = client_->stub()->Attend(&ctx, attends[i].request, &responses[i]);
      });
    }
    for (auto& t : callers) t.join();
    for (size_t i = 0; i < attends.size(); ++i) {
      ASSERT_TRUE(status[i].ok()) << i << ": " << status[i].error_message() << "\n"
                                  << attnd_->Log();
      EXPECT_TRUE(responses[i].o().data().empty());
      CheckGpuAttend(attends[i], refs[i]);
      std::printf("Attend %d tokens through GPU regions at offset %llu: transfer %.1f us, "
                  "kernel %.1f us, batch of %d\n",
                  static_cast<int>(attends[i].random.q.shape[0]),
                  static_cast<unsigned long long>(attends[i].request.q().region().offset()),
                  responses[i].timing().transfer_us(), responses[i].timing().compute_us(),
                  responses[i].timing().batch_requests());
    }
  }
}

// On the CUDA backend too, a GPU-region slice whose offset is not a multiple of its element size
// (2 for bf16, 4 for lse) is refused by name before any work, for Attend and for steps, the
// output left as it was; the same request at element-aligned offsets that are not 16-byte aligned
// is then answered correctly (through device copies).
TEST_F(CudaRegionTest, GpuOffsetsOffTheElementSizeAreRefusedByName) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  GpuBuffer& g = RegisterGpu("g");
  ASSERT_FALSE(HasFailure());
  GpuAttend attend = MakeGpuAttend(100, "g", g, 2, rng_);  // q at 2: element-aligned, not 16
  const testing::ReferenceResult ref = testing::ReferenceFor(attend.random);
  struct Case {
    const char* name;
    std::function<void(v1::AttendRequest&)> corrupt;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"k odd", [](auto& r) { r.mutable_k()->mutable_region()->set_offset(r.k().region().offset() + 1); },
       "k.region: offset"},
      {"v odd", [](auto& r) { r.mutable_v()->mutable_region()->set_offset(r.v().region().offset() - 1); },
       "v.region: offset"},
      {"o odd", [](auto& r) { r.mutable_o_region()->set_offset(r.o_region().offset() + 1); },
       "o_region: offset"},
      {"lse at 2 mod 4",
       [](auto& r) { r.mutable_lse_region()->set_offset(r.lse_region().offset() + 2); },
       "lse_region: offset"},
  };
  for (const Case& c : cases) {
    v1::AttendRequest bad = attend.request;
    c.corrupt(bad);
    g.Poison();
    v1::AttendResponse response;
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx, std::chrono::milliseconds(30000));
    const grpc::Status st = client_->stub()->Attend(&ctx, bad, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(st.error_message().find(c.message), std::string::npos) << st.error_message();
    EXPECT_NE(st.error_message().find("a tensor in a region must start at a multiple of its "
                                      "element size"),
              std::string::npos)
        << st.error_message();
    EXPECT_EQ(g.Read(attend.o_at, 64), std::string(64, '\xff')) << c.name << ": o was written";
  }
  g.Poison();
  uint64_t at = attend.request.q().region().offset();
  for (const client::Tensor* t : {&attend.random.q, &attend.random.k, &attend.random.v}) {
    g.Write(at, t->data);
    at += t->data.size();
  }
  v1::AttendResponse response;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, std::chrono::milliseconds(30000));
  const grpc::Status st = client_->stub()->Attend(&ctx, attend.request, &response);
  ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << attnd_->Log();
  CheckGpuAttend(attend, ref);

  // A step: k_new at an odd offset, lse at 2 mod 4; nothing appended.
  const std::string id = CreateSession();
  auto write = [&](uint64_t offset, const std::string& bytes) { g.Write(offset, bytes); };
  v1::StepRequest step = testing::RandomStep(id, 0, 3, kSpec, rng_);
  step.set_return_lse(true);
  const v1::StepRequest good = InRegions(step, {"g", "g", 0, 1 << 20}, write);
  for (int which = 0; which < 2; ++which) {
    v1::StepRequest bad = good;
    if (which == 0) {
      bad.mutable_k_new()->mutable_region()->set_offset(good.k_new().region().offset() + 1);
    } else {
      bad.mutable_lse_region()->set_offset(good.lse_region().offset() + 2);
    }
    v1::StepResponse step_response;
    const grpc::Status refused = testing::Step(client_->stub(), bad, &step_response);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(refused.error_message().find(which == 0 ? "k_new.region: offset" : "lse_region: offset"),
              std::string::npos)
        << refused.error_message();
  }
  v1::StepResponse step_response;
  ASSERT_TRUE(testing::Step(client_->stub(), good, &step_response).ok());
  EXPECT_EQ(step_response.cached_tokens(), 3);
}

// A CUDA VMM allocation shared by its file descriptor: an Attend in place through it against the
// float64 reference, and the registrations attnd must refuse (past the allocation, another
// device, a descriptor that is not a VMM allocation's).
TEST_F(CudaRegionTest, VmmAllocationsServeAttendInPlaceAndBadOnesAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  GpuBuffer& vmm = RegisterVmm("vmm");
  GpuAttend g = MakeGpuAttend(1024, "vmm", vmm, 0, rng_);
  const testing::ReferenceResult ref = testing::ReferenceFor(g.random);
  for (int round = 0; round < 2; ++round) {
    vmm.Poison();
    uint64_t at = 0;
    for (const client::Tensor* t : {&g.random.q, &g.random.k, &g.random.v}) {
      vmm.Write(at, t->data);
      at += t->data.size();
    }
    v1::AttendResponse response;
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx, std::chrono::milliseconds(30000));
    const grpc::Status st = client_->stub()->Attend(&ctx, g.request, &response);
    ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << attnd_->Log();
    CheckGpuAttend(g, ref);
  }
  VmmBuffer other;
  ASSERT_TRUE(other.Allocate(kGpuBytes));
  auto past_end = regions_->RegisterCudaVmm("past-end", other.fd(), 0, other.bytes() + 1);
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kInvalidArgument) << past_end.status();
  EXPECT_NE(std::string(past_end.status().message()).find("does not fit in the VMM allocation"),
            std::string::npos)
      << past_end.status();
  auto device = regions_->RegisterCudaVmm("device", other.fd(), 1, other.bytes());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << device.status();
  EXPECT_NE(std::string(device.status().message()).find("device_id 1 is not attnd's GPU"),
            std::string::npos)
      << device.status();
  auto host = client::HostRegion::Create(4096);
  ASSERT_TRUE(host.ok());
  auto not_vmm = regions_->RegisterCudaVmm("not-vmm", (*host)->fd(), 0, 4096);
  EXPECT_EQ(not_vmm.status().code(), absl::StatusCode::kInvalidArgument) << not_vmm.status();
  EXPECT_NE(std::string(not_vmm.status().message()).find("not a CUDA VMM allocation's"),
            std::string::npos)
      << not_vmm.status();
  // The refusals left attnd serving: the good region again.
  auto listed = regions_->List();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->regions_size(), 1);
  EXPECT_EQ(listed->regions(0).kind(), v1::REGION_KIND_CUDA_VMM);
  ASSERT_TRUE(regions_->Unregister("vmm").ok());
}

TEST_F(CudaRegionTest, HostRegionsAreRegisteredWithTheGpuAndCopiedDirectly) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd());
  HostAttend h = MakeHostAttend(rng_);
  ASSERT_TRUE(regions_->Register("in", *h.in).ok());
  ASSERT_TRUE(regions_->Register("out", *h.out).ok());
  EXPECT_EQ(Metric("attn_shared_memory_registered_bytes"),
            static_cast<double>(h.in->size() + h.out->size()));
  EXPECT_EQ(Metric("attn_shared_memory_registration_fallbacks_total"), 0);
  AttendThroughHostRegions(*client_, h);
  // Steps too: 64 tokens (q and o 128 KiB each) go straight between the region and the GPU.
  const std::string id = CreateSession();
  SessionShadow shadow(kSpec);
  auto host = client::HostRegion::Create(4 << 20);
  ASSERT_TRUE(host.ok());
  ASSERT_TRUE(regions_->Register("steps", **host).ok());
  char* s = (*host)->data();
  for (int tokens : {64, 1, 64}) {
    v1::StepRequest step = testing::RandomStep(id, 1, tokens, kSpec, rng_);
    step.set_return_lse(true);
    const v1::StepRequest region_step =
        InRegions(step, {"steps", "steps", 0, 2 << 20},
                  [&](uint64_t at, const std::string& d) { std::memcpy(s + at, d.data(), d.size()); });
    std::memset(s + (2 << 20), 0xFF, 2 << 20);
    v1::StepResponse response;
    ASSERT_TRUE(testing::Step(client_->stub(), region_step, &response).ok());
    shadow.Append(step);
    const auto e = shadow.Check(
        step, ReadBack(region_step, response, [&](uint64_t at, uint64_t n) { return std::string(s + at, n); }));
    EXPECT_EQ(e.non_finite, 0);
    EXPECT_LT(e.o, kOTolerance);
    EXPECT_LT(e.lse, kLseTolerance);
  }
  // Unregistered: page-locking undone once no request holds them (a finished request lets go
  // of its regions just after its caller hears, hence the wait).
  ASSERT_TRUE(regions_->Unregister("in").ok());
  ASSERT_TRUE(regions_->Unregister("out").ok());
  ASSERT_TRUE(regions_->Unregister("steps").ok());
  double registered = -1;
  for (int i = 0; i < 100 && registered != 0; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    registered = Metric("attn_shared_memory_registered_bytes");
  }
  EXPECT_EQ(registered, 0);
}

TEST_F(CudaRegionTest, WithoutRegistrationHostRegionsGoThroughStaging) {
  ASSERT_NO_FATAL_FAILURE(StartAttnd({"--shm_max_registered_bytes=0"}));
  HostAttend h = MakeHostAttend(rng_);
  ASSERT_TRUE(regions_->Register("in", *h.in).ok());
  ASSERT_TRUE(regions_->Register("out", *h.out).ok());
  EXPECT_EQ(Metric("attn_shared_memory_registered_bytes"), 0);
  EXPECT_EQ(Metric("attn_shared_memory_registration_fallbacks_total", {"reason=\"limit\""}), 2);
  AttendThroughHostRegions(*client_, h);
}

}  // namespace
}  // namespace attn
