#include "transport/tensor_source.h"

#include "absl/strings/str_cat.h"
#include "attn/kernels/attention.h"
#include "common/status_util.h"
#include "transport/region_registry.h"

namespace attn {
namespace {

// True when [a, a + an) and [b, b + bn) share a byte of one region.
bool Overlap(const ResolvedBytes& a, const ResolvedBytes& b) {
  if (a.region == nullptr || a.region != b.region) return false;
  return a.data < b.data + b.bytes && b.data < a.data + a.bytes;
}

// GPU regions are all or nothing: the CUDA backend then moves the request only on the device, and
// never reads it on the host (so float32, which it converts on the host, cannot use them).
absl::Status CheckGpuUse(const v1::AttendRequest& r, const ResolvedBytes& q,
                         const ResolvedBytes& k, const ResolvedBytes& v, const ResolvedBytes& o,
                         const ResolvedBytes& lse) {
  const bool any = q.on_gpu || k.on_gpu || v.on_gpu || o.on_gpu || lse.on_gpu;
  if (!any) return absl::OkStatus();
  const std::pair<const ResolvedBytes*, const char*> parts[] = {
      {&q, "q.region"}, {&k, "k.region"}, {&v, "v.region"}, {&o, "o_region"}};
  for (const auto& [part, name] : parts) {
    if (!part->on_gpu) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " must name a GPU region (REGION_KIND_CUDA) too: a request that uses one has q, "
          "k, v and o_region (and lse_region) all in GPU regions"));
    }
  }
  if (r.return_lse() && !lse.on_gpu) {
    return absl::InvalidArgumentError(
        "lse_region must name a GPU region (REGION_KIND_CUDA) too: a request that uses one has "
        "q, k, v and o_region (and lse_region) all in GPU regions");
  }
  if (r.q().dtype() == v1::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError(
        "q.dtype DTYPE_FLOAT32 cannot be used with GPU regions; send float16 or bfloat16");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ResolvedBytes> ResolveSlice(const v1::RegionSlice& slice, const std::string& field,
                                           uint64_t want_bytes, const std::string& owner,
                                           const RegionRegistry* registry) {
  if (registry == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " names a shared-memory region, but shared memory is off on this attnd (start it "
        "with --allow_shared_memory)"));
  }
  if (slice.region().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".region (the region's name) is empty"));
  }
  if (slice.bytes() != want_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".bytes is ", slice.bytes(),
                                                   ", but the tensor needs ", want_bytes));
  }
  auto region = registry->Find(owner, slice.region(), absl::StrCat(field, ".region"));
  if (!region.ok()) return region.status();
  const uint64_t size = (*region)->size();
  // offset + bytes <= size, written so that it cannot overflow.
  if (slice.offset() > size || slice.bytes() > size - slice.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset ", slice.offset(), " + bytes ", slice.bytes(),
        " runs past the end of region '", slice.region(), "' (", size, " bytes)"));
  }
  ResolvedBytes out;
  out.data = (*region)->data() + slice.offset();
  out.bytes = slice.bytes();
  out.region = region->get();
  out.on_gpu = (*region)->on_gpu();
  out.hold = std::move(*region);
  return out;
}

absl::StatusOr<ResolvedBytes> ResolveTensor(const v1::Tensor& t, const std::string& field,
                                            uint64_t want_bytes, const std::string& owner,
                                            const RegionRegistry* registry) {
  if (t.has_region()) {
    return ResolveSlice(t.region(), absl::StrCat(field, ".region"), want_bytes, owner, registry);
  }
  ResolvedBytes out;
  out.data = const_cast<char*>(t.data().data());
  out.bytes = t.data().size();
  return out;
}

absl::Status ResolveAttendTensors(const v1::AttendRequest& r, const std::string& owner,
                                  const RegionRegistry* registry, AttendJob* job) {
  const bool any = r.q().has_region() || r.k().has_region() || r.v().has_region() ||
                   r.has_o_region() || r.has_lse_region();
  if (!any) return absl::OkStatus();
  const BatchKey& key = job->key;
  const uint64_t elem = kernels::DTypeSize(key.wire_dtype);
  const uint64_t q_bytes = uint64_t(job->total_q) * key.num_heads * key.head_dim * elem;
  const uint64_t kv_bytes = uint64_t(job->total_k) * key.num_kv_heads * key.head_dim * elem;
  const uint64_t lse_bytes = uint64_t(job->total_q) * key.num_heads * sizeof(float);
  auto q = ResolveTensor(r.q(), "q", q_bytes, owner, registry);
  if (!q.ok()) return q.status();
  auto k = ResolveTensor(r.k(), "k", kv_bytes, owner, registry);
  if (!k.ok()) return k.status();
  auto v = ResolveTensor(r.v(), "v", kv_bytes, owner, registry);
  if (!v.ok()) return v.status();
  ResolvedBytes o, lse;
  if (r.has_o_region()) {
    auto s = ResolveSlice(r.o_region(), "o_region", q_bytes, owner, registry);
    if (!s.ok()) return s.status();
    o = std::move(*s);
  }
  if (r.has_lse_region()) {
    if (!r.return_lse()) {
      return absl::InvalidArgumentError("lse_region is set, but return_lse is false");
    }
    auto s = ResolveSlice(r.lse_region(), "lse_region", lse_bytes, owner, registry);
    if (!s.ok()) return s.status();
    lse = std::move(*s);
  }
  // An output that overlaps an input (or the other output) would be read while it is written.
  for (const auto& [out, out_name] : {std::pair{&o, "o_region"}, std::pair{&lse, "lse_region"}}) {
    for (const auto& [in, in_name] :
         {std::pair{&*q, "q.region"}, std::pair{&*k, "k.region"}, std::pair{&*v, "v.region"}}) {
      if (Overlap(*out, *in)) {
        return absl::InvalidArgumentError(
            absl::StrCat(out_name, " overlaps ", in_name, " in region '",
                         out == &o ? r.o_region().region() : r.lse_region().region(),
                         "'; outputs need bytes of their own"));
      }
    }
  }
  if (Overlap(o, lse)) {
    return absl::InvalidArgumentError("o_region overlaps lse_region; outputs need bytes of their own");
  }
  RETURN_IF_ERROR(CheckGpuUse(r, *q, *k, *v, o, lse));
  job->device_tensors = q->on_gpu;
  job->q_bytes = {q->data, q->bytes};
  job->k_bytes = {k->data, k->bytes};
  job->v_bytes = {v->data, v->bytes};
  job->o_out = o.data;
  job->lse_out = lse.data;
  // One hold per region, so that RegionInfo.in_flight counts requests, not tensors.
  for (ResolvedBytes* b : {&*q, &*k, &*v, &o, &lse}) {
    if (!b->hold) continue;
    bool held = false;
    for (const auto& h : job->region_holds) held = held || h.get() == b->hold.get();
    if (!held) job->region_holds.push_back(std::move(b->hold));
  }
  return absl::OkStatus();
}

}  // namespace attn
