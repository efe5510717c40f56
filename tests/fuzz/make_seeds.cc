// Writes the fuzz targets' seed corpora, one folder per target: attend/ (small valid
// AttendRequests covering every dtype, causal, GQA/MQA, packed batches with zero-length
// sequences, windows, scales, LSE, tensors and outputs in region r0), session/ (programs,
// session_fuzz.h, over every session RPC) and region/ (region_fuzz.h: each template with its
// tensors in r0, in r1, at offsets that are multiples of the element size but not of 16, and in
// the GPU region) and import/ (import_fuzz.h: ImportSession streams of 16-bit and FP8 caches,
// pages of one and of several pool pages, an empty session, a fork family in one stream).
//   make_fuzz_seeds <dir>
// The checked-in tests/fuzz/corpus/ was written by it; scripts/fuzz.sh refreshes it.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "attn/kernels/dtype_convert.h"
#include "attn/v1/attention.pb.h"
#include "import_fuzz.h"
#include "region_fuzz.h"

namespace {

using attn::v1::AttendRequest;
using attn::v1::DType;

struct Seed {
  const char* name;
  DType dtype;
  std::vector<int32_t> seq_q, seq_k;  // per sequence; cu_seqlens are sent when > 1 sequence
  int heads, kv_heads, head_dim;
  bool causal = false;
  int window_left = -2, window_right = -2;  // -2: no window message
  float scale = 0;
  bool lse = false;
  bool high = false;
  // Shared memory (the fuzz harness registers one 64 KiB region, "r0"): q, k and v there
  // instead of in the message, and o (and lse) written there.
  bool inputs_in_region = false;
  bool outputs_in_region = false;
};

// Moves t's bytes to region r0 at *offset (the region's contents come from the harness).
void ToRegion(attn::v1::Tensor* t, uint64_t* offset) {
  const uint64_t bytes = t->data().size();
  t->clear_data();
  t->mutable_region()->set_region("r0");
  t->mutable_region()->set_offset(*offset);
  t->mutable_region()->set_bytes(bytes);
  *offset += bytes;
}

void Fill(attn::v1::Tensor* t, DType dtype, int64_t tokens, int heads, int d, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  t->set_dtype(dtype);
  t->add_shape(tokens);
  t->add_shape(heads);
  t->add_shape(d);
  const int64_t n = tokens * heads * d;
  std::string& bytes = *t->mutable_data();
  for (int64_t i = 0; i < n; ++i) {
    const float f = dist(rng);
    if (dtype == attn::v1::DTYPE_FLOAT32) {
      bytes.append(reinterpret_cast<const char*>(&f), 4);
    } else {
      const uint16_t h = dtype == attn::v1::DTYPE_FLOAT16 ? attn::kernels::cpu::FloatToHalfBits(f)
                                                          : attn::kernels::cpu::FloatToBf16Bits(f);
      bytes.append(reinterpret_cast<const char*>(&h), 2);
    }
  }
}

// Session programs (session_fuzz.h): [op][length, 2 bytes LE][message] records.
void Record(std::string* p, int op, const std::string& message) {
  p->push_back(static_cast<char>(op));
  p->push_back(static_cast<char>(message.size() & 0xff));
  p->push_back(static_cast<char>(message.size() >> 8));
  p->append(message);
}

attn::v1::StepRequest SeedStep(const char* id, int layer, int n, int heads, int kv_heads, int d,
                               DType dtype, std::mt19937& rng) {
  attn::v1::StepRequest r;
  r.set_session_id(id);
  r.set_layer(layer);
  Fill(r.mutable_q(), dtype, n, heads, d, rng);
  Fill(r.mutable_k_new(), dtype, n, kv_heads, d, rng);
  Fill(r.mutable_v_new(), dtype, n, kv_heads, d, rng);
  return r;
}

// Programs over every session op: prefill and decode, BatchSteps with repeats, fork then
// copy-on-write, truncate, windows and LSE, close.
std::vector<std::pair<std::string, std::string>> SessionSeeds(std::mt19937& rng) {
  enum { kCreate = 0, kStep, kBatchStep, kTruncate, kFork, kClose };
  std::vector<std::pair<std::string, std::string>> seeds;
  for (DType dtype : {attn::v1::DTYPE_FLOAT16, attn::v1::DTYPE_BFLOAT16}) {
    const bool f16 = dtype == attn::v1::DTYPE_FLOAT16;
    std::string p;
    attn::v1::CreateSessionRequest c;
    c.set_num_layers(2);
    c.set_num_kv_heads(f16 ? 2 : 1);
    c.set_head_dim(f16 ? 8 : 16);
    c.set_dtype(dtype);
    Record(&p, kCreate, c.SerializeAsString());
    const int heads = f16 ? 4 : 2, kv = c.num_kv_heads(), d = c.head_dim();
    Record(&p, kStep, SeedStep("#0", 0, 21, heads, kv, d, dtype, rng).SerializeAsString());
    attn::v1::StepRequest decode = SeedStep("#0", 1, 1, heads, kv, d, dtype, rng);
    decode.set_return_lse(true);
    Record(&p, kStep, decode.SerializeAsString());
    attn::v1::BatchStepRequest b;
    *b.add_steps() = SeedStep("#0", 0, 1, heads, kv, d, dtype, rng);
    *b.add_steps() = SeedStep("#0", 1, 4, heads, kv, d, dtype, rng);
    *b.add_steps() = SeedStep("#0", 0, 2, heads, kv, d, dtype, rng);
    b.mutable_steps(2)->mutable_window()->set_left(5);
    b.mutable_steps(2)->mutable_window()->set_right(-1);
    Record(&p, kBatchStep, b.SerializeAsString());
    attn::v1::ForkSessionRequest f;
    f.set_session_id("#0");
    Record(&p, kFork, f.SerializeAsString());
    Record(&p, kStep, SeedStep("#1", 0, 3, heads, kv, d, dtype, rng).SerializeAsString());
    attn::v1::TruncateSessionRequest t;
    t.set_session_id("#0");
    t.set_tokens(2);
    Record(&p, kTruncate, t.SerializeAsString());
    attn::v1::StepRequest scaled = SeedStep("#0", 0, 1, heads, kv, d, dtype, rng);
    scaled.set_softmax_scale(0.3f);
    Record(&p, kStep, scaled.SerializeAsString());
    attn::v1::CloseSessionRequest close;
    close.set_session_id("#0");
    Record(&p, kClose, close.SerializeAsString());
    Record(&p, kStep, SeedStep("#1", 1, 2, heads, kv, d, dtype, rng).SerializeAsString());
    seeds.emplace_back(f16 ? "session_program_f16" : "session_program_bf16", p);
  }
  return seeds;
}

// A region input (region_fuzz.h) of template t: q, k, v in region `in`, o (and lse when the
// template returns it) in `out`, back to back, each at the next multiple of `align` plus `skew`
// (lse: plus skew rounded up to a multiple of 4).
std::string PlacedRegionInput(uint8_t t, attn::fuzz::RegionName in, attn::fuzz::RegionName out,
                              uint64_t align, uint64_t skew, uint8_t flags) {
  using attn::fuzz::RegionSlot;
  const attn::fuzz::RegionTemplateInfo info = attn::fuzz::DescribeRegionTemplate(t);
  const std::vector<uint64_t>& bytes = info.bytes;
  std::vector<attn::fuzz::RegionEdit> edits;
  uint64_t at = 0;
  for (int s = 0; s < (info.lse ? 5 : 4); ++s) {
    const auto slot = static_cast<RegionSlot>(s);
    if (s == 3 && in != out) at = 0;  // outputs from the start of their own region
    at = (at + align - 1) / align * align + (slot == RegionSlot::kLse ? (skew + 3) / 4 * 4 : skew);
    edits.push_back({slot, s < 3 ? in : out, static_cast<uint32_t>(at), 0});
    at += bytes[s];
  }
  return attn::fuzz::RegionInput(t, static_cast<uint8_t>(7 * t + 1), flags, edits);
}

std::vector<std::pair<std::string, std::string>> RegionSeeds() {
  using attn::fuzz::RegionName;
  std::vector<std::pair<std::string, std::string>> seeds;
  for (uint8_t t = 0; t < attn::fuzz::RegionTemplateCount(); ++t) {
    const std::string n = "template" + std::to_string(t);
    const bool f32 = attn::fuzz::DescribeRegionTemplate(t).element_bytes == 4;
    seeds.emplace_back(n + "_r0", PlacedRegionInput(t, RegionName::kR0, RegionName::kR0, 16, 0, 0));
    seeds.emplace_back(n + "_r1_to_r0",
                       PlacedRegionInput(t, RegionName::kR1, RegionName::kR0, 16, 0, 0));
    // Multiples of the element size (4 covers float32 too), not of 16.
    seeds.emplace_back(n + "_element_aligned",
                       PlacedRegionInput(t, RegionName::kR0, RegionName::kR1, 16, 4, 0));
    // GPU regions: float32 is refused there, and steps take them only where the backend
    // computes on a GPU (flags bit 1).
    if (!f32) {
      seeds.emplace_back(n + "_gpu",
                         PlacedRegionInput(t, RegionName::kG0, RegionName::kG0, 16, 0, 2));
    }
  }
  return seeds;
}

// ImportSession streams (import_fuzz.h) the fuzz engine's replica accepts (2 KiB pool pages,
// sessions of at most 96 tokens): a header, then a generated page per page of its tables.
struct ImportSeed {
  const char* name;
  DType dtype;
  int kv_heads, head_dim;
  std::vector<int64_t> layer_tokens;
  bool fp8 = false;
};

std::vector<std::pair<std::string, std::string>> ImportSeeds() {
  const DType f16 = attn::v1::DTYPE_FLOAT16, bf16 = attn::v1::DTYPE_BFLOAT16;
  const std::vector<ImportSeed> seeds = {
      // Rows of 32 bytes: 64 tokens a page; a full page, a partial one, an empty layer.
      {"import_f16_two_layers", f16, 2, 8, {70, 3, 0}},
      // Rows of 48 bytes divide no page: pages of 3 pool pages, 128 tokens each.
      {"import_bf16_page_span_3", bf16, 3, 8, {96, 5}},
      // An FP8 cache (rows of 32 one-byte codes) with its scales.
      {"import_fp8_cache", f16, 2, 16, {65, 1}, true},
      {"import_empty_session", bf16, 1, 4, {0}},
  };
  std::vector<std::pair<std::string, std::string>> out;
  uint32_t fill = 1;
  for (const ImportSeed& s : seeds) {
    const int64_t elem = s.fp8 ? 1 : 2;
    const int64_t row = s.kv_heads * s.head_dim * elem;
    const int64_t pool_page = 2048;
    int64_t span = 1;
    while (span * pool_page % row != 0) ++span;
    const int64_t page_tokens = span * pool_page / row;
    attn::v1::SessionTransferChunk c;
    attn::v1::SessionTransferHeader* h = c.mutable_header();
    h->set_num_layers(static_cast<int32_t>(s.layer_tokens.size()));
    h->set_num_kv_heads(s.kv_heads);
    h->set_head_dim(s.head_dim);
    h->set_dtype(s.dtype);
    h->set_max_tokens(96);
    h->set_page_tokens(static_cast<int32_t>(page_tokens));
    h->set_page_span(static_cast<int32_t>(span));
    h->set_page_bytes(span * pool_page);
    int64_t pages = 0;
    for (int64_t t : s.layer_tokens) {
      h->add_layer_tokens(t);
      h->add_layer_pages((t + page_tokens - 1) / page_tokens);
      pages += (t + page_tokens - 1) / page_tokens;
    }
    h->set_source_session_id("elsewhere.seed");
    if (s.fp8) {
      h->set_cache_dtype(attn::v1::DTYPE_FLOAT8_E4M3);
      for (int g = 0; g < s.kv_heads; ++g) {
        h->add_k_scales(0.01f * (g + 1));
        h->add_v_scales(0.02f * (g + 1));
      }
    }
    std::string input;
    attn::fuzz::AppendImportRecord(&input, attn::fuzz::ImportOp::kChunk, c.SerializeAsString());
    for (int64_t p = 0; p < pages; ++p) {
      attn::fuzz::AppendImportRecord(&input, attn::fuzz::ImportOp::kPage,
                                     attn::fuzz::ImportPagePayload(0, 0, 0, fill++));
    }
    attn::fuzz::AppendImportRecord(&input, attn::fuzz::ImportOp::kEnd, "");
    out.emplace_back(s.name, input);
  }
  // A fork family in one stream: the f16 session, then a fork that shares its first layer's two
  // pages (stream pages 0 and 1) and has a page of its own in the second layer.
  std::string family = out.front().second;
  family.resize(family.size() - 3);  // without its end
  attn::v1::SessionTransferChunk fork;
  attn::v1::SessionTransferHeader* h = fork.mutable_header();
  h->set_num_layers(3);
  h->set_num_kv_heads(2);
  h->set_head_dim(8);
  h->set_dtype(f16);
  h->set_max_tokens(96);
  h->set_page_tokens(64);
  h->set_page_span(1);
  h->set_page_bytes(2048);
  for (auto [tokens, pages] : {std::pair{70, 2}, {5, 1}, {0, 0}}) {
    h->add_layer_tokens(tokens);
    h->add_layer_pages(pages);
  }
  for (int64_t k : {1, 2, 0}) h->add_shared_pages(k);
  h->set_source_session_id("elsewhere.fork");
  attn::fuzz::AppendImportRecord(&family, attn::fuzz::ImportOp::kChunk, fork.SerializeAsString());
  attn::fuzz::AppendImportRecord(&family, attn::fuzz::ImportOp::kPage,
                                 attn::fuzz::ImportPagePayload(0, 0, 0, fill++));
  attn::fuzz::AppendImportRecord(&family, attn::fuzz::ImportOp::kEnd, "");
  out.emplace_back("import_fork_family", family);
  return out;
}

bool Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream out(dir + "/" + name + ".pb", std::ios::binary);
  out << bytes;
  if (!out) std::fprintf(stderr, "cannot write %s/%s.pb\n", dir.c_str(), name.c_str());
  return static_cast<bool>(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <dir>\n", argv[0]);
    return 2;
  }
  const DType f32 = attn::v1::DTYPE_FLOAT32, f16 = attn::v1::DTYPE_FLOAT16,
              bf16 = attn::v1::DTYPE_BFLOAT16;
  const std::vector<Seed> seeds = {
      {"plain_f32", f32, {4}, {4}, 1, 1, 8},
      {"plain_f16", f16, {5}, {7}, 2, 2, 8},
      {"plain_bf16", bf16, {3}, {6}, 2, 1, 16},
      {"causal_f32", f32, {6}, {6}, 2, 1, 4, true},
      {"causal_bottom_right", bf16, {3}, {9}, 1, 1, 8, true},
      {"causal_more_q_than_k", f16, {8}, {3}, 1, 1, 4, true},
      {"gqa", bf16, {4}, {5}, 4, 2, 8},
      {"mqa", f16, {4}, {4}, 4, 1, 8, true},
      {"varlen", f32, {2, 5, 1}, {3, 4, 6}, 2, 1, 4},
      {"varlen_causal", bf16, {1, 4}, {6, 4}, 2, 2, 8, true},
      {"varlen_zero_len", f16, {3, 0, 2}, {0, 4, 2}, 1, 1, 4},
      {"window", f32, {8}, {8}, 1, 1, 4, false, 2, 1},
      {"window_left_only", bf16, {6}, {10}, 2, 1, 8, true, 3, -1},
      {"window_zero", f16, {5}, {5}, 1, 1, 2, false, 0, 0},
      {"scale", f32, {4}, {6}, 1, 1, 3, false, -2, -2, 0.25f},
      {"negative_scale_lse", bf16, {4}, {4}, 2, 2, 8, false, -2, -2, -1.5f, true},
      {"lse", f32, {5}, {3}, 2, 1, 4, true, -2, -2, 0, true, true},
      {"head_dim_32", bf16, {2}, {3}, 1, 1, 32},
      {"head_dim_64_lse", f16, {2}, {2}, 1, 1, 64, true, -2, -2, 0, true},
      {"region_inputs", bf16, {4}, {6}, 2, 1, 8, false, -2, -2, 0, false, false, true},
      {"region_outputs_lse", f32, {3}, {5}, 2, 2, 4, true, -2, -2, 0, true, false, true, true},
  };
  const std::string attend_dir = std::string(argv[1]) + "/attend";
  const std::string session_dir = std::string(argv[1]) + "/session";
  const std::string region_dir = std::string(argv[1]) + "/region";
  const std::string import_dir = std::string(argv[1]) + "/import";
  for (const std::string& d : {attend_dir, session_dir, region_dir, import_dir}) {
    std::error_code ec;
    std::filesystem::create_directories(d, ec);
    if (ec) {
      std::fprintf(stderr, "cannot create %s: %s\n", d.c_str(), ec.message().c_str());
      return 1;
    }
  }
  std::mt19937 rng(1234);
  for (const Seed& s : seeds) {
    AttendRequest r;
    int64_t tq = 0, tk = 0;
    for (int32_t n : s.seq_q) tq += n;
    for (int32_t n : s.seq_k) tk += n;
    Fill(r.mutable_q(), s.dtype, tq, s.heads, s.head_dim, rng);
    Fill(r.mutable_k(), s.dtype, tk, s.kv_heads, s.head_dim, rng);
    Fill(r.mutable_v(), s.dtype, tk, s.kv_heads, s.head_dim, rng);
    if (s.seq_q.size() > 1) {
      int32_t cq = 0, ck = 0;
      r.add_cu_seqlens_q(0);
      r.add_cu_seqlens_k(0);
      for (size_t b = 0; b < s.seq_q.size(); ++b) {
        r.add_cu_seqlens_q(cq += s.seq_q[b]);
        r.add_cu_seqlens_k(ck += s.seq_k[b]);
      }
    }
    r.set_causal(s.causal);
    if (s.window_left != -2) {
      r.mutable_window()->set_left(s.window_left);
      r.mutable_window()->set_right(s.window_right);
    }
    r.set_softmax_scale(s.scale);
    r.set_return_lse(s.lse);
    if (s.high) r.set_priority(attn::v1::PRIORITY_HIGH);
    uint64_t offset = 0;
    const uint64_t o_bytes = r.q().data().size();
    if (s.inputs_in_region) {
      for (auto* t : {r.mutable_q(), r.mutable_k(), r.mutable_v()}) ToRegion(t, &offset);
    }
    if (s.outputs_in_region) {
      r.mutable_o_region()->set_region("r0");
      r.mutable_o_region()->set_offset(offset);
      r.mutable_o_region()->set_bytes(o_bytes);
      offset += o_bytes;
      if (s.lse) {
        r.mutable_lse_region()->set_region("r0");
        r.mutable_lse_region()->set_offset(offset);
        r.mutable_lse_region()->set_bytes(4 * uint64_t(tq) * s.heads);
      }
    }
    r.set_request_id(7);
    if (!Write(attend_dir, s.name, r.SerializeAsString())) return 1;
  }
  for (const auto& [name, program] : SessionSeeds(rng)) {
    if (!Write(session_dir, name, program)) return 1;
  }
  for (const auto& [name, input] : RegionSeeds()) {
    if (!Write(region_dir, name, input)) return 1;
  }
  for (const auto& [name, input] : ImportSeeds()) {
    if (!Write(import_dir, name, input)) return 1;
  }
  return 0;
}
