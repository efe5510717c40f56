#include "region_test_util.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace attn::testing {

RegionRig::~RegionRig() {
  regions_.reset();
  client_.reset();
  server_ = LoopbackServer();
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

bool RegionRig::Start() {
  char dir[] = "/tmp/attn-shm-test-XXXXXX";
  if (mkdtemp(dir) == nullptr) return false;
  dir_ = dir;
  socket_path_ = dir_ + "/regions.sock";
  ServerOptions o;
  o.backend = "cpu";
  o.threads = options_.threads;
  o.allow_shared_memory = true;
  o.shm_socket = socket_path_;
  o.shm_max_regions_per_client = options_.max_regions;
  o.shm_max_bytes_per_client = options_.max_bytes;
  client::ClientOptions co;
  if (!options_.tokens.empty()) {
    o.auth_token_file = dir_ + "/tokens";
    std::ofstream out(o.auth_token_file);
    for (const auto& t : options_.tokens) out << t << "\n";
    co.bearer_token = options_.tokens.front();
  }
  server_ = StartLoopbackServerWithClient(o, co);
  if (!server_.server) return false;
  co.target = server_.target;
  auto c = client::Client::Create(co);
  if (!c.ok()) return false;
  client_ = std::move(*c);
  auto regions = client::RegionClient::Connect(client_.get());
  if (!regions.ok()) {
    ADD_FAILURE() << regions.status();
    return false;
  }
  regions_ = std::move(*regions);
  std::mt19937_64 rng(11);
  random_ = MakeRandomRequest({.seq_q = options_.seq, .seq_k = options_.seq}, rng);
  auto in = client::HostRegion::Create(q_bytes() + 2 * kv_bytes());
  auto out = client::HostRegion::Create(o_bytes() + lse_bytes() + kOutSlack);
  if (!in.ok() || !out.ok()) return false;
  in_ = std::move(*in);
  out_ = std::move(*out);
  std::memcpy(in_->data(), random_.q.data.data(), q_bytes());
  std::memcpy(in_->data() + q_bytes(), random_.k.data.data(), kv_bytes());
  std::memcpy(in_->data() + q_bytes() + kv_bytes(), random_.v.data.data(), kv_bytes());
  for (auto [name, region] : {std::pair{"in", in_.get()}, std::pair{"out", out_.get()}}) {
    auto info = regions_->Register(name, *region);
    if (!info.ok()) {
      ADD_FAILURE() << name << ": " << info.status();
      return false;
    }
  }
  return true;
}

v1::AttendRequest RegionRig::InlineRequest(bool lse) const {
  v1::AttendRequest r =
      client::Client::BuildAttendRequest(random_.q, random_.k, random_.v, random_.options);
  r.set_return_lse(lse);
  return r;
}

v1::AttendRequest RegionRig::RegionRequest(bool o_in_region, bool lse) const {
  v1::AttendRequest r = InlineRequest(lse);
  auto shape = [](const client::Tensor& t) { return std::vector<int64_t>(t.shape); };
  *r.mutable_q() = client::RegionTensor(random_.q.dtype, shape(random_.q), "in", 0);
  *r.mutable_k() = client::RegionTensor(random_.k.dtype, shape(random_.k), "in", q_bytes());
  *r.mutable_v() =
      client::RegionTensor(random_.v.dtype, shape(random_.v), "in", q_bytes() + kv_bytes());
  if (o_in_region) {
    *r.mutable_o_region() = client::RegionSliceOf("out", 0, o_bytes());
    if (lse) *r.mutable_lse_region() = client::RegionSliceOf("out", lse_offset(), lse_bytes());
  }
  return r;
}

absl::Status RegionRig::Attend(const v1::AttendRequest& request, v1::AttendResponse* response) {
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, std::chrono::milliseconds(60000));
  return client::FromGrpc(client_->stub()->Attend(&ctx, request, response));
}

absl::Status RegionRig::Register(const v1::RegisterRegionRequest& request) {
  v1::RegisterRegionResponse response;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, std::chrono::milliseconds(10000));
  return client::FromGrpc(regions_->stub()->RegisterRegion(&ctx, request, &response));
}

std::unique_ptr<client::Client> RegionRig::ClientWithToken(const std::string& token) const {
  client::ClientOptions co;
  co.target = server_.target;
  co.bearer_token = token;
  auto c = client::Client::Create(co);
  return c.ok() ? std::move(*c) : nullptr;
}

}  // namespace attn::testing
