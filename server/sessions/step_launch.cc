#include "sessions/step_launch.h"

#include <algorithm>

#include "sessions/step_work.h"

namespace attn {

StepLaunch BeginStepLaunch(std::span<std::unique_ptr<AttendJob>> jobs,
                           std::span<absl::Status> status) {
  StepLaunch l;
  l.cu_seqlens_q.push_back(0);
  l.page_indptr.push_back(0);
  for (size_t i = 0; i < jobs.size(); ++i) {
    StepWork& w = *jobs[i]->step;
    auto pending = w.session->BeginAppend(w.layer, w.new_tokens);
    if (!pending.ok()) {
      status[i] = pending.status();
      continue;
    }
    w.pending = std::move(*pending);
    const PendingAppend& p = *w.pending;
    l.members.push_back(i);
    l.total_q += static_cast<int32_t>(w.new_tokens);
    l.cu_seqlens_q.push_back(l.total_q);
    l.page_indices.insert(l.page_indices.end(), p.table.begin(), p.table.end());
    l.page_indptr.push_back(static_cast<int32_t>(l.page_indices.size()));
    l.seqlens_k.push_back(static_cast<int32_t>(p.new_tokens));
    l.copies.insert(l.copies.end(), p.copies.begin(), p.copies.end());
    l.append_rows.insert(l.append_rows.end(), p.append_rows.begin(), p.append_rows.end());
    l.max_q = std::max(l.max_q, static_cast<int32_t>(w.new_tokens));
    l.max_k = std::max(l.max_k, static_cast<int32_t>(p.new_tokens));
    l.kv_bytes_read += 2.0 * static_cast<double>(p.new_tokens) * w.session->shape().RowBytes();
  }
  return l;
}

void EndStepLaunch(std::span<std::unique_ptr<AttendJob>> jobs, const StepLaunch& launch,
                   std::span<absl::Status> status, const absl::Status& launch_status) {
  for (size_t i : launch.members) {
    StepWork& w = *jobs[i]->step;
    PendingAppend p = std::move(*w.pending);
    w.pending.reset();
    if (launch_status.ok()) {
      w.response->set_cached_tokens(p.new_tokens);
      w.session->CommitAppend(std::move(p));
    } else {
      w.session->AbortAppend(std::move(p));
      status[i] = launch_status;
    }
  }
}

kernels::AttentionArgs StepLaunchArgs(const BatchKey& key, const StepLaunch& l,
                                      int32_t num_pages) {
  kernels::AttentionArgs a;
  a.dtype = key.wire_dtype;
  a.cu_seqlens_q = l.cu_seqlens_q.data();
  a.batch = static_cast<int32_t>(l.members.size());
  a.total_q = l.total_q;
  a.total_k = 0;
  a.max_seqlen_q = std::max(l.max_q, 1);
  a.max_seqlen_k = std::max(l.max_k, 1);
  a.num_heads = key.num_heads;
  a.num_kv_heads = key.num_kv_heads;
  a.head_dim = key.head_dim;
  a.softmax_scale = key.softmax_scale;
  a.causal = true;
  a.window_left = key.window_left;
  a.window_right = key.window_right;
  a.paged.page_size = key.page_tokens;
  a.paged.num_pages = num_pages;
  a.paged.page_indptr = l.page_indptr.data();
  // Never null, even when every member's cache is empty (the kernels check the pointer).
  static const int32_t kNoPage = 0;
  a.paged.page_indices = l.page_indices.empty() ? &kNoPage : l.page_indices.data();
  a.paged.seqlens_k = l.seqlens_k.data();
  return a;
}

void PrepareStepResponse(const AttendJob& job) {
  const StepWork& w = *job.step;
  const v1::Tensor& q = w.request->q();
  v1::Tensor* o = w.response->mutable_o();
  o->set_dtype(q.dtype());
  o->mutable_shape()->Assign(q.shape().begin(), q.shape().end());
  // An output written into a region leaves the response with its dtype, shape and slice only;
  // one written into a buffer of the wire path's, with its dtype and shape.
  if (w.request->has_o_region()) {
    *o->mutable_region() = w.request->o_region();
  } else if (job.o_out == nullptr) {
    o->mutable_data()->resize(job.q_bytes.size());
  }
  if (job.return_lse) {
    v1::Tensor* lse = w.response->mutable_lse();
    lse->set_dtype(v1::DTYPE_FLOAT32);
    lse->add_shape(job.key.num_heads);
    lse->add_shape(job.total_q);
    if (w.request->has_lse_region()) {
      *lse->mutable_region() = w.request->lse_region();
    } else if (job.lse_out == nullptr) {
      lse->mutable_data()->resize(sizeof(float) * size_t(job.key.num_heads) * job.total_q);
    }
  }
}

char* StepOutput(AttendJob& job) {
  return job.o_out != nullptr ? job.o_out : job.step->response->mutable_o()->mutable_data()->data();
}

float* StepLse(AttendJob& job) {
  char* lse = job.lse_out != nullptr ? job.lse_out
                                     : job.step->response->mutable_lse()->mutable_data()->data();
  return reinterpret_cast<float*>(lse);
}

}  // namespace attn
