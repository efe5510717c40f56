// The host cost of moving sessions between replicas without a network: export (page reads and
// CRC32C) and import (checks and page writes) between two host KV regions, for a few session
// sizes. Prints a table; the rate over gRPC on loopback is at most this.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "sessions/kv_page_pool.h"
#include "sessions/session.h"
#include "sessions/session_transfer.h"

ABSL_FLAG(int, repeats, 5, "moves per row; the table shows the median");
ABSL_FLAG(int64_t, page_bytes, 8192, "pool page bytes of keys (values as many)");

namespace attn {
namespace {

struct Row {
  int layers;
  int64_t tokens;
};

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
