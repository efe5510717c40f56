#include "rpc/session_warmup.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "engine/run_alone.h"
#include "rpc/step_validation.h"

namespace attn {
namespace {

void Fill(v1::Tensor* t, int64_t tokens, int64_t heads, int64_t d) {
  t->set_dtype(v1::DTYPE_BFLOAT16);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  t->mutable_data()->assign(size_t(tokens * heads * d) * 2, '\x3c');  // bf16 ~0.0115
}

absl::Status RunStep(BatchRunner& steps, std::shared_ptr<Session> s, int64_t tokens) {
  const SessionShape& shape = s->shape();
  v1::StepRequest request;
  request.set_session_id(s->id());
  Fill(request.mutable_q(), tokens, shape.num_kv_heads, shape.head_dim);
  Fill(request.mutable_k_new(), tokens, shape.num_kv_heads, shape.head_dim);
  Fill(request.mutable_v_new(), tokens, shape.num_kv_heads, shape.head_dim);
  RequestLimits limits;
  limits.head_dims = {shape.head_dim};
  ASSIGN_OR_RETURN(std::unique_ptr<StepJob> job,
                   ValidateStepRequest(request, s, limits, StepRegions{}));
  job->arrival = Clock::now();
  if (!s->AcquireLayer(0, [] {})) return absl::InternalError("warm-up session busy");
  absl::Status st = RunAlone(steps, std::move(job));
  s->ReleaseLayer(0);
  return st;
}

}  // namespace

absl::Status WarmUpSessionSteps(BatchRunner& steps, SessionManager& sessions) {
  SessionManager::CreateParams p;
  p.num_layers = 1;
  p.num_kv_heads = 1;
  p.head_dim = sessions.options().head_dims.front();
  p.dtype = kernels::DType::kBFloat16;
  auto s = sessions.CreateSession(p, "");
  if (!s.ok()) return s.status();  // e.g. a page too small for the row: nothing to warm
  absl::Status st = RunStep(steps, *s, 17);  // chunked prefill
  if (st.ok()) st = RunStep(steps, *s, 1);    // decode
  sessions.Close((*s)->id(), "").IgnoreError();
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat("session step warm-up failed: ", st.message()));
  }
  return absl::OkStatus();
}

}  // namespace attn
