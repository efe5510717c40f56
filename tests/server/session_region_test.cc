// Session steps (Step, BatchStep) through same-host shared memory: q, k_new and v_new read from a
// host region, o and lse written into one, checked against the float64 reference over the
// session's whole cache; every bad region field refused by name with the session unchanged; and
// regions refused while shared memory is off. CPU backend, real attnd in-process on loopback.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attn/client/region_client.h"
#include "region_test_util.h"
#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using client::RegionSliceOf;
using testing::RegionRig;
using testing::SessionSpec;

// Where a region step's tensors lie: q, k_new, v_new back to back in "in" from in_at; o then
// lse back to back in "out" from out_at.
struct Placement {
  uint64_t in_at = 0;
  uint64_t out_at = 0;
};

// step's tensors copied into the rig's regions, and the step rewritten to name them.
v1::StepRequest InRegions(const v1::StepRequest& step, RegionRig& rig, Placement at) {
  v1::StepRequest r = step;
  uint64_t in = at.in_at;
  for (v1::Tensor* t : {r.mutable_q(), r.mutable_k_new(), r.mutable_v_new()}) {
    const std::string data = std::move(*t->mutable_data());
    t->clear_data();
    std::memcpy(rig.in().data() + in, data.data(), data.size());
    *t->mutable_region() = RegionSliceOf("in", in, data.size());
    in += data.size();
  }
  const uint64_t o_bytes = step.q().data().size();
  *r.mutable_o_region() = RegionSliceOf("out", at.out_at, o_bytes);
  if (r.return_lse()) {
    const uint64_t lse_bytes = 4 * uint64_t(step.q().shape(0)) * uint64_t(step.q().shape(1));
    *r.mutable_lse_region() = RegionSliceOf("out", at.out_at + o_bytes, lse_bytes);
  }
  return r;
}

// The response of a region step with o and lse read back from "out" into its data fields, after
// checking that the response itself names the regions and carries no bytes.
v1::StepResponse ReadBack(const v1::StepRequest& region_step, v1::StepResponse response,
                          RegionRig& rig) {
  EXPECT_TRUE(response.o().data().empty());
  EXPECT_EQ(response.o().region().region(), "out");
  const v1::RegionSlice& o = region_step.o_region();
  response.mutable_o()->set_data(std::string(rig.out().data() + o.offset(), o.bytes()));
  if (region_step.return_lse()) {
    EXPECT_TRUE(response.lse().data().empty());
    const v1::RegionSlice& lse = region_step.lse_region();
    response.mutable_lse()->set_data(std::string(rig.out().data() + lse.offset(), lse.bytes()));
  }
  return response;
}

std::string CreateSession(RegionRig& rig, const SessionSpec& spec) {
  v1::CreateSessionResponse created;
  const grpc::Status st = testing::CreateSession(rig.client().stub(), spec, &created);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return created.session_id();
}

void Poison(RegionRig& rig) { std::memset(rig.out().data(), 0xFF, rig.out().size()); }

// Steps of a session of spec with every tensor in regions, each against the reference.
void StepsThroughRegions(const SessionSpec& spec) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  const std::string id = CreateSession(rig, spec);
  testing::SessionShadow shadow(spec);
  std::mt19937_64 rng(21);
  // A chunked prefill, decode steps, another chunk; both layers; with and without lse.
  const std::vector<std::pair<int, int>> steps = {{0, 9}, {1, 9}, {0, 1}, {1, 1}, {0, 1}, {0, 5}};
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto [layer, tokens] = steps[i];
    v1::StepRequest step = testing::RandomStep(id, layer, tokens, spec, rng);
    step.set_return_lse(i % 2 == 0);
    const v1::StepRequest region_step = InRegions(step, rig, {.in_at = 64 * i, .out_at = 32 * i});
    Poison(rig);
    v1::StepResponse response;
    const grpc::Status st = testing::Step(rig.client().stub(), region_step, &response);
    ASSERT_TRUE(st.ok()) << "step " << i << ": " << st.error_message();
    shadow.Append(step);
    EXPECT_EQ(response.cached_tokens(), shadow.Tokens(layer));
    const testing::SessionShadow::Error err =
        shadow.Check(step, ReadBack(region_step, response, rig));
    EXPECT_EQ(err.non_finite, 0) << "step " << i;
    EXPECT_LT(err.o, testing::StepTolerance(spec.dtype)) << "step " << i;
    EXPECT_LT(err.lse, 2e-5) << "step " << i;
  }
}

TEST(SessionRegionTest, StepsThroughRegionsMatchTheReference) { StepsThroughRegions({}); }

// An FP8 cache: 16-bit k_new/v_new read from a host region and quantized as they are appended.
TEST(SessionRegionTest, StepsOfAnFp8CacheThroughRegionsMatchTheReference) {
  SessionSpec spec;
  spec.fp8_cache = true;
  spec.k_scales.assign(static_cast<size_t>(spec.kv_heads), 0.8f / 448);  // some saturate
  spec.v_scales.assign(static_cast<size_t>(spec.kv_heads), 1.5f / 448);
  StepsThroughRegions(spec);
}

TEST(SessionRegionTest, BatchStepMixesRegionAndInlineItems) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  const SessionSpec spec;
  const std::string a = CreateSession(rig, spec), b = CreateSession(rig, spec);
  testing::SessionShadow shadow_a(spec), shadow_b(spec);
  std::mt19937_64 rng(22);
  for (int round = 0; round < 3; ++round) {
    const int tokens = round == 0 ? 6 : 1;
    v1::StepRequest step_a = testing::RandomStep(a, 0, tokens, spec, rng);
    v1::StepRequest step_b = testing::RandomStep(b, 0, tokens, spec, rng);
    step_a.set_return_lse(true);
    const v1::StepRequest region_a = InRegions(step_a, rig, {});
    Poison(rig);
    v1::BatchStepRequest batch;
    *batch.add_steps() = region_a;
    *batch.add_steps() = step_b;
    v1::BatchStepResponse response;
    grpc::ClientContext ctx;
    rig.client().PrepareContext(&ctx, std::chrono::milliseconds(10000));
    const grpc::Status st = rig.client().stub()->BatchStep(&ctx, batch, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(response.results_size(), 2);
    ASSERT_EQ(response.results(0).status_code(), 0) << response.results(0).status_message();
    ASSERT_EQ(response.results(1).status_code(), 0) << response.results(1).status_message();
    shadow_a.Append(step_a);
    shadow_b.Append(step_b);
    const auto err_a = shadow_a.Check(step_a, ReadBack(region_a, response.results(0).response(), rig));
    const auto err_b = shadow_b.Check(step_b, response.results(1).response());
    EXPECT_LT(err_a.o, testing::StepTolerance(spec.dtype)) << "round " << round;
    EXPECT_LT(err_a.lse, 2e-5) << "round " << round;
    EXPECT_LT(err_b.o, testing::StepTolerance(spec.dtype)) << "round " << round;
  }
}

struct BadRegionCase {
  std::string name;
  std::function<void(v1::StepRequest&)> corrupt;
  grpc::StatusCode code;
  std::string message;  // a part of the message, naming the field
};

TEST(SessionRegionTest, BadRegionFieldsAreRefusedByNameAndChangeNothing) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  const SessionSpec spec;
  const std::string id = CreateSession(rig, spec);
  std::mt19937_64 rng(23);
  v1::StepRequest step = testing::RandomStep(id, 0, 3, spec, rng);
  step.set_return_lse(true);
  const v1::StepRequest good = InRegions(step, rig, {});
  const uint64_t q_bytes = step.q().data().size();
  const uint64_t kv_bytes = step.k_new().data().size();
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const std::vector<BadRegionCase> cases = {
      {"unknown region", [](auto& r) { r.mutable_q()->mutable_region()->set_region("nope"); },
       grpc::StatusCode::NOT_FOUND, "q.region"},
      {"region name empty", [](auto& r) { r.mutable_k_new()->mutable_region()->set_region(""); },
       grpc::StatusCode::INVALID_ARGUMENT, "k_new.region.region (the region's name) is empty"},
      {"bytes short", [](auto& r) { r.mutable_v_new()->mutable_region()->set_bytes(8); },
       grpc::StatusCode::INVALID_ARGUMENT, "v_new.region.bytes is 8"},
      {"past the end", [&](auto& r) { r.mutable_q()->mutable_region()->set_offset(rig.in().size() - 8); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.region: offset"},
      {"offset overflows", [](auto& r) { r.mutable_k_new()->mutable_region()->set_offset(kMax - 4); },
       grpc::StatusCode::INVALID_ARGUMENT, "k_new.region: offset"},
      {"o too small", [](auto& r) { r.mutable_o_region()->set_bytes(16); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_region.bytes is 16"},
      {"lse without return_lse", [](auto& r) { r.set_return_lse(false); },
       grpc::StatusCode::INVALID_ARGUMENT, "lse_region is set, but return_lse is false"},
      {"o overlaps q", [](auto& r) { *r.mutable_o_region() = RegionSliceOf("in", 0, r.o_region().bytes()); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_region overlaps q.region"},
      {"o overlaps lse", [&](auto& r) { r.mutable_lse_region()->set_offset(q_bytes - 8); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_region overlaps lse_region"},
      {"data and region", [](auto& r) { r.mutable_v_new()->set_data(std::string(8, 'x')); },
       grpc::StatusCode::INVALID_ARGUMENT, "v_new.data and v_new.region are both set"},
      // Offsets that are not a multiple of the element size (2 for the cache's 16-bit dtype, 4
      // for lse), each slice otherwise inside its region.
      {"q at an odd offset", [](auto& r) { r.mutable_q()->mutable_region()->set_offset(1); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "q.region: offset 1 is not a multiple of 2, the size of the tensor's elements"},
      {"k_new at an odd offset",
       [](auto& r) { r.mutable_k_new()->mutable_region()->set_offset(r.k_new().region().offset() + 3); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "k_new.region: offset " + std::to_string(q_bytes + 3) + " is not a multiple of 2"},
      {"v_new at an odd offset",
       [](auto& r) { r.mutable_v_new()->mutable_region()->set_offset(r.v_new().region().offset() - 1); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "v_new.region: offset " + std::to_string(q_bytes + kv_bytes - 1) + " is not a multiple of 2"},
      {"o at an odd offset", [](auto& r) { r.mutable_o_region()->set_offset(5); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_region: offset 5 is not a multiple of 2"},
      {"lse at an offset of 2 mod 4",
       [](auto& r) { r.mutable_lse_region()->set_offset(r.lse_region().offset() + 2); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "lse_region: offset " + std::to_string(q_bytes + 2) + " is not a multiple of 4"},
      {"lse at an odd offset",
       [](auto& r) { r.mutable_lse_region()->set_offset(r.lse_region().offset() + 1); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "lse_region: offset " + std::to_string(q_bytes + 1) + " is not a multiple of 4"},
  };
  for (const BadRegionCase& c : cases) {
    v1::StepRequest bad = good;
    c.corrupt(bad);
    v1::StepResponse response;
    const grpc::Status st = testing::Step(rig.client().stub(), bad, &response);
    EXPECT_EQ(st.error_code(), c.code) << c.name << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(c.message), std::string::npos)
        << c.name << ": " << st.error_message();
  }
  // No bad step appended anything: the good one finds an empty cache.
  v1::StepResponse response;
  const grpc::Status st = testing::Step(rig.client().stub(), good, &response);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(response.cached_tokens(), 3);
}

TEST(SessionRegionTest, RegionsAreRefusedWhileSharedMemoryIsOff) {
  auto server = testing::StartLoopbackServer();
  const SessionSpec spec;
  v1::CreateSessionResponse created;
  ASSERT_TRUE(testing::CreateSession(server.client->stub(), spec, &created).ok());
  std::mt19937_64 rng(24);
  v1::StepRequest step = testing::RandomStep(created.session_id(), 0, 2, spec, rng);
  *step.mutable_o_region() = RegionSliceOf("out", 0, step.q().data().size());
  v1::StepResponse response;
  const grpc::Status st = testing::Step(server.client->stub(), step, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("o_region names a shared-memory region, but shared memory is off"),
            std::string::npos)
      << st.error_message();
}

}  // namespace
}  // namespace attn
