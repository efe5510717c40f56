// attnd on the CUDA backend after its CUDA context is broken by a faulting kernel (a sticky
// error): requests get a clear status instead of a crash, and health turns NOT_SERVING so that
// probes restart the process. In a process of its own: the context cannot be repaired.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "break_context.h"
#include "test_util.h"

namespace attn {
namespace {

using testing::MakeRandomRequest;
using testing::RequestShape;

TEST(CudaDeviceLost, RequestsFailCleanlyAndHealthTurnsNotServing) {
  int n = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&n); err != cudaSuccess || n == 0) {
    GTEST_SKIP() << "no CUDA device: "
                 << (err != cudaSuccess ? cudaGetErrorString(err) : "none found");
  }
  ServerOptions options;
  options.backend = "cuda";
  options.metrics_listen = "";
  auto s = testing::StartLoopbackServer(options);
  ASSERT_NE(s.server, nullptr);
  std::mt19937_64 rng{std::random_device{}()};
  RequestShape shape;
  shape.head_dim = 64;
  auto r = MakeRandomRequest(shape, rng);
  auto before = s.client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(s.client->Health().value_or(false), true);

  const cudaError_t broken = testing::BreakTheCudaContext();
  ASSERT_NE(broken, cudaSuccess) << "the faulting kernel did not fault";
  std::printf("context broken: %s\n", cudaGetErrorName(broken));

  // The first request after the fault may meet it in its launch (INTERNAL); from then on the
  // backend knows, and refuses at once with UNAVAILABLE, which clients retry elsewhere.
  auto first = s.client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_FALSE(first.ok());
  EXPECT_TRUE(first.status().code() == absl::StatusCode::kInternal ||
              first.status().code() == absl::StatusCode::kUnavailable)
      << first.status();
  auto second = s.client->Attend(r.q, r.k, r.v, r.options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find("restarted"), std::string::npos) << second.status();

  bool serving = true;
  for (int i = 0; i < 40 && serving; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    serving = s.client->Health().value_or(true);
  }
  EXPECT_FALSE(serving) << "health still SERVING 4 s after the device was lost";
  EXPECT_FALSE(s.client->Health("attn.v1.Attention").value_or(true));
}

}  // namespace
}  // namespace attn
