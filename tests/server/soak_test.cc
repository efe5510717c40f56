// Soak: N concurrent clients for T seconds against an attnd process, a mix of valid requests
// (unary and AttendStream, every dtype, causal, GQA, varlen, windows; each answer checked against
// the float64 reference) and invalid ones (each must get its exact code and message), and
// KV-cache sessions (steps, BatchSteps, truncates, forks, closes and bad steps; each answer checked
// against the float64 reference over the session's cache). Zero unexpected results;
// attn_pending_requests never exceeds the clients' outstanding requests and is 0 at the end;
// attnd's resident memory (VmRSS) stays flat after the warm-up; every KV page is free at the end.
//
//   build/tests/server/soak_test                              # CI: 8 clients, 20 s
//   build/tests/server/soak_test --clients=16 --seconds=300   # the long run (docs/RELIABILITY.md)
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "session_util.h"
#include "test_util.h"

namespace attn {
namespace {

using namespace std::chrono_literals;
using testing::RequestShape;

int g_clients = 8;
int g_seconds = 20;

struct Invalid {
  const char* name;
  std::function<void(v1::AttendRequest&)> corrupt;
  grpc::StatusCode code;
  const char* message_part;
};

// Corruptions that apply to any request the generator makes.
const std::vector<Invalid>& Invalids() {
  static const std::vector<Invalid> cases = {
      {"QDataShort", [](auto& r) { r.mutable_q()->mutable_data()->pop_back(); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.data has"},
      {"KDtypeUnspecified", [](auto& r) { r.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "k.dtype must be"},
      {"CuQFromOne", [](auto& r) {
         r.clear_cu_seqlens_q();
         r.clear_cu_seqlens_k();
         r.add_cu_seqlens_q(1);
         r.add_cu_seqlens_q(r.q().shape(0));
         r.add_cu_seqlens_k(0);
         r.add_cu_seqlens_k(r.k().shape(0));
       }, grpc::StatusCode::INVALID_ARGUMENT, "cu_seqlens_q[0] must be 0"},
      {"CuOnlyQ", [](auto& r) {
         r.clear_cu_seqlens_k();
         if (r.cu_seqlens_q_size() == 0) {
           r.add_cu_seqlens_q(0);
           r.add_cu_seqlens_q(r.q().shape(0));
         }
       }, grpc::StatusCode::INVALID_ARGUMENT, "given together"},
      {"ScaleNaN", [](auto& r) { r.set_softmax_scale(std::nanf("")); },
       grpc::StatusCode::INVALID_ARGUMENT, "softmax_scale must be finite"},
      {"WindowMinusThree", [](auto& r) { r.mutable_window()->set_right(-3); },
       grpc::StatusCode::INVALID_ARGUMENT, "window.left and window.right"},
      {"HugeShape", [](auto& r) { r.mutable_v()->set_shape(0, int64_t{1} << 40); },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "v has more than max_tensor_elements"},
      {"QRank2", [](auto& r) { r.mutable_q()->mutable_shape()->RemoveLast(); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.shape must have 3 dimensions"},
  };
  return cases;
}

testing::RandomRequest RandomValid(std::mt19937_64& rng) {
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  RequestShape s;
  const client::DType dtypes[] = {client::DType::kFloat32, client::DType::kFloat16,
                                  client::DType::kBFloat16};
  s.dtype = dtypes[pick(3)];
  const int heads[][2] = {{4, 2}, {8, 1}, {2, 2}, {4, 4}};
  const int* h = heads[pick(4)];
  s.heads = h[0];
  s.kv_heads = h[1];
  const int dims[] = {32, 64, 128};
  s.head_dim = dims[pick(3)];
  s.batch = 1 + pick(3);
  s.seq_q = 1 + pick(96);
  s.seq_k = 1 + pick(128);
  s.causal = pick(2);
  auto r = testing::MakeRandomRequest(s, rng);
  if (pick(4) == 0) {
    r.options.window_left = pick(64);
    r.options.window_right = pick(3) - 1;
  }
  if (pick(4) == 0) r.options.softmax_scale = 0.05f + 0.01f * pick(20);
  r.options.return_lse = pick(2);
  return r;
}

struct Totals {
  std::atomic<int64_t> requests{0}, valid_ok{0}, invalid_ok{0}, unexpected{0};
  std::mutex mu;
  std::vector<std::string> samples;  // first unexpected results
  void Unexpected(const std::string& what) {
    ++unexpected;
    std::lock_guard<std::mutex> lock(mu);
    if (samples.size() < 10) samples.push_back(what);
  }
};

void CheckValid(const testing::RandomRequest& r, const v1::AttendResponse& resp,
                const grpc::Status& st, Totals& t) {
  if (!st.ok() || resp.status_code() != 0) {
    t.Unexpected("valid request failed: " + std::to_string(st.error_code()) + " " +
                 st.error_message() + " / " + std::to_string(resp.status_code()) + " " +
                 resp.status_message());
    return;
  }
  auto parsed = client::Client::ParseAttendResponse(resp);
  const double err = parsed.ok() ? testing::ErrorAgainstReference(r, parsed->o) : INFINITY;
  if (!(err <= testing::ToleranceFor(r.q.dtype))) {
    t.Unexpected("wrong answer: relative error " + std::to_string(err));
    return;
  }
  ++t.valid_ok;
}

void CheckInvalid(const Invalid& c, grpc::StatusCode code, const std::string& message, Totals& t) {
  if (code != c.code || message.find(c.message_part) == std::string::npos) {
    t.Unexpected(std::string(c.name) + ": got " + std::to_string(code) + " " + message);
    return;
  }
  ++t.invalid_ok;
}

void UnaryClient(const std::string& target, int id, std::chrono::steady_clock::time_point end,
                 Totals& t) {
  client::ClientOptions o;
  o.target = target;
  auto c = std::move(*client::Client::Create(o));
  std::mt19937_64 rng(1000 + id);
  while (std::chrono::steady_clock::now() < end) {
    auto r = RandomValid(rng);
    v1::AttendRequest req = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
    const Invalid* bad = rng() % 5 == 0 ? &Invalids()[rng() % Invalids().size()] : nullptr;
    if (bad) bad->corrupt(req);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 120s);
    v1::AttendResponse resp;
    const grpc::Status st = c->stub()->Attend(&ctx, req, &resp);
    ++t.requests;
    if (bad) {
      CheckInvalid(*bad, st.error_code(), st.error_message(), t);
    } else {
      CheckValid(r, resp, st, t);
    }
  }
}

// One AttendStream for the whole run; items written and read one at a time.
void StreamClient(const std::string& target, int id, std::chrono::steady_clock::time_point end,
                  Totals& t) {
  client::ClientOptions o;
  o.target = target;
  auto c = std::move(*client::Client::Create(o));
  std::mt19937_64 rng(2000 + id);
  grpc::ClientContext ctx;
  auto stream = c->stub()->AttendStream(&ctx);
  for (uint64_t i = 0; std::chrono::steady_clock::now() < end; ++i) {
    auto r = RandomValid(rng);
    v1::AttendRequest req = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
    req.set_request_id(i);
    const Invalid* bad = rng() % 5 == 0 ? &Invalids()[rng() % Invalids().size()] : nullptr;
    if (bad) bad->corrupt(req);
    v1::AttendResponse resp;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      t.Unexpected("stream broke");
      break;
    }
    ++t.requests;
    if (resp.request_id() != i) t.Unexpected("stream answered out of order");
    if (bad) {
      CheckInvalid(*bad, static_cast<grpc::StatusCode>(resp.status_code()), resp.status_message(), t);
    } else {
      CheckValid(r, resp, grpc::Status::OK, t);
    }
  }
  stream->WritesDone();
  const grpc::Status st = stream->Finish();
  if (!st.ok()) t.Unexpected("stream ended with " + st.error_message());
}

// Sessions one after another: created, stepped (prefill chunks, decode, BatchSteps), truncated,
// forked, sent a bad step now and then, closed; every answer checked against the reference.
void SessionClient(const std::string& target, int id, std::chrono::steady_clock::time_point end,
                   Totals& t) {
  client::ClientOptions o;
  o.target = target;
  auto c = std::move(*client::Client::Create(o));
  auto* stub = c->stub();
  std::mt19937_64 rng(3000 + id);
  const testing::SessionSpec specs[] = {{2, 4, 2, 64, v1::DTYPE_BFLOAT16},
                                        {1, 8, 1, 128, v1::DTYPE_FLOAT16}};
  auto check = [&](const testing::SessionShadow& shadow, const v1::StepRequest& step,
                   const v1::StepResponse& resp, const grpc::Status& st) {
    ++t.requests;
    if (!st.ok()) return t.Unexpected("step failed: " + st.error_message());
    const auto e = shadow.Check(step, resp);
    if (!(e.o <= testing::StepTolerance(shadow.spec().dtype)) || e.non_finite != 0) {
      return t.Unexpected("wrong step answer: relative error " + std::to_string(e.o));
    }
    ++t.valid_ok;
  };
  while (std::chrono::steady_clock::now() < end) {
    const testing::SessionSpec& spec = specs[rng() % 2];
    v1::CreateSessionResponse cr;
    if (!testing::CreateSession(stub, spec, &cr).ok()) {
      t.Unexpected("CreateSession failed");
      continue;
    }
    testing::SessionShadow shadow(spec);
    for (int i = 0; i < 40 && std::chrono::steady_clock::now() < end; ++i) {
      const int layer = static_cast<int>(rng() % spec.layers);
      const int kind = static_cast<int>(rng() % 10);
      if (kind < 6) {
        v1::StepRequest step = testing::RandomStep(cr.session_id(), layer,
                                                   i < 2 ? 1 + int(rng() % 64) : 1, spec, rng);
        v1::StepResponse resp;
        const grpc::Status st = testing::Step(stub, step, &resp);
        if (st.ok()) shadow.Append(step);
        check(shadow, step, resp, st);
      } else if (kind < 8) {
        v1::BatchStepRequest req;
        for (int j = 0; j < 3; ++j) {
          *req.add_steps() = testing::RandomStep(cr.session_id(), j % spec.layers, 1, spec, rng);
        }
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + 120s);
        v1::BatchStepResponse resp;
        const grpc::Status st = stub->BatchStep(&ctx, req, &resp);
        for (int j = 0; j < req.steps_size(); ++j) {
          const bool ok = st.ok() && resp.results(j).status_code() == 0;
          if (ok) shadow.Append(req.steps(j));
          check(shadow, req.steps(j), ok ? resp.results(j).response() : v1::StepResponse(),
                ok ? grpc::Status::OK : grpc::Status(grpc::StatusCode::INTERNAL, "item failed"));
        }
      } else if (kind == 8) {  // a bad step: its own status, the cache unchanged
        v1::StepRequest step = testing::RandomStep(cr.session_id(), spec.layers, 1, spec, rng);
        v1::StepResponse resp;
        const grpc::Status st = testing::Step(stub, step, &resp);
        ++t.requests;
        if (st.error_code() != grpc::StatusCode::INVALID_ARGUMENT ||
            st.error_message().find("is out of range") == std::string::npos) {
          t.Unexpected("bad step: " + st.error_message());
        } else {
          ++t.invalid_ok;
        }
      } else {  // fork and close the fork, or truncate one token
        grpc::ClientContext ctx;
        if (rng() % 2) {
          v1::ForkSessionRequest req;
          req.set_session_id(cr.session_id());
          v1::ForkSessionResponse resp;
          if (!stub->ForkSession(&ctx, req, &resp).ok() ||
              !testing::CloseSession(stub, resp.session_id()).ok()) {
            t.Unexpected("fork or its close failed");
          }
        } else {
          int64_t least = shadow.Tokens(0);
          for (int l = 1; l < spec.layers; ++l) least = std::min(least, shadow.Tokens(l));
          v1::TruncateSessionRequest req;
          req.set_session_id(cr.session_id());
          req.set_tokens(std::min<int64_t>(least, 1));
          v1::TruncateSessionResponse resp;
          if (!stub->TruncateSession(&ctx, req, &resp).ok()) t.Unexpected("truncate failed");
          shadow.Truncate(req.tokens());
        }
        ++t.requests;
      }
    }
    if (!testing::CloseSession(stub, cr.session_id()).ok()) t.Unexpected("CloseSession failed");
  }
}

TEST(Soak, MixedTrafficNoUnexpectedErrorsFlatMemoryAndPending) {
  auto attnd = testing::AttndProcess::Start({});
  ASSERT_NE(attnd, nullptr);
  const int pid = attnd->pid(), port = attnd->metrics_port();
  const auto start = std::chrono::steady_clock::now();
  const auto end = start + std::chrono::seconds(g_seconds);
  const auto warm = start + std::chrono::seconds(std::max(3, g_seconds / 5));
  Totals t;
  std::vector<std::thread> clients;
  for (int i = 0; i < g_clients; ++i) {
    // One client in four keeps one AttendStream open for the whole run; one in four runs
    // sessions.
    clients.emplace_back(i % 4 == 3 ? StreamClient : i % 4 == 1 ? SessionClient : UnaryClient,
                         attnd->target(), i, end, std::ref(t));
  }
  const int64_t rss_start = testing::VmRssKiB(pid);
  int64_t rss_warm = -1, rss_max = 0, rss_last = 0;
  double pending_max = 0;
  std::vector<std::pair<double, int64_t>> rss_series;  // (seconds, KiB)
  while (std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(250ms);
    const auto now = std::chrono::steady_clock::now();
    const int64_t rss = testing::VmRssKiB(pid);
    const double pending = testing::ScrapeMetric(port, "attn_pending_requests");
    pending_max = std::max(pending_max, pending);
    if (now >= warm) {
      if (rss_warm < 0) rss_warm = rss;
      rss_max = std::max(rss_max, rss);
      rss_last = rss;
      rss_series.emplace_back(std::chrono::duration<double>(now - start).count(), rss);
    }
  }
  for (auto& th : clients) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Pending back to 0.
  double pending_end = -1;
  for (int i = 0; i < 200 && pending_end != 0; ++i) {
    pending_end = testing::ScrapeMetric(port, "attn_pending_requests");
    if (pending_end != 0) std::this_thread::sleep_for(50ms);
  }
  const int64_t rss_end = testing::VmRssKiB(pid);
  const double kv_used = testing::ScrapeMetric(port, "attn_kv_cache_pages", {"state=\"used\""});
  const double sessions = testing::ScrapeMetric(port, "attn_sessions");
  EXPECT_EQ(kv_used, 0) << "KV pages still in use after every session was closed";
  EXPECT_EQ(sessions, 0);
  // Growth over the second half of the run, which is what a leak would keep adding to.
  int64_t rss_mid = rss_warm;
  if (!rss_series.empty()) rss_mid = rss_series[rss_series.size() / 2].second;
  std::printf(
      "soak: %d clients, %.1f s, %lld requests (%.0f/s): %lld valid answers checked, %lld invalid "
      "requests with their expected status, %lld unexpected\n"
      "soak: attnd VmRSS start %lld KiB, after warm-up %lld KiB, mid-run %lld KiB, max %lld KiB, "
      "end of load %lld KiB, idle %lld KiB: growth after warm-up %+lld KiB, second half %+lld KiB\n"
      "soak: attn_pending_requests max %.0f, at the end %.0f; KV pages used at the end %.0f\n",
      g_clients, seconds, (long long)t.requests.load(), t.requests.load() / seconds,
      (long long)t.valid_ok.load(), (long long)t.invalid_ok.load(), (long long)t.unexpected.load(),
      (long long)rss_start, (long long)rss_warm, (long long)rss_mid, (long long)rss_max,
      (long long)rss_last, (long long)rss_end, (long long)(rss_last - rss_warm),
      (long long)(rss_last - rss_mid), pending_max, pending_end, kv_used);
  for (const auto& s : t.samples) std::printf("soak: unexpected: %s\n", s.c_str());
  EXPECT_EQ(t.unexpected.load(), 0);
  EXPECT_GT(t.valid_ok.load(), 0);
  EXPECT_GT(t.invalid_ok.load(), 0);
  // Each client has at most one request outstanding; a session client's BatchStep, three.
  const int session_clients = (g_clients + 2) / 4;
  EXPECT_LE(pending_max, g_clients + 2 * session_clients);
  EXPECT_EQ(pending_end, 0);
  // Flat: after the warm-up, RSS may move with allocator caching but must not keep growing.
  // Not under sanitizers: ASan's quarantine holds up to 256 MiB of freed memory by design (its
  // leak checker at attnd's exit, which must be 0, covers leaks there).
  const char* sanitizer = std::getenv("ATTN_SANITIZER");
  if (sanitizer == nullptr || *sanitizer == '\0') {
    EXPECT_LE(rss_last - rss_mid, 32 * 1024) << "attnd's RSS grows in the second half of the run";
    EXPECT_LE(rss_last - rss_warm, 64 * 1024) << "attnd's RSS grows after the warm-up";
  } else {
    std::printf("soak: RSS not checked under the %s sanitizer\n", sanitizer);
  }
  EXPECT_EQ(attnd->SignalAndWait(SIGTERM, 30000), 0) << attnd->Log();
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--clients=", 10) == 0) attn::g_clients = std::atoi(argv[i] + 10);
    if (std::strncmp(argv[i], "--seconds=", 10) == 0) attn::g_seconds = std::atoi(argv[i] + 10);
  }
  if (const char* s = std::getenv("ATTN_SOAK_SECONDS")) attn::g_seconds = std::atoi(s);
  if (const char* c = std::getenv("ATTN_SOAK_CLIENTS")) attn::g_clients = std::atoi(c);
  return RUN_ALL_TESTS();
}
