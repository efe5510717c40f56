#include "bench_region.h"

#include <cstring>

namespace attn::client {
namespace {

v1::Tensor InRegion(const v1::Tensor& t, const std::string& name, uint64_t offset) {
  v1::Tensor out;
  out.set_dtype(t.dtype());
  *out.mutable_shape() = t.shape();
  *out.mutable_region() = RegionSliceOf(name, offset, t.data().size());
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BenchRegion>> BenchRegion::Create(
    RegionClient* regions, const std::string& name, const v1::AttendRequest* inline_request) {
  const v1::AttendRequest& r = *inline_request;
  const uint64_t q = r.q().data().size(), k = r.k().data().size(), v = r.v().data().size();
  const uint64_t lse = r.return_lse() ? 4 * uint64_t(r.q().shape(0)) * r.q().shape(1) : 0;
  auto region = HostRegion::Create(q + k + v + q + lse);
  if (!region.ok()) return region.status();
  auto info = regions->Register(name, **region);
  if (!info.ok()) return info.status();
  std::unique_ptr<BenchRegion> b(new BenchRegion(inline_request, std::move(*region)));
  b->request_ = r;
  *b->request_.mutable_q() = InRegion(r.q(), name, 0);
  *b->request_.mutable_k() = InRegion(r.k(), name, q);
  *b->request_.mutable_v() = InRegion(r.v(), name, q + k);
  *b->request_.mutable_o_region() = RegionSliceOf(name, q + k + v, q);
  if (lse > 0) *b->request_.mutable_lse_region() = RegionSliceOf(name, q + k + v + q, lse);
  b->WriteInputs();
  return b;
}

void BenchRegion::WriteInputs() {
  char* p = region_->data();
  for (const v1::Tensor* t : {&inline_->q(), &inline_->k(), &inline_->v()}) {
    std::memcpy(p, t->data().data(), t->data().size());
    p += t->data().size();
  }
}

}  // namespace attn::client
