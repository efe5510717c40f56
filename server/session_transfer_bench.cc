// The host cost of moving sessions between replicas without a network: export (page reads and
// CRC32C) and import (checks and page writes) between two host KV regions, for a few session
// sizes. Prints a table; the rate over gRPC on loopback is at most this.
//
// --over_grpc: the hand-off itself (SessionHandoff, the drain's code) from a source session
// manager in this process to an attnd (CPU backend, in-process) over a gRPC connection on
// loopback: ImportSession's stream, the peer's checks and page writes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "rpc/attn_server.h"
#include "rpc/session_handoff.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session_manager.h"
#include "sessions/session.h"
#include "sessions/session_transfer.h"

ABSL_FLAG(int, repeats, 5, "moves per row; the table shows the median");
ABSL_FLAG(int64_t, page_bytes, 8192, "pool page bytes of keys (values as many)");
ABSL_FLAG(bool, over_grpc, false,
          "move the sessions with the drain's hand-off to an in-process attnd over loopback gRPC");
ABSL_FLAG(std::string, peer_backend, "cpu",
          "--over_grpc: the receiving attnd's backend (cuda: pages are written into device memory)");

namespace attn {
namespace {

struct Row {
  int layers;
  int64_t tokens;
};

// One session of row r in the manager, its pages filled with whatever the region holds.
std::string FillSession(SessionManager& m, const Row& r) {
  SessionManager::CreateParams p;
  p.num_layers = r.layers;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  auto s = m.CreateSession(p, "");
  if (!s.ok()) return "";
  for (int l = 0; l < r.layers; ++l) {
    (*s)->AcquireLayer(l, [] {});
    (*s)->CommitAppend(*(*s)->BeginAppend(l, r.tokens));
    (*s)->ReleaseLayer(l);
  }
  return (*s)->id();
}

int RunOverGrpc(const std::vector<Row>& rows, int64_t most_pages, int64_t pb, char* sk, char* sv) {
  ServerOptions po;
  po.listen = "127.0.0.1:0";
  po.metrics_listen = "";
  po.backend = absl::GetFlag(FLAGS_peer_backend);
  po.threads = 1;
  po.kv_page_tokens = pb / 2048;
  po.kv_cache_bytes = 2 * (most_pages + 16) * pb;
  po.replica_id = "bench-peer";
  po.max_message_bytes = 64 << 20;
  auto peer = AttnServer::Create(po);
  if (!peer.ok()) {
    std::fprintf(stderr, "peer: %s\n", peer.status().ToString().c_str());
    return 1;
  }
  std::printf("%-8s %-8s %-10s %-10s %-10s\n", "layers", "tokens", "MiB", "ms(p50)", "GB/s");
  for (const Row& r : rows) {
    auto pool = *KvPagePool::Create({most_pages, pb, 0});
    SessionManager::Options mo;
    mo.replica_id = "bench-src";
    mo.head_dims = {128};
    mo.max_session_tokens = po.max_session_tokens;  // the peer takes what it could create
    auto sessions = *SessionManager::Create(mo, pool.get(), nullptr);
    std::vector<double> ms;
    int64_t bytes = 0;
    for (int i = 0; i < absl::GetFlag(FLAGS_repeats); ++i) {
      if (FillSession(*sessions, r).empty()) return 1;
      SessionHandoff::Options ho;
      ho.peers = {absl::StrCat("127.0.0.1:", (*peer)->port())};
      ho.kv_region = KvRegion{sk, sv, most_pages, pb};
      ho.max_message_bytes = 64 << 20;
      auto handoff = *SessionHandoff::Create(ho, sessions.get(), nullptr, nullptr);
      const auto t0 = std::chrono::steady_clock::now();
      const SessionHandoff::Summary done =
          handoff->MoveAll(t0 + std::chrono::seconds(60));
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      if (done.moved != 1) {
        std::fprintf(stderr, "the session did not move (the log above says why)\n");
        return 1;
      }
      bytes = done.bytes;
      SessionManager& dst = *(*peer)->sessions();
      for (const std::string& id : dst.OpenSessionIds()) (void)dst.Close(id, "");
    }
    std::sort(ms.begin(), ms.end());
    const double p50 = ms[ms.size() / 2];
    std::printf("%-8d %-8lld %-10.1f %-10.2f %-10.2f\n", r.layers,
                static_cast<long long>(r.tokens), bytes / 1048576.0, p50, bytes / p50 / 1e6);
  }
  return 0;
}

int Run() {
  const int64_t pb = absl::GetFlag(FLAGS_page_bytes);
  const int32_t page_tokens = static_cast<int32_t>(pb / 2048);  // 8 heads x 128 x bf16 rows
  const std::vector<Row> rows = {{32, 512}, {32, 4096}, {64, 4096}};
  int64_t most_pages = 0;
  for (const Row& r : rows) {
    most_pages = std::max(most_pages, r.layers * ((r.tokens + page_tokens - 1) / page_tokens));
  }
  std::vector<char> sk(most_pages * pb), sv(most_pages * pb), dk(most_pages * pb),
      dv(most_pages * pb);
  std::mt19937_64 rng(1);
  for (char& c : sk) c = static_cast<char>(rng());
  for (char& c : sv) c = static_cast<char>(rng());
  if (absl::GetFlag(FLAGS_over_grpc)) {
    return RunOverGrpc(rows, most_pages, pb, sk.data(), sv.data());
  }
  const KvRegion src{sk.data(), sv.data(), most_pages, pb};
  const KvRegion dst{dk.data(), dv.data(), most_pages, pb};
  std::printf("%-8s %-8s %-10s %-10s %-10s\n", "layers", "tokens", "MiB", "ms(p50)", "GB/s");
  for (const Row& r : rows) {
    auto src_pool = *KvPagePool::Create({most_pages, pb, 0});
    auto dst_pool = *KvPagePool::Create({most_pages, pb, 0});
    SessionShape shape{r.layers, 8, 128, kernels::DType::kBFloat16, 1 << 20, page_tokens, 1};
    Session session("a.1", "owner", shape, src_pool.get());
    for (int l = 0; l < r.layers; ++l) {
      session.AcquireLayer(l, [] {});
      session.CommitAppend(*session.BeginAppend(l, r.tokens));
      session.ReleaseLayer(l);
    }
    std::vector<double> ms;
    int64_t bytes = 0;
    for (int i = 0; i < absl::GetFlag(FLAGS_repeats); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto exporter = *SessionExporter::Create(session, src_pool.get(), src);
      auto importer = *SessionImporter::Create(exporter->header(), dst_pool.get(), dst);
      bytes = 0;
      while (auto page = exporter->Next()) {
        bytes += static_cast<int64_t>(page->kv.size());
        if (!importer->Accept(*page).ok()) return 1;
      }
      if (!importer->Finish("b.1").ok()) return 1;
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double p50 = ms[ms.size() / 2];
    std::printf("%-8d %-8lld %-10.1f %-10.2f %-10.2f\n", r.layers,
                static_cast<long long>(r.tokens), bytes / 1048576.0, p50, bytes / p50 / 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace attn

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attn::Run();
}
