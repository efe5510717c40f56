// attnd on the CUDA backend, in-process on loopback: answers checked against the float64
// reference (FP8 Attend included), batching under concurrency, device-pool exhaustion. Skips where
// no GPU is found.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <utility>

#include "common/reference.h"
#include "engine/backend.h"
#include "fp8_attend_check.h"
#include "gpu/gpu_test_util.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::MakeRandomRequest;
using testing::RequestShape;

testing::LoopbackServer StartCudaServer(ServerOptions options = {}) {
  options.backend = "cuda";
  options.metrics_listen = "";
  return testing::StartLoopbackServer(options);
}

// Pool bytes in use with nothing in flight: the step lanes keep their staging and device buffers
// from the start-up warm-up step (reused by every later step), so a server at rest is at this
// baseline, not at 0.
struct PoolsAtRest {
  int64_t device = 0, pinned = 0;
  explicit PoolsAtRest(const testing::LoopbackServer& s) {
    const BackendMemory m = s.server->backend().Memory();
    device = m.device_pool.used;
    pinned = m.pinned_pool.used;
  }
};

class CudaServerTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
  std::mt19937_64 rng_{std::random_device{}()};
};

// Largest LSE error of a response against the float64 reference (+inf on a mismatch of -inf).
double LseError(const testing::RandomRequest& r, const client::Tensor& lse) {
  const auto e = testing::CompareLse(testing::ReferenceFor(r).lse, lse.ToFloats());
  return e.non_finite ? INFINITY : e.max_abs;
}

TEST_F(CudaServerTest, ReportsTheDevice) {
  auto s = StartCudaServer();
  ASSERT_NE(s.server, nullptr);
  auto info = s.client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cuda");
  EXPECT_FALSE(info->device_name().empty());
  EXPECT_GT(info->compute_units(), 0);
  EXPECT_GT(info->device_memory_bytes(), 0);
  EXPECT_GE(info->compute_capability(), 80);
  std::printf("device: %s, %d SMs, cc %d, head dims %d\n", info->device_name().c_str(),
              info->compute_units(), info->compute_capability(), info->head_dims_size());
}

TEST_F(CudaServerTest, AnswersMatchTheReferenceForEveryDtype) {
  auto s = StartCudaServer();
  ASSERT_NE(s.server, nullptr);
  for (client::DType dtype :
       {client::DType::kFloat32, client::DType::kFloat16, client::DType::kBFloat16}) {
    for (bool causal : {false, true}) {
      for (int d : {64, 128}) {
        RequestShape shape;
        shape.dtype = dtype;
        shape.causal = causal;
        shape.batch = 3;
        shape.seq_q = 129;
        shape.seq_k = causal ? 300 : 77;
        shape.heads = 8;
        shape.kv_heads = 2;
        shape.head_dim = d;
        auto r = MakeRandomRequest(shape, rng_);
        r.options.return_lse = true;
        auto result = s.client->Attend(r.q, r.k, r.v, r.options);
        ASSERT_TRUE(result.ok()) << result.status();
        // fp32 requests compute in fp16 on the GPU: the fp16 tolerance applies.
        const double tol = dtype == client::DType::kBFloat16 ? 1e-2 : 2e-3;
        EXPECT_LE(testing::ErrorAgainstReference(r, result->o), tol)
            << "dtype " << int(dtype) << " causal " << causal << " d " << d;
        ASSERT_TRUE(result->lse.has_value());
        EXPECT_LE(LseError(r, *result->lse), 2e-2);
        EXPECT_GT(result->timing.compute_us(), 0);
        EXPECT_GT(result->timing.transfer_us(), 0);
      }
    }
  }
}

struct Fp8Lengths {
  std::vector<int32_t> q, k;
};

// One FP8 Attend of these lengths through c (descales per (sequence, KV head) when causal, per
// tensor otherwise): the request, and o's error against the float64 reference of its dequantized
// inputs (infinity, with a test failure, when the call fails).
std::pair<testing::Fp8Attend, double> AttendFp8(client::Client& c, const Fp8Lengths& lengths, int d,
                                                bool causal, client::DType q_type,
                                                std::mt19937_64& rng) {
  testing::Fp8AttendCase fc;
  fc.cu_q = testing::CuSeqlens(lengths.q);
  fc.cu_k = testing::CuSeqlens(lengths.k);
  fc.head_dim = d;
  fc.causal = causal;
  fc.per_head = causal;  // both kinds over a loop
  fc.q_type = q_type;
  testing::Fp8Attend a = testing::MakeFp8Attend(fc, rng);
  auto result = c.Attend(a.q, a.k.codes, a.v.codes, a.options);
  if (!result.ok()) {
    ADD_FAILURE() << result.status();
    return {std::move(a), INFINITY};
  }
  const double err = testing::Fp8AttendError(a, result->o);
  return {std::move(a), err};
}

// FP8 K/V (q of a 16- or 32-bit type) and all-FP8 q/k/v on the CUDA backend: batches of more
// than 16 queries per sequence (the conversion and the 16-bit forward kernel) and of at most 16
// (the FP8 decode kernel), descales per (sequence, KV head) and per tensor; o against the float64
// reference on exactly the values the codes and descales stand for. A zero descale is
// INVALID_ARGUMENT naming the field, and a good request after it is answered right.
// (--fp8_attention=convert: all-FP8 batches of more than 16 queries are converted too.)
TEST_F(CudaServerTest, Fp8AttendMatchesTheReferenceOfItsDequantizedInputs) {
  ServerOptions options;
  options.fp8_attention = "convert";
  auto s = StartCudaServer(options);
  ASSERT_NE(s.server, nullptr);
  auto info = s.client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  if (!info->fp8().attend_fp8_kv()) {
    GTEST_SKIP() << "this GPU or build has no FP8 Attend (compute capability 9.0, head dims "
                    "64/128/256 compiled for sm_90a)";
  }
  EXPECT_TRUE(info->fp8().attend_fp8_q());
  const Fp8Lengths cases[] = {{{5, 1, 40}, {40, 9, 200}}, {{300}, {700}}, {{3, 16, 1}, {50, 16, 9}}};
  for (const Fp8Lengths& lengths : cases) {
    for (int d : {64, 128}) {
      for (bool causal : {false, true}) {
        for (client::DType qt : {client::DType::kFloat32, client::DType::kBFloat16,
                                 client::DType::kFloat8E4M3}) {
          SCOPED_TRACE(::testing::Message() << "max_q " << lengths.q.size() << " d " << d
                                            << " causal " << causal << " q " << int(qt));
          const auto [a, err] = AttendFp8(*s.client, lengths, d, causal, qt, rng_);
          // fp32 q computes in fp16 on the GPU; K/V rounded once more to 16 bits after the
          // conversion: the 16-bit type's tolerance.
          const double tol = a.out_type == client::DType::kBFloat16 ? 1e-2 : 3e-3;
          EXPECT_LE(err, tol);
          if (qt == client::DType::kFloat8E4M3 && d == 64 && !causal) {
            client::AttendOptions bad = a.options;
            bad.k_descale.assign(bad.k_descale.size(), 0.0f);
            auto refused = s.client->Attend(a.q, a.k.codes, a.v.codes, bad);
            ASSERT_FALSE(refused.ok());
            EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
                << refused.status();
            EXPECT_NE(std::string(refused.status().message()).find("fp8.k_descale"),
                      std::string::npos)
                << refused.status();
            auto again = s.client->Attend(a.q, a.k.codes, a.v.codes, a.options);
            ASSERT_TRUE(again.ok()) << again.status();
          }
        }
      }
    }
  }
}

// --fp8_attention=tensor_cores and auto (the default): all-FP8 Attend batches of more than 16
// queries per sequence run the FP8 tensor-core kernel (head dims 128 and 256), P rounded to e4m3
// there: o within 4e-2 of the float64 reference of the dequantized inputs, and GetServerInfo lists
// the head dims. Decode-sized batches, and q of other types, keep their kernels (the 16-bit
// tolerances hold for them).
TEST_F(CudaServerTest, Fp8AttendOnTensorCoresMatchesTheReferenceOfItsDequantizedInputs) {
  for (const char* mode : {"tensor_cores", "auto"}) {
    SCOPED_TRACE(mode);
    ServerOptions options;
    options.fp8_attention = mode;
    auto s = StartCudaServer(options);
    ASSERT_NE(s.server, nullptr);
    auto info = s.client->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    if (!info->fp8().attend_fp8_q()) GTEST_SKIP() << "this GPU or build has no FP8 Attend";
    const auto& tc_dims = info->fp8().attend_tensor_core_head_dims();
    const Fp8Lengths cases[] = {{{5, 130, 40}, {40, 900, 200}}, {{300}, {700}}, {{3, 16, 1}, {50, 16, 9}}};
    for (const Fp8Lengths& lengths : cases) {
      for (int d : {128, 256}) {
        if (std::find(info->head_dims().begin(), info->head_dims().end(), d) == info->head_dims().end()) {
          continue;
        }
        EXPECT_NE(std::find(tc_dims.begin(), tc_dims.end(), d), tc_dims.end()) << "d " << d;
        for (bool causal : {false, true}) {
          for (client::DType qt : {client::DType::kBFloat16, client::DType::kFloat8E4M3}) {
            SCOPED_TRACE(::testing::Message() << "max_q " << lengths.q.size() << " d " << d
                                              << " causal " << causal << " q " << int(qt));
            const auto [a, err] = AttendFp8(*s.client, lengths, d, causal, qt, rng_);
            const int max_q = *std::max_element(lengths.q.begin(), lengths.q.end());
            const bool tensor_cores = qt == client::DType::kFloat8E4M3 && max_q > 16;
            const double tol = tensor_cores ? 4e-2 : a.out_type == client::DType::kBFloat16 ? 1e-2 : 3e-3;
            EXPECT_LE(err, tol);
          }
        }
      }
    }
  }
}

TEST_F(CudaServerTest, ConcurrentClientsAreBatchedAndEachAnswerIsRight) {
  ServerOptions options;
  options.max_queue_delay_us = 2000;
  options.streams = 2;
  auto s = StartCudaServer(options);
  ASSERT_NE(s.server, nullptr);
  constexpr int kClients = 32, kEach = 8;
  std::atomic<int> wrong{0}, failed{0}, batched{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(c * 7919 + 1);
      for (int i = 0; i < kEach; ++i) {
        RequestShape shape;
        shape.seq_q = 1 + (c * 13 + i * 7) % 200;
        shape.seq_k = shape.seq_q + (i % 3) * 17;
        shape.heads = 8;
        shape.kv_heads = 4;
        shape.head_dim = 128;
        shape.causal = true;
        auto r = MakeRandomRequest(shape, rng);
        auto result = s.client->Attend(r.q, r.k, r.v, r.options);
        if (!result.ok()) {
          ++failed;
          continue;
        }
        if (!(testing::ErrorAgainstReference(r, result->o) <= 1e-2)) ++wrong;
        if (result->timing.batch_requests() > 1) ++batched;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(batched.load(), 0) << "no request shared a batch with another";
  std::printf("%d of %d requests were computed in a batch of several\n", batched.load(),
              kClients * kEach);
}

// Sends a request of 8192 tokens, 4 heads, d=64 (4 MiB per bf16 tensor), which must fail with
// RESOURCE_EXHAUSTED naming `flag`, then a small one, which must be answered correctly.
void ExpectOnlyTheBigRequestFails(const testing::LoopbackServer& s, const std::string& flag,
                                  std::mt19937_64& rng) {
  RequestShape big;
  big.seq_q = big.seq_k = 8192;
  big.heads = big.kv_heads = 4;
  big.head_dim = 64;
  auto r_big = MakeRandomRequest(big, rng);
  auto result = s.client->Attend(r_big.q, r_big.k, r_big.v, r_big.options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  EXPECT_NE(result.status().message().find(flag), std::string::npos) << result.status();
  auto r_small = MakeRandomRequest(RequestShape{}, rng);
  auto ok = s.client->Attend(r_small.q, r_small.k, r_small.v, r_small.options);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_LE(testing::ErrorAgainstReference(r_small, ok->o), 1e-2);
}

TEST_F(CudaServerTest, DevicePoolExhaustionFailsOnlyTheRequestThatDoesNotFit) {
  ServerOptions options;
  options.device_pool_bytes = 8 << 20;  // q, k, v and o of the big request do not fit
  auto s = StartCudaServer(options);
  ASSERT_NE(s.server, nullptr);
  const PoolsAtRest rest(s);
  ExpectOnlyTheBigRequestFails(s, "device_pool_bytes", rng_);
  const BackendMemory m = s.server->backend().Memory();
  EXPECT_EQ(m.device_pool.used, rest.device);
  EXPECT_EQ(m.pinned_pool.used, rest.pinned);
  EXPECT_GT(m.gpu_total, 0);
}

TEST_F(CudaServerTest, PinnedPoolExhaustionFailsOnlyTheRequestThatDoesNotFit) {
  ServerOptions options;
  options.pinned_pool_bytes = 4 << 20;  // the big request's 12 MiB of inputs do not fit
  auto s = StartCudaServer(options);
  ASSERT_NE(s.server, nullptr);
  const PoolsAtRest rest(s);
  ExpectOnlyTheBigRequestFails(s, "pinned_pool_bytes", rng_);
  EXPECT_EQ(s.server->backend().Memory().pinned_pool.used, rest.pinned);
}

TEST_F(CudaServerTest, BatchThatDoesNotFitTheDevicePoolRunsInParts) {
  // Each request needs 4 MiB of device memory (q, k, v and o of 1 MiB each); the pool holds 6.
  ServerOptions options;
  options.device_pool_bytes = 6 << 20;
  options.max_queue_delay_us = 300000;  // the four requests are queued together
  options.gather_when_idle = true;
  auto s = StartCudaServer(options);
  ASSERT_NE(s.server, nullptr);
  const PoolsAtRest rest(s);
  constexpr int kRequests = 4;
  std::vector<std::thread> threads;
  std::atomic<int> bad{0}, alone{0};
  for (int c = 0; c < kRequests; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(c + 500);
      RequestShape shape;
      shape.seq_q = shape.seq_k = 2048;
      shape.heads = shape.kv_heads = 4;
      shape.head_dim = 64;
      auto r = MakeRandomRequest(shape, rng);
      auto result = s.client->Attend(r.q, r.k, r.v, r.options);
      if (!result.ok()) {
        ADD_FAILURE() << result.status();
        ++bad;
        return;
      }
      if (!(testing::ErrorAgainstReference(r, result->o) <= 1e-2)) ++bad;
      if (result->timing.batch_requests() == 1) ++alone;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(alone.load(), kRequests) << "each launch should have held one request";
  EXPECT_EQ(s.server->backend().Memory().device_pool.used, rest.device);
}

TEST_F(CudaServerTest, DevicePoolMemoryIsReused) {
  auto s = StartCudaServer();
  ASSERT_NE(s.server, nullptr);
  const PoolsAtRest rest(s);
  RequestShape shape;
  shape.seq_q = shape.seq_k = 1024;
  shape.heads = 8;
  shape.kv_heads = 2;
  shape.head_dim = 128;
  int64_t reserved_after_first = 0;
  for (int i = 0; i < 6; ++i) {
    auto r = MakeRandomRequest(shape, rng_);
    auto result = s.client->Attend(r.q, r.k, r.v, r.options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_LE(testing::ErrorAgainstReference(r, result->o), 1e-2);
    const BackendMemory m = s.server->backend().Memory();
    EXPECT_EQ(m.device_pool.used, rest.device);
    EXPECT_GT(m.device_pool.reserved, 0);
    if (i == 0) reserved_after_first = m.device_pool.reserved;
    EXPECT_EQ(m.device_pool.reserved, reserved_after_first) << "request " << i;
  }
}

TEST_F(CudaServerTest, LargeRequestsOnFourStreams) {
  ServerOptions options;
  options.streams = 4;
  options.max_queue_delay_us = 0;
  auto s = StartCudaServer(options);
  ASSERT_NE(s.server, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int c = 0; c < 6; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(c + 100);
      RequestShape shape;
      shape.seq_q = shape.seq_k = 1024 + 97 * c;
      shape.heads = 4;
      shape.kv_heads = 1;
      shape.head_dim = 128;
      auto r = MakeRandomRequest(shape, rng);
      auto result = s.client->Attend(r.q, r.k, r.v, r.options);
      if (!result.ok() || !(testing::ErrorAgainstReference(r, result->o) <= 1e-2)) ++bad;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace attn
