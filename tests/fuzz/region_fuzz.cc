#include "region_fuzz.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "rpc/attend_validation.h"
#include "rpc/step_validation.h"
#include "session_fuzz.h"
#include "transport/tensor_source.h"

namespace attn::fuzz {
namespace {

// The valid requests inputs start from.
struct Template {
  bool step;
  v1::DType dtype;
  int32_t tokens_q;  // Attend: q tokens; step: new tokens
  int32_t tokens_k;  // Attend: k tokens; step: tokens cached before (a prefill on both sessions)
  int32_t heads, kv_heads, head_dim;
  bool lse, causal;
};

constexpr Template kTemplates[] = {
    {false, v1::DTYPE_FLOAT32, 3, 5, 2, 2, 4, true, true},  // the shape of the first finding
    {false, v1::DTYPE_BFLOAT16, 4, 6, 2, 1, 8, true, false},
    {false, v1::DTYPE_FLOAT16, 3, 2, 1, 1, 3, true, true},  // o of 18 bytes: lse after it is off 4
    {false, v1::DTYPE_FLOAT32, 2, 7, 4, 2, 5, false, false},
    {true, v1::DTYPE_BFLOAT16, 3, 2, 4, 2, 8, true, true},
    {true, v1::DTYPE_FLOAT16, 1, 5, 2, 2, 4, true, true},  // decode
    {true, v1::DTYPE_BFLOAT16, 3, 0, 3, 1, 1, false, true},  // o of 18 bytes
};
constexpr size_t kTemplateCount = sizeof(kTemplates) / sizeof(kTemplates[0]);

const RequestLimits& Limits() {
  static const RequestLimits limits = [] {
    RequestLimits l;
    l.max_tensor_elements = kMaxTensorElements;
    l.head_dims = {1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64};
    return l;
  }();
  return limits;
}

uint64_t ElementBytes(v1::DType t) { return t == v1::DTYPE_FLOAT32 ? 4 : 2; }

// Sizes of q, k, v, o and lse (the last when the template returns it).
std::vector<uint64_t> SlotBytes(const Template& t) {
  const int32_t kv_tokens = t.step ? t.tokens_q : t.tokens_k;
  const uint64_t elem = ElementBytes(t.dtype);
  const uint64_t q = uint64_t(t.tokens_q) * t.heads * t.head_dim * elem;
  const uint64_t kv = uint64_t(kv_tokens) * t.kv_heads * t.head_dim * elem;
  return {q, kv, kv, q, 4 * uint64_t(t.tokens_q) * t.heads};
}

// Finite values of every dtype (as FuzzRegions::Fill's), a pattern of seed's.
std::string FiniteBytes(uint64_t n, uint32_t seed) {
  std::string out(n, '\0');
  uint32_t x = seed * 2654435761u + 7;
  for (char& c : out) {
    x = x * 1664525u + 1013904223u;
    const uint8_t r = static_cast<uint8_t>(x >> 24);
    c = static_cast<char>((r & 0x80) | (r & 0x3f));
  }
  return out;
}

void SetTensor(v1::Tensor* t, v1::DType dtype, int32_t tokens, int32_t heads, int32_t d,
               uint32_t seed) {
  t->set_dtype(dtype);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  t->set_data(FiniteBytes(uint64_t(tokens) * heads * d * ElementBytes(dtype), seed));
}

const char* RegionNameOf(RegionName r) {
  switch (r) {
    case RegionName::kR0: return "r0";
    case RegionName::kR1: return "r1";
    case RegionName::kG0: return "g0";
    default: return "r9";
  }
}

// Applies the input's edits to the three input tensors and the two output slices of a request
// (AttendRequest or StepRequest), whose inline data is `data` (restored for kNone).
template <typename Request>
void ApplyEdits(const uint8_t* edits, size_t count, const std::vector<uint64_t>& bytes,
                const std::string (&data)[3], Request* r, v1::Tensor* const (&in)[3]) {
  for (size_t e = 0; e < count; ++e) {
    const uint8_t* p = edits + e * kRegionEditBytes;
    const auto slot = static_cast<RegionSlot>(p[0] % 5);
    const auto region = static_cast<RegionName>(p[1] % 5);
    uint32_t offset;
    std::memcpy(&offset, p + 2, 4);
    int16_t delta;
    std::memcpy(&delta, p + 6, 2);
    v1::RegionSlice slice;
    slice.set_region(RegionNameOf(region));
    slice.set_offset(offset);
    slice.set_bytes(bytes[static_cast<size_t>(slot)] + delta);
    if (slot <= RegionSlot::kV) {
      v1::Tensor* t = in[static_cast<size_t>(slot)];
      if (region == RegionName::kNone) {
        t->clear_region();
        t->set_data(data[static_cast<size_t>(slot)]);
      } else {
        t->clear_data();
        *t->mutable_region() = slice;
      }
    } else if (slot == RegionSlot::kO) {
      if (region == RegionName::kNone) {
        r->clear_o_region();
      } else {
        *r->mutable_o_region() = slice;
      }
    } else if (region == RegionName::kNone) {
      r->clear_lse_region();
    } else {
      *r->mutable_lse_region() = slice;
    }
  }
}

// The same request with the bytes job read for q, k and v sent inline and its outputs in the
// response.
template <typename Request>
Request InlineTwin(const Request& r, const Job& job, v1::Tensor* (*tensor)(Request*, int)) {
  Request twin = r;
  const std::string_view read[3] = {job.q_bytes, job.k_bytes, job.v_bytes};
  for (int i = 0; i < 3; ++i) {
    v1::Tensor* t = tensor(&twin, i);
    t->clear_region();
    t->set_data(std::string(read[i]));
  }
  twin.clear_o_region();
  twin.clear_lse_region();
  return twin;
}

// "" when a's o (in its region or response) and lse equal b's, byte for byte.
std::string CompareOutputs(std::string_view a_o, std::string_view a_lse, std::string_view b_o,
                           std::string_view b_lse) {
  if (a_o.size() != b_o.size() || std::memcmp(a_o.data(), b_o.data(), a_o.size()) != 0) {
    return "o through regions differs from o of the same request sent inline";
  }
  if (a_lse.size() != b_lse.size() ||
      std::memcmp(a_lse.data(), b_lse.data(), a_lse.size()) != 0) {
    return "lse through regions differs from lse of the same request sent inline";
  }
  return "";
}

std::string_view OutputOf(const char* region_out, uint64_t bytes, const std::string& response) {
  return region_out != nullptr ? std::string_view(region_out, bytes) : std::string_view(response);
}

bool RefusedWithoutMessage(const absl::Status& st) { return !st.ok() && st.message().empty(); }

Outcome RunAttend(const Template& t, const uint8_t* edits, size_t count, uint8_t fill,
                  uint8_t flags) {
  Outcome out;
  out.parsed = true;
  v1::AttendRequest r;
  SetTensor(r.mutable_q(), t.dtype, t.tokens_q, t.heads, t.head_dim, fill);
  SetTensor(r.mutable_k(), t.dtype, t.tokens_k, t.kv_heads, t.head_dim, fill + 1);
  SetTensor(r.mutable_v(), t.dtype, t.tokens_k, t.kv_heads, t.head_dim, fill + 2);
  r.set_causal(t.causal);
  r.set_return_lse(t.lse != ((flags & 1) != 0));
  const std::string data[3] = {r.q().data(), r.k().data(), r.v().data()};
  v1::Tensor* const in[3] = {r.mutable_q(), r.mutable_k(), r.mutable_v()};
  ApplyEdits(edits, count, SlotBytes(t), data, &r, in);

  auto job = ValidateAttendRequest(r, Limits());
  if (!job.ok()) {
    if (RefusedWithoutMessage(job.status())) out.violation = "validation error without a message";
    return out;
  }
  FuzzRegions& regions = FuzzRegions::Get();
  const absl::Status st = ResolveAttendTensors(r, FuzzRegions::kOwner, &regions.registry(), &**job);
  if (!st.ok()) {
    if (RefusedWithoutMessage(st)) out.violation = "region error without a message";
    return out;
  }
  out.valid = true;
  out.violation = regions.CheckResolved(**job);
  if (!out.violation.empty()) return out;
  if ((*job)->device_tensors) {
    out.on_gpu = true;
    return out;
  }
  const v1::AttendRequest twin = InlineTwin<v1::AttendRequest>(
      r, **job, [](v1::AttendRequest* m, int i) {
        return i == 0 ? m->mutable_q() : i == 1 ? m->mutable_k() : m->mutable_v();
      });
  auto twin_job = ValidateAttendRequest(twin, Limits());
  if (!twin_job.ok()) {
    out.violation = absl::StrCat("the inline twin of an accepted request is refused: ",
                                 twin_job.status().ToString());
    return out;
  }
  v1::AttendResponse response, twin_response;
  out.violation = ComputeAttendOnCpu(**job, r, &response);
  if (out.violation.empty()) out.violation = ComputeAttendOnCpu(**twin_job, twin, &twin_response);
  if (!out.violation.empty()) return out;
  out.computed = true;
  if (response.o().has_region() != r.has_o_region()) {
    out.violation = "the response does not name o's region exactly when o went to one";
    return out;
  }
  const AttendJob& a = **job;
  const uint64_t lse_bytes = a.return_lse ? 4 * uint64_t(a.total_q) * a.key.num_heads : 0;
  out.violation = CompareOutputs(
      OutputOf(a.o_out, a.q_bytes.size(), response.o().data()),
      a.return_lse ? OutputOf(a.lse_out, lse_bytes, response.lse().data()) : "",
      twin_response.o().data(), twin_response.lse().data());
  return out;
}

// Sessions A (the fuzzed step, through regions) and B (its inline twin), closed when done.
class TwinSessions {
 public:
  explicit TwinSessions(SessionEngine& e) : e_(e) {}
  ~TwinSessions() {
    for (const auto& s : {a_, b_}) {
      if (s) e_.manager->Close(s->id(), "").status().IgnoreError();
    }
  }
  absl::Status Create(const Template& t) {
    SessionManager::CreateParams p;
    p.num_layers = 1;
    p.num_kv_heads = t.kv_heads;
    p.head_dim = t.head_dim;
    p.dtype = t.dtype == v1::DTYPE_FLOAT16 ? kernels::DType::kFloat16 : kernels::DType::kBFloat16;
    auto a = e_.manager->CreateSession(p, "");
    if (!a.ok()) return a.status();
    a_ = *a;
    auto b = e_.manager->CreateSession(p, "");
    if (!b.ok()) return b.status();
    b_ = *b;
    return absl::OkStatus();
  }
  const std::shared_ptr<Session>& a() const { return a_; }
  const std::shared_ptr<Session>& b() const { return b_; }

 private:
  SessionEngine& e_;
  std::shared_ptr<Session> a_, b_;
};

v1::StepRequest TemplateStep(const Template& t, int32_t tokens, uint32_t seed) {
  v1::StepRequest r;
  r.set_layer(0);
  SetTensor(r.mutable_q(), t.dtype, tokens, t.heads, t.head_dim, seed);
  SetTensor(r.mutable_k_new(), t.dtype, tokens, t.kv_heads, t.head_dim, seed + 1);
  SetTensor(r.mutable_v_new(), t.dtype, tokens, t.kv_heads, t.head_dim, seed + 2);
  return r;
}

// Validates r (inline) on sessions a and b and runs both in one batch; "" or what failed.
std::string StepBoth(SessionEngine& e, const v1::StepRequest& r, const TwinSessions& sessions) {
  v1::StepResponse ra, rb;
  auto a = ValidateStepRequest(r, sessions.a(), Limits(), StepRegions{});
  auto b = ValidateStepRequest(r, sessions.b(), Limits(), StepRegions{});
  if (!a.ok() || !b.ok()) {
    return absl::StrCat("refused: ", a.status().ToString(), " ", b.status().ToString());
  }
  PrepareStepResponse(**a, r, &ra);
  PrepareStepResponse(**b, r, &rb);
  std::vector<std::unique_ptr<StepJob>> jobs;
  jobs.push_back(std::move(*a));
  jobs.push_back(std::move(*b));
  for (const absl::Status& st : e.RunSteps(std::move(jobs), {&ra, &rb})) {
    if (!st.ok()) return absl::StrCat("failed: ", st.ToString());
  }
  return "";
}

// The step of input (edits) through regions on session A, and its inline twin on session B.
Outcome StepThroughRegions(SessionEngine& e, const TwinSessions& sessions, const Template& t,
                           const uint8_t* edits, size_t count, uint8_t fill, uint8_t flags) {
  Outcome out;
  out.parsed = true;
  if (t.tokens_k > 0) {  // the same cache on both
    const std::string failed = StepBoth(e, TemplateStep(t, t.tokens_k, fill + 3), sessions);
    if (!failed.empty()) {
      out.violation = absl::StrCat("the template's prefill ", failed);
      return out;
    }
  }
  v1::StepRequest r = TemplateStep(t, t.tokens_q, fill);
  r.set_return_lse(t.lse != ((flags & 1) != 0));
  const std::string data[3] = {r.q().data(), r.k_new().data(), r.v_new().data()};
  v1::Tensor* const in[3] = {r.mutable_q(), r.mutable_k_new(), r.mutable_v_new()};
  ApplyEdits(edits, count, SlotBytes(t), data, &r, in);

  FuzzRegions& regions = FuzzRegions::Get();
  const StepRegions step_regions{FuzzRegions::kOwner, &regions.registry(), (flags & 2) != 0};
  v1::StepResponse response;
  auto job = ValidateStepRequest(r, sessions.a(), Limits(), step_regions);
  if (!job.ok()) {
    if (RefusedWithoutMessage(job.status())) out.violation = "step refused without a message";
    return out;
  }
  PrepareStepResponse(**job, r, &response);
  out.valid = true;
  out.violation = regions.CheckResolved(**job);
  if (!out.violation.empty()) return out;
  if ((*job)->device_tensors) {
    out.on_gpu = true;
    return out;
  }
  const v1::StepRequest twin = InlineTwin<v1::StepRequest>(
      r, **job, [](v1::StepRequest* m, int i) {
        return i == 0 ? m->mutable_q() : i == 1 ? m->mutable_k_new() : m->mutable_v_new();
      });
  const char* o_out = (*job)->o_out;
  const char* lse_out = (*job)->lse_out;
  const uint64_t o_bytes = (*job)->q_bytes.size();
  const uint64_t lse_bytes = r.return_lse() ? 4 * uint64_t(t.tokens_q) * t.heads : 0;
  v1::StepResponse twin_response;
  auto twin_job = ValidateStepRequest(twin, sessions.b(), Limits(), StepRegions{});
  if (!twin_job.ok()) {
    out.violation = absl::StrCat("the inline twin of an accepted step is refused: ",
                                 twin_job.status().ToString());
    return out;
  }
  PrepareStepResponse(**twin_job, twin, &twin_response);
  // One batch, as a BatchStep of both would be: the CPU backend reads every input of a launch
  // (A's from its regions) before it writes any output.
  std::vector<std::unique_ptr<StepJob>> jobs;
  jobs.push_back(std::move(*job));
  jobs.push_back(std::move(*twin_job));
  for (const absl::Status& st : e.RunSteps(std::move(jobs), {&response, &twin_response})) {
    if (!st.ok()) {
      out.violation = absl::StrCat("a validated step failed: ", st.ToString());
      return out;
    }
  }
  out.computed = true;
  if (response.cached_tokens() != twin_response.cached_tokens()) {
    out.violation = "cached_tokens differ between the step through regions and its twin";
    return out;
  }
  out.violation = CompareOutputs(
      OutputOf(o_out, o_bytes, response.o().data()),
      r.return_lse() ? OutputOf(lse_out, lse_bytes, response.lse().data()) : "",
      twin_response.o().data(), twin_response.lse().data());
  return out;
}

Outcome RunStep(const Template& t, const uint8_t* edits, size_t count, uint8_t fill,
                uint8_t flags) {
  SessionEngine& e = SessionEngine::Get();
  Outcome out;
  {
    TwinSessions sessions(e);
    if (absl::Status st = sessions.Create(t); !st.ok()) {
      out.violation = absl::StrCat("cannot create the template's sessions: ", st.ToString());
      return out;
    }
    out = StepThroughRegions(e, sessions, t, edits, count, fill, flags);
  }
  if (out.violation.empty() && e.pool->FreePages() != SessionEngine::kPages) {
    out.violation = absl::StrCat(SessionEngine::kPages - e.pool->FreePages(),
                                 " pages still in use after the sessions were closed");
  }
  return out;
}

}  // namespace

Outcome RunRegionInput(const uint8_t* data, size_t size) {
  if (size < 3) return {};
  const Template& t = kTemplates[data[0] % kTemplateCount];
  const uint8_t fill = data[1], flags = data[2];
  const size_t count = std::min((size - 3) / kRegionEditBytes, kMaxRegionEdits);
  FuzzRegions::Get().Fill(fill);
  return t.step ? RunStep(t, data + 3, count, fill, flags) : RunAttend(t, data + 3, count, fill, flags);
}

std::string RegionInput(uint8_t template_index, uint8_t fill, uint8_t flags,
                        const std::vector<RegionEdit>& edits) {
  std::string out = {static_cast<char>(template_index), static_cast<char>(fill),
                     static_cast<char>(flags)};
  for (const RegionEdit& e : edits) {
    char p[kRegionEditBytes];
    p[0] = static_cast<char>(e.slot);
    p[1] = static_cast<char>(e.region);
    std::memcpy(p + 2, &e.offset, 4);
    std::memcpy(p + 6, &e.bytes_delta, 2);
    out.append(p, kRegionEditBytes);
  }
  return out;
}

size_t RegionTemplateCount() { return kTemplateCount; }

RegionTemplateInfo DescribeRegionTemplate(uint8_t template_index) {
  const Template& t = kTemplates[template_index % kTemplateCount];
  return {t.step, t.lse, ElementBytes(t.dtype), SlotBytes(t)};
}

}  // namespace attn::fuzz
