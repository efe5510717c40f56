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

}  // namespace

absl::StatusOr<ResolvedBytes> ResolveSlice(const v1::RegionSlice& slice, const std::string& field,
                                           SliceShape want, const std::string& owner,
                                           const RegionRegistry* registry) {
  if (registry == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " names a shared-memory region, but shared memory is off on this attnd (start it "
        "with --allow_shared_memory)"));
  }
  if (slice.region().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".region (the region's name) is empty"));
  }
  if (slice.bytes() != want.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".bytes is ", slice.bytes(),
                                                   ", but the tensor needs ", want.bytes));
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
  if (slice.offset() % want.element_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset ", slice.offset(), " is not a multiple of ", want.element_bytes,
        ", the size of the tensor's elements: a tensor in a region must start at a multiple of "
        "its element size (2 for float16 and bfloat16, 4 for float32 and lse)"));
  }
  ResolvedBytes out;
  out.data = (*region)->data() + slice.offset();
  out.bytes = slice.bytes();
  out.region = region->get();
  out.on_gpu = (*region)->on_gpu();
  out.device_registered = (*region)->device_registered();
  out.hold = std::move(*region);
  return out;
}

absl::StatusOr<ResolvedBytes> ResolveTensor(const v1::Tensor& t, const std::string& field,
                                            SliceShape want, const std::string& owner,
                                            const RegionRegistry* registry) {
  if (t.has_region()) {
    return ResolveSlice(t.region(), absl::StrCat(field, ".region"), want, owner, registry);
  }
  ResolvedBytes out;
  out.data = const_cast<char*>(t.data().data());
  out.bytes = t.data().size();
  return out;
}

namespace {

// A request's tensor fields under the names its message gives them.
struct TensorFields {
  const v1::Tensor* q;
  const v1::Tensor* k;
  const v1::Tensor* v;
  const char* k_name;
  const char* v_name;
  const v1::RegionSlice* o_region;    // null: o goes into the response
  const v1::RegionSlice* lse_region;  // null: lse (if asked for) goes into the response
  bool return_lse;
  uint64_t element_bytes;  // of q, k, v and o (lse is float32)
  uint64_t q_bytes, kv_bytes, lse_bytes;
};

struct ResolvedTensors {
  ResolvedBytes q, k, v, o, lse;
};

absl::StatusOr<ResolvedTensors> ResolveFields(const TensorFields& f, const std::string& owner,
                                              const RegionRegistry* registry) {
  ResolvedTensors t;
  const SliceShape q{f.q_bytes, f.element_bytes}, kv{f.kv_bytes, f.element_bytes};
  ASSIGN_OR_RETURN(t.q, ResolveTensor(*f.q, "q", q, owner, registry));
  ASSIGN_OR_RETURN(t.k, ResolveTensor(*f.k, f.k_name, kv, owner, registry));
  ASSIGN_OR_RETURN(t.v, ResolveTensor(*f.v, f.v_name, kv, owner, registry));
  if (f.o_region != nullptr) {
    ASSIGN_OR_RETURN(t.o, ResolveSlice(*f.o_region, "o_region", q, owner, registry));
  }
  if (f.lse_region != nullptr) {
    if (!f.return_lse) {
      return absl::InvalidArgumentError("lse_region is set, but return_lse is false");
    }
    ASSIGN_OR_RETURN(t.lse, ResolveSlice(*f.lse_region, "lse_region",
                                         SliceShape{f.lse_bytes, sizeof(float)}, owner, registry));
  }
  // An output that overlaps an input (or the other output) would be read while it is written.
  const std::string k_region = absl::StrCat(f.k_name, ".region");
  const std::string v_region = absl::StrCat(f.v_name, ".region");
  for (const auto& [out, out_name] : {std::pair{&t.o, "o_region"}, std::pair{&t.lse, "lse_region"}}) {
    for (const auto& [in, in_name] : {std::pair{&t.q, std::string("q.region")},
                                      std::pair{&t.k, k_region}, std::pair{&t.v, v_region}}) {
      if (Overlap(*out, *in)) {
        return absl::InvalidArgumentError(absl::StrCat(
            out_name, " overlaps ", in_name, " in region '",
            out == &t.o ? f.o_region->region() : f.lse_region->region(),
            "'; outputs need bytes of their own"));
      }
    }
  }
  if (Overlap(t.o, t.lse)) {
    return absl::InvalidArgumentError("o_region overlaps lse_region; outputs need bytes of their own");
  }
  return t;
}

// GPU regions are all or nothing: a device backend then moves the request only on the device
// and never reads nor writes it on the host. The message names the first part left out.
absl::Status CheckAllOnGpu(const TensorFields& f, const ResolvedTensors& t) {
  const bool any = t.q.on_gpu || t.k.on_gpu || t.v.on_gpu || t.o.on_gpu || t.lse.on_gpu;
  if (!any) return absl::OkStatus();
  const std::string k_region = absl::StrCat(f.k_name, ".region");
  const std::string v_region = absl::StrCat(f.v_name, ".region");
  const std::pair<const ResolvedBytes*, std::string> parts[] = {
      {&t.q, "q.region"}, {&t.k, k_region}, {&t.v, v_region}, {&t.o, "o_region"},
      {&t.lse, "lse_region"}};
  for (const auto& [part, name] : parts) {
    if (part->on_gpu || (part == &t.lse && !f.return_lse)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        name, " must name a GPU region (REGION_KIND_CUDA) too: a request that uses one has q, ",
        f.k_name, ", ", f.v_name, " and o_region (and lse_region when return_lse) all in GPU "
        "regions"));
  }
  return absl::OkStatus();
}

// Points job's sources and destinations at t and holds each region once (so that
// RegionInfo.in_flight counts requests, not tensors).
void ApplyTo(ResolvedTensors& t, Job* job) {
  job->device_tensors = t.q.on_gpu;
  job->host_registered = {t.q.device_registered, t.k.device_registered, t.v.device_registered,
                          t.o.device_registered, t.lse.device_registered};
  job->q_bytes = {t.q.data, t.q.bytes};
  job->k_bytes = {t.k.data, t.k.bytes};
  job->v_bytes = {t.v.data, t.v.bytes};
  job->o_out = t.o.data;
  job->lse_out = t.lse.data;
  for (const ResolvedBytes* in : {&t.q, &t.k, &t.v}) {
    if (in->hold) job->region_bytes_read += static_cast<int64_t>(in->bytes);
  }
  for (const ResolvedBytes* out : {&t.o, &t.lse}) {
    if (out->hold) job->region_bytes_written += static_cast<int64_t>(out->bytes);
  }
  for (ResolvedBytes* b : {&t.q, &t.k, &t.v, &t.o, &t.lse}) {
    if (!b->hold) continue;
    bool held = false;
    for (const auto& h : job->region_holds) held = held || h.get() == b->hold.get();
    if (!held) job->region_holds.push_back(std::move(b->hold));
  }
}

}  // namespace

absl::Status ResolveAttendTensors(const v1::AttendRequest& r, const std::string& owner,
                                  const RegionRegistry* registry, AttendJob* job) {
  const bool any = r.q().has_region() || r.k().has_region() || r.v().has_region() ||
                   r.has_o_region() || r.has_lse_region();
  if (!any) return absl::OkStatus();
  const BatchKey& key = job->key;
  const uint64_t elem = kernels::DTypeSize(key.wire_dtype);
  TensorFields f{&r.q(), &r.k(), &r.v(), "k", "v",
                 r.has_o_region() ? &r.o_region() : nullptr,
                 r.has_lse_region() ? &r.lse_region() : nullptr, r.return_lse(), elem,
                 uint64_t(job->total_q) * key.num_heads * key.head_dim * elem,
                 uint64_t(job->total_k) * key.num_kv_heads * key.head_dim * elem,
                 uint64_t(job->total_q) * key.num_heads * sizeof(float)};
  ASSIGN_OR_RETURN(ResolvedTensors t, ResolveFields(f, owner, registry));
  RETURN_IF_ERROR(CheckAllOnGpu(f, t));
  if (t.q.on_gpu && r.q().dtype() == v1::DTYPE_FLOAT32) {
    // The CUDA backend converts float32 on the host.
    return absl::InvalidArgumentError(
        "q.dtype DTYPE_FLOAT32 cannot be used with GPU regions; send float16 or bfloat16");
  }
  ApplyTo(t, job);
  return absl::OkStatus();
}

absl::Status ResolveStepTensors(const v1::StepRequest& r, const std::string& owner,
                                const RegionRegistry* registry, bool gpu_regions, Job* job) {
  const BatchKey& key = job->key;
  const uint64_t elem = kernels::DTypeSize(key.wire_dtype);
  TensorFields f{&r.q(), &r.k_new(), &r.v_new(), "k_new", "v_new",
                 r.has_o_region() ? &r.o_region() : nullptr,
                 r.has_lse_region() ? &r.lse_region() : nullptr, r.return_lse(), elem,
                 uint64_t(job->total_q) * key.num_heads * key.head_dim * elem,
                 uint64_t(job->total_q) * key.num_kv_heads * key.head_dim * elem,
                 uint64_t(job->total_q) * key.num_heads * sizeof(float)};
  ASSIGN_OR_RETURN(ResolvedTensors t, ResolveFields(f, owner, registry));
  if (!gpu_regions) {
    // Only a device backend registers GPU regions at all; refused here too, by name, so that a
    // step never reaches a backend that would read a device address on the host.
    const std::pair<const ResolvedBytes*, const char*> parts[] = {
        {&t.q, "q.region"}, {&t.k, "k_new.region"}, {&t.v, "v_new.region"},
        {&t.o, "o_region"}, {&t.lse, "lse_region"}};
    for (const auto& [part, name] : parts) {
      if (part->on_gpu) {
        return absl::FailedPreconditionError(absl::StrCat(
            name, " names a GPU region, but this attnd's backend has no GPU: send the tensors "
            "in host regions (REGION_KIND_HOST) or as data"));
      }
    }
  }
  RETURN_IF_ERROR(CheckAllOnGpu(f, t));
  ApplyTo(t, job);
  return absl::OkStatus();
}

}  // namespace attn
