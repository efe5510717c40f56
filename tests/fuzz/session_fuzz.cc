#include "session_fuzz.h"

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "attn/kernels/dtype_convert.h"
#include "backends/cpu_backend.h"
#include "rpc/step_validation.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session_manager.h"
#include "step_decode_check.h"

namespace attn::fuzz {
namespace {

constexpr int kMaxRecords = 64;
constexpr int64_t kPages = SessionEngine::kPages;

double Element(const std::string& bytes, kernels::DType dtype, size_t i) {
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == kernels::DType::kFloat16 ? kernels::cpu::HalfBitsToFloat(h)
                                           : kernels::cpu::Bf16BitsToFloat(h);
}

// What each (session, layer) must hold, as the program's successful steps wrote it.
struct Model {
  std::map<std::string, std::vector<std::string>> k, v;  // per session: per layer, raw rows
};

std::vector<double> Decode(const std::string& bytes, kernels::DType dtype) {
  std::vector<double> out(bytes.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = Element(bytes, dtype, i);
  return out;
}

// The float64 answer of one step over the model's cache (after the append), compared with o;
// a violation message, or "". Skipped (no check) for NaN/Inf inputs, scores large enough to
// overflow, and steps over 4M multiply-adds (to keep one run short).
std::string CheckStep(const Session& s, const v1::StepRequest& r, const v1::StepResponse& resp,
                      const std::string& k_cache, const std::string& v_cache) {
  const SessionShape& shape = s.shape();
  const int64_t n = r.q().shape(0), heads = r.q().shape(1), d = shape.head_dim;
  const int64_t hkv = shape.num_kv_heads, len = static_cast<int64_t>(k_cache.size()) / (2 * hkv * d);
  if (n * len * heads * d > (int64_t{4} << 20)) return "";
  const std::vector<double> q = Decode(r.q().data(), shape.dtype), k = Decode(k_cache, shape.dtype),
                            v = Decode(v_cache, shape.dtype);
  const std::vector<double> o = Decode(resp.o().data(), shape.dtype);
  double max_in = 0;
  for (const auto* t : {&q, &k, &v}) {
    for (double x : *t) {
      if (!std::isfinite(x)) return "";  // NaN/Inf: IEEE arithmetic, nothing to compare
      max_in = std::max(max_in, std::fabs(x));
    }
  }
  kernels::AttentionArgs sa;
  sa.head_dim = static_cast<int32_t>(d);
  sa.softmax_scale = r.softmax_scale();
  const double scale = kernels::EffectiveSoftmaxScale(sa);
  if (max_in * max_in * d * std::fabs(scale) > 50) return "";  // scores too large to compare
  const int64_t wl = r.has_window() ? r.window().left() : -1;
  const int64_t wr = r.has_window() ? r.window().right() : -1;
  std::vector<double> w;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = len - n + i;
    int64_t lo = 0, hi = p;
    if (wr >= 0) hi = std::min(hi, p + wr);
    if (wl >= 0) lo = std::max<int64_t>(0, p - wl);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / (heads / hkv);
      const double* qr = &q[(i * heads + h) * d];
      w.clear();
      double m = -INFINITY;
      for (int64_t j = lo; j <= hi; ++j) {
        const double* kr = &k[(j * hkv + g) * d];
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += qr[c] * kr[c];
        w.push_back(dot * scale);
        m = std::max(m, w.back());
      }
      double sum = 0;
      for (double& x : w) sum += (x = std::exp(x - m));
      for (int64_t c = 0; c < d; ++c) {
        double ref = 0;
        for (int64_t j = lo; j <= hi; ++j) ref += w[j - lo] / sum * v[(j * hkv + g) * d + c];
        const double got = o[(i * heads + h) * d + c];
        if (std::fabs(got - ref) > 2e-2 * max_in + 1e-6) {
          return absl::StrCat("o[", i, ", ", h, ", ", c, "] = ", got, ", the float64 model says ",
                              ref, " (", len, " cached tokens)");
        }
      }
    }
  }
  return "";
}

class Program {
 public:
  explicit Program(Outcome* out) : e_(SessionEngine::Get()), out_(out) {}
  ~Program() {
    for (const std::string& id : ids_) e_.manager->Close(id, "").status().IgnoreError();
    if (out_->violation.empty() && e_.pool->FreePages() != kPages) {
      out_->violation = absl::StrCat(kPages - e_.pool->FreePages(),
                                     " pages still in use after every session was closed");
    }
  }

  void Run(SessionOp op, const uint8_t* msg, size_t len) {
    switch (op) {
      case SessionOp::kCreate: return Create(msg, len);
      case SessionOp::kStep: {
        out_->violation = CheckStepDecoder(msg, len, false);
        if (!out_->violation.empty()) return;
        v1::StepRequest r;
        if (!r.ParseFromArray(msg, static_cast<int>(len))) return;
        v1::BatchStepRequest b;
        *b.add_steps() = r;
        return Steps(b);
      }
      case SessionOp::kBatchStep: {
        out_->violation = CheckStepDecoder(msg, len, true);
        if (!out_->violation.empty()) return;
        v1::BatchStepRequest b;
        if (b.ParseFromArray(msg, static_cast<int>(len)) && b.steps_size() <= 8) Steps(b);
        return;
      }
      case SessionOp::kTruncate: {
        v1::TruncateSessionRequest r;
        if (!r.ParseFromArray(msg, static_cast<int>(len))) return;
        const std::string id = Resolve(r.session_id());
        auto t = e_.manager->Truncate(id, "", r.tokens());
        if (!Note(t.status()) || !t.ok()) return;
        for (auto* m : {&model_.k[id], &model_.v[id]}) {
          for (std::string& layer : *m) layer.resize(layer.size() - RowBytes(id) * r.tokens());
        }
        return;
      }
      case SessionOp::kFork: {
        v1::ForkSessionRequest r;
        if (!r.ParseFromArray(msg, static_cast<int>(len))) return;
        const std::string id = Resolve(r.session_id());
        auto f = e_.manager->Fork(id, "");
        if (!Note(f.status()) || !f.ok()) return;
        ids_.push_back((*f)->id());
        model_.k[(*f)->id()] = model_.k[id];
        model_.v[(*f)->id()] = model_.v[id];
        return;
      }
      case SessionOp::kClose: {
        v1::CloseSessionRequest r;
        if (r.ParseFromArray(msg, static_cast<int>(len))) {
          Note(e_.manager->Close(Resolve(r.session_id()), "").status());
        }
        return;
      }
      case SessionOp::kCount: return;
    }
  }

 private:
  bool Note(const absl::Status& st) {
    if (!st.ok() && st.message().empty() && out_->violation.empty()) {
      out_->violation = "an error without a message";
    }
    return out_->violation.empty();
  }
  std::string Resolve(const std::string& id) const {
    if (id.size() < 2 || id[0] != '#' || ids_.empty()) return id;
    return ids_[static_cast<size_t>(std::atoi(id.c_str() + 1)) % ids_.size()];
  }
  int64_t RowBytes(const std::string& id) {
    auto s = e_.manager->Find(id, "");
    return s.ok() ? (*s)->shape().RowBytes() : 0;
  }

  void Create(const uint8_t* msg, size_t len) {
    v1::CreateSessionRequest r;
    if (!r.ParseFromArray(msg, static_cast<int>(len))) return;
    SessionManager::CreateParams p;
    p.num_layers = std::min(r.num_layers(), 4);
    if (r.num_layers() > 4) return;  // keep one run small
    p.num_kv_heads = r.num_kv_heads();
    p.head_dim = r.head_dim();
    auto dtype = SessionDType(r.dtype());
    if (!Note(dtype.status()) || !dtype.ok()) return;
    p.dtype = *dtype;
    p.max_tokens = r.max_tokens();
    auto s = e_.manager->CreateSession(p, "");
    if (!Note(s.status()) || !s.ok()) return;
    ids_.push_back((*s)->id());
    model_.k[(*s)->id()].assign(p.num_layers, "");
    model_.v[(*s)->id()].assign(p.num_layers, "");
  }

  // The items run in rounds: each round takes the items whose (session, layer) no earlier
  // pending item holds (so items of one layer apply in order), as one batch per BatchKey,
  // through the CPU backend.
  void Steps(v1::BatchStepRequest b) {
    for (auto& step : *b.mutable_steps()) step.set_session_id(Resolve(step.session_id()));
    const size_t n = static_cast<size_t>(b.steps_size());
    std::vector<v1::StepResponse> responses(n);
    std::vector<std::unique_ptr<StepJob>> jobs(n);
    for (size_t i = 0; i < n; ++i) {
      const v1::StepRequest& r = b.steps(static_cast<int>(i));
      auto s = e_.manager->Find(r.session_id(), "");
      if (!Note(s.status()) || !s.ok()) continue;
      RequestLimits limits;
      limits.max_tensor_elements = kMaxTensorElements;
      limits.head_dims = SessionHeadDims();
      auto job = ValidateStepRequest(r, *s, limits, StepRegions{});
      if (!Note(job.status()) || !job.ok()) continue;
      PrepareStepResponse(**job, r, &responses[i]);
      jobs[i] = std::move(*job);
    }
    for (;;) {
      std::vector<size_t> round;
      std::set<std::pair<const Session*, int32_t>> held;
      for (size_t i = 0; i < n; ++i) {
        if (!jobs[i]) continue;
        const StepJob& w = *jobs[i];
        if (!held.insert({w.session.get(), w.layer}).second) continue;  // a later round
        if (!w.session->AcquireLayer(w.layer, [] {})) {
          out_->violation = "a layer was busy with no step in progress";
          return;
        }
        round.push_back(i);
      }
      if (round.empty()) return;
      RunRound(jobs, round, b, responses);
      if (!out_->violation.empty()) return;
    }
  }

  // Runs the round's jobs (taking them), one batch per BatchKey, and gives their layers back.
  void RunRound(std::vector<std::unique_ptr<StepJob>>& jobs, std::vector<size_t> left,
                const v1::BatchStepRequest& b, std::vector<v1::StepResponse>& responses) {
    while (!left.empty()) {
      const BatchKey key = jobs[left.front()]->key;
      JobBatch batch;
      std::vector<size_t> members, rest;
      std::vector<std::pair<std::shared_ptr<Session>, int32_t>> layers;
      for (size_t i : left) (jobs[i]->key == key ? members : rest).push_back(i);
      std::vector<absl::Status> status(members.size());
      for (size_t m = 0; m < members.size(); ++m) {
        std::unique_ptr<StepJob> job = std::move(jobs[members[m]]);
        layers.emplace_back(job->session, job->layer);
        SessionEngine::AnswerInto(*job, &responses[members[m]], &status[m]);
        batch.push_back(std::move(job));
      }
      e_.RunBatchAndWait(std::move(batch));
      for (size_t m = 0; m < members.size(); ++m) {
        layers[m].first->ReleaseLayer(layers[m].second);
        if (out_->violation.empty()) {
          After(b.steps(static_cast<int>(members[m])), responses[members[m]], status[m]);
        }
      }
      left = rest;
    }
  }

  void After(const v1::StepRequest& r, const v1::StepResponse& resp, const absl::Status& st) {
    if (!Note(st) || !st.ok()) return;
    auto s = e_.manager->Find(r.session_id(), "");
    if (!s.ok()) return;
    std::string& k = model_.k[r.session_id()][r.layer()];
    std::string& v = model_.v[r.session_id()][r.layer()];
    k += r.k_new().data();
    v += r.v_new().data();
    if (resp.cached_tokens() * (*s)->shape().RowBytes() != static_cast<int64_t>(k.size())) {
      out_->violation = absl::StrCat("cached_tokens ", resp.cached_tokens(), " but the model holds ",
                                     k.size() / (*s)->shape().RowBytes());
      return;
    }
    out_->computed = true;
    out_->violation = CheckStep(**s, r, resp, k, v);
  }

  SessionEngine& e_;
  Outcome* out_;
  std::vector<std::string> ids_;
  Model model_;
};

}  // namespace

void AppendRecord(std::string* program, SessionOp op, const std::string& message) {
  program->push_back(static_cast<char>(op));
  program->push_back(static_cast<char>(message.size() & 0xff));
  program->push_back(static_cast<char>((message.size() >> 8) & 0xff));
  program->append(message);
}

Outcome RunSessionInput(const uint8_t* data, size_t size) {
  Outcome out;
  out.parsed = out.valid = true;
  Program program(&out);
  size_t at = 0;
  for (int records = 0; at + 3 <= size && records < kMaxRecords; ++records) {
    const uint8_t op = data[at];
    const size_t len = data[at + 1] | (size_t{data[at + 2]} << 8);
    at += 3;
    if (len > size - at) break;
    if (op < static_cast<uint8_t>(SessionOp::kCount)) {
      program.Run(static_cast<SessionOp>(op), data + at, len);
    }
    at += len;
    if (!out.violation.empty()) break;
  }
  return out;
}

const std::vector<int32_t>& SessionHeadDims() {
  static const std::vector<int32_t> dims = {1, 2, 4, 8, 16, 32, 64};
  return dims;
}

SessionEngine& SessionEngine::Get() {
  static SessionEngine* e = [] {
    auto* engine = new SessionEngine;
    CpuBackend::Options bo;
    bo.threads = 1;
    engine->backend = std::move(*CpuBackend::Create(bo));
    CpuStepDevice::Options so;
    so.kv_cache_bytes = 2 * kPages * kPageBytes;
    so.kv_page_bytes = kPageBytes;
    engine->device = std::move(*CpuStepDevice::Create(so, engine->backend->thread_pool()));
    engine->pipeline = std::move(*StepPipeline::Create({}, engine->device.get()));
    engine->pool = std::move(*KvPagePool::Create({kPages, kPageBytes, 12345}));
    SessionManager::Options mo;
    mo.replica_id = "fuzz";
    mo.max_sessions = 8;
    mo.max_session_tokens = kMaxSessionTokens;
    mo.head_dims = SessionHeadDims();
    // A few: each remembered id is memory kept past its input, which makes libFuzzer run the
    // input again and scan the heap for leaks (most of a run's time) until the list is full.
    mo.remembered_ids = 4;
    engine->manager = std::move(*SessionManager::Create(mo, engine->pool.get(), nullptr));
    return engine;
  }();
  return *e;
}

void SessionEngine::AnswerInto(StepJob& job, v1::StepResponse* response, absl::Status* status) {
  const StepJob* raw = &job;
  job.done = [raw, response, status](absl::Status st) {
    if (st.ok()) {
      response->set_cached_tokens(raw->cached_tokens);
      if (!raw->o.empty()) response->mutable_o()->set_data(raw->o.data, raw->o.size);
      if (!raw->lse.empty()) response->mutable_lse()->set_data(raw->lse.data, raw->lse.size);
    }
    *status = std::move(st);
  };
}

void SessionEngine::RunBatchAndWait(JobBatch batch) {
  std::mutex mu;
  std::condition_variable cv;
  size_t left = batch.size() + 1;  // every job's release, and the batch's end
  auto one_less = [&] {
    std::lock_guard<std::mutex> lock(mu);
    if (--left == 0) cv.notify_all();
  };
  for (auto& job : batch) job->released = ReleaseNotice(one_less);
  pipeline->RunBatch(std::move(batch), [&](const BatchReport&) { one_less(); });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
}

std::vector<absl::Status> SessionEngine::RunSteps(std::vector<std::unique_ptr<StepJob>> jobs,
                                                  std::vector<v1::StepResponse*> responses) {
  std::vector<absl::Status> status(jobs.size(), absl::UnknownError("not run"));
  std::vector<std::pair<std::shared_ptr<Session>, int32_t>> layers;
  JobBatch batch;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!jobs[i]->session->AcquireLayer(jobs[i]->layer, [] {})) {
      status[i] = absl::InternalError("the layer was busy with no step in progress");
      continue;
    }
    layers.emplace_back(jobs[i]->session, jobs[i]->layer);
    AnswerInto(*jobs[i], responses[i], &status[i]);
    batch.push_back(std::move(jobs[i]));
  }
  if (!batch.empty()) RunBatchAndWait(std::move(batch));
  for (const auto& [session, layer] : layers) session->ReleaseLayer(layer);
  return status;
}

}  // namespace attn::fuzz
