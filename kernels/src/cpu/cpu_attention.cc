// Tiled forward attention on the CPU. Each work item is one (sequence, KV head, tile of query
// rows): it walks the visible key tiles with an online softmax, so no score matrix larger than
// one tile exists. The rows of a tile are the (token, query head) pairs of the query heads that
// share the KV head, token-major, so that each key tile is loaded once for all of them (with GQA
// and one decode token, the whole group is one tile). Inner loops run over contiguous floats so that the compiler vectorizes them. Paged K/V
// (args.paged) differ only in where key row j of a sequence is read from (KeyRow); FP8 K/V
// (args.kv_dtype) in how a row is converted (e4m3 codes times their scale, LoadKeyTile).
#include "attn/kernels/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attn/kernels/dtype_convert.h"

namespace attn::kernels::cpu {
namespace {

constexpr int kBlockM = 32;  // query rows per work item
constexpr int kBlockN = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-worker scratch, carved out of the caller's workspace.
struct Scratch {
  float* q;    // [kBlockM][d], pre-scaled by scale * log2(e)
  float* kt;   // [d][kBlockN]: the key tile transposed
  float* v;    // [kBlockN][d]
  float* s;    // [kBlockM][kBlockN]
  float* acc;  // [kBlockM][d]
  float* m;    // [kBlockM] running max (log2 units)
  float* l;    // [kBlockM] running sum
};

size_t Align64(size_t n) { return (n + 63) & ~size_t{63}; }

size_t ScratchBytes(int d) {
  return Align64(sizeof(float) * kBlockM * d) + Align64(sizeof(float) * d * kBlockN) +
         Align64(sizeof(float) * kBlockN * d) + Align64(sizeof(float) * kBlockM * kBlockN) +
         Align64(sizeof(float) * kBlockM * d) + 2 * Align64(sizeof(float) * kBlockM);
}

Scratch CarveScratch(char* base, int d) {
  Scratch s;
  auto take = [&](size_t floats) {
    float* p = reinterpret_cast<float*>(base);
    base += Align64(sizeof(float) * floats);
    return p;
  };
  s.q = take(size_t(kBlockM) * d);
  s.kt = take(size_t(d) * kBlockN);
  s.v = take(size_t(kBlockN) * d);
  s.s = take(size_t(kBlockM) * kBlockN);
  s.acc = take(size_t(kBlockM) * d);
  s.m = take(kBlockM);
  s.l = take(kBlockM);
  return s;
}

// Keys [lo, hi] (inclusive, clipped to the sequence) that query row i sees.
struct KeyRange {
  int64_t lo, hi;
};
KeyRange VisibleKeys(const AttentionArgs& a, int64_t i, int64_t sq, int64_t sk) {
  const int64_t p = i + sk - sq;
  int64_t lo = 0, hi = sk - 1;
  if (a.causal) hi = std::min(hi, p);
  if (a.window_right >= 0) hi = std::min(hi, p + a.window_right);
  if (a.window_left >= 0) lo = std::max(lo, p - a.window_left);
  return {lo, hi};
}

// The two tile products read and write only the calling worker's own scratch. Under TSan their
// inner loops are left uninstrumented: instrumenting them makes the kernel ~100x slower and can
// find nothing there. What fills the scratch (LoadRow, LoadKeyTile), the softmax and the output
// stores stay instrumented, so two workers sharing scratch or output are still caught.
#if defined(__SANITIZE_THREAD__)
#define ATTN_SCRATCH_ONLY __attribute__((no_sanitize("thread")))
#else
#define ATTN_SCRATCH_ONLY
#endif

// S[r][0..kBlockN) = sum over c of q_r[c] * kt[c][0..kBlockN): vectorizes over the key index.
// Always the whole tile width (a fixed trip count keeps the loop vectorizable): LoadKeyTile
// zero-fills the columns past the tile's last key, and SoftmaxRow and AccumulateTile read only
// the first n columns.
ATTN_SCRATCH_ONLY ATTN_CPU_VECTORIZE void ScoreTile(const float* __restrict q,
                                                    const float* __restrict kt,
                                                    float* __restrict s, int rows, int d) {
  for (int r = 0; r < rows; ++r) {
    float* __restrict sr = s + r * kBlockN;
    for (int j = 0; j < kBlockN; ++j) sr[j] = 0.0f;
    const float* __restrict qr = q + r * d;
    for (int c = 0; c < d; ++c) {
      const float qc = qr[c];
      const float* __restrict kc = kt + c * kBlockN;
      for (int j = 0; j < kBlockN; ++j) sr[j] += qc * kc[j];
    }
  }
}

// acc[r][0..d) = acc[r] * alpha_r + sum_j p[r][j] * v[j][0..d).
ATTN_SCRATCH_ONLY ATTN_CPU_VECTORIZE void AccumulateTile(const float* __restrict p,
                                                         const float* __restrict v,
                                                         float* __restrict acc,
                                                         const float* __restrict alpha, int rows,
                                                         int n, int d) {
  for (int r = 0; r < rows; ++r) {
    float* __restrict ar = acc + r * d;
    const float al = alpha[r];
    for (int c = 0; c < d; ++c) ar[c] *= al;
    const float* __restrict pr = p + r * kBlockN;
    for (int j = 0; j < n; ++j) {
      const float pj = pr[j];
      if (pj == 0.0f) continue;
      const float* __restrict vj = v + j * d;
      for (int c = 0; c < d; ++c) ar[c] += pj * vj[c];
    }
  }
}

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int64_t row0;  // first packed row of the tile: token * group + head within the group
};

// Row index (in [page rows, num_kv_heads, head_dim] units) of key j of sequence seq in the pages.
int64_t PageRow(const PagedKv& p, int32_t seq, int64_t j) {
  const int32_t page = p.page_indices[p.page_indptr[seq] + j / p.page_size];
  return int64_t(page) * p.page_size + j % p.page_size;
}

class Runner {
 public:
  Runner(const AttentionArgs& a, char* workspace)
      : a_(a), kv_dtype_(KvDType(a)), d_(a.head_dim), group_(a.num_heads / a.num_kv_heads),
        scale_log2_(EffectiveSoftmaxScale(a) * kLog2e) {
    tile_prefix_ = reinterpret_cast<int64_t*>(workspace);
    scratch_base_ = workspace + Align64(sizeof(int64_t) * (a.batch + 1));
    tile_prefix_[0] = 0;
    for (int32_t b = 0; b < a.batch; ++b) {
      const int64_t sq = a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b];
      tile_prefix_[b + 1] = tile_prefix_[b] + (sq * group_ + kBlockM - 1) / kBlockM;
    }
  }

  int64_t NumItems() const { return tile_prefix_[a_.batch] * a_.num_kv_heads; }

  void RunItem(int64_t item, int worker) {
    Scratch s = CarveScratch(scratch_base_ + size_t(worker) * ScratchBytes(d_), d_);
    ComputeTile(Decode(item), s);
  }

 private:
  WorkItem Decode(int64_t item) const {
    const int64_t tile = item / a_.num_kv_heads;
    const int32_t kv_head = static_cast<int32_t>(item % a_.num_kv_heads);
    const int64_t* it = std::upper_bound(tile_prefix_, tile_prefix_ + a_.batch + 1, tile);
    const int32_t seq = static_cast<int32_t>(it - tile_prefix_ - 1);
    return {seq, kv_head, (tile - tile_prefix_[seq]) * kBlockM};
  }

  // Token (inside the sequence) and query head of row r of tile w.
  int64_t Token(const WorkItem& w, int r) const { return (w.row0 + r) / group_; }
  int32_t Head(const WorkItem& w, int r) const {
    return w.kv_head * group_ + static_cast<int32_t>((w.row0 + r) % group_);
  }

  // Keys of sequence seq.
  int64_t SeqLenK(int32_t seq) const {
    if (IsPaged(a_)) return a_.paged.seqlens_k[seq];
    return a_.cu_seqlens_k[seq + 1] - a_.cu_seqlens_k[seq];
  }

  // Row index (in [tokens or page rows, num_kv_heads, head_dim] units) of key j of sequence seq.
  int64_t KeyRow(int32_t seq, int64_t j) const {
    if (!IsPaged(a_)) return a_.cu_seqlens_k[seq] + j;
    return PageRow(a_.paged, seq, j);
  }

  void ComputeTile(const WorkItem& w, const Scratch& s) const {
    const int64_t q0 = a_.cu_seqlens_q[w.seq], sq = a_.cu_seqlens_q[w.seq + 1] - q0;
    const int64_t sk = SeqLenK(w.seq);
    const int rows = static_cast<int>(std::min<int64_t>(kBlockM, sq * group_ - w.row0));
    const int kv_head = w.kv_head;
    const int64_t q_stride = int64_t(a_.num_heads) * d_;
    const int64_t kv_stride = int64_t(a_.num_kv_heads) * d_;

    for (int r = 0; r < rows; ++r) {
      const int64_t src = (q0 + Token(w, r)) * q_stride + int64_t(Head(w, r)) * d_;
      LoadRow(a_.dtype, a_.q, src, d_, s.q + r * d_, scale_log2_);
      s.m[r] = kNegInf;
      s.l[r] = 0.0f;
    }
    std::fill(s.acc, s.acc + size_t(rows) * d_, 0.0f);

    // Key tiles any row of this tile sees.
    const KeyRange first = VisibleKeys(a_, Token(w, 0), sq, sk);
    const KeyRange last = VisibleKeys(a_, Token(w, rows - 1), sq, sk);
    const int64_t lo = std::max<int64_t>(0, first.lo), hi = std::min(sk - 1, last.hi);
    for (int64_t j0 = (lo / kBlockN) * kBlockN; j0 <= hi; j0 += kBlockN) {
      const int n = static_cast<int>(std::min<int64_t>(kBlockN, sk - j0));
      LoadKeyTile(w.seq, j0, n, kv_head, kv_stride, s);
      ScoreTile(s.q, s.kt, s.s, rows, d_);
      float alpha[kBlockM];
      for (int r = 0; r < rows; ++r) {
        alpha[r] = SoftmaxRow(VisibleKeys(a_, Token(w, r), sq, sk), j0, n, s.s + r * kBlockN,
                              &s.m[r], &s.l[r]);
      }
      AccumulateTile(s.s, s.v, s.acc, alpha, rows, n, d_);
    }
    WriteOutput(w, q0, rows, s);
  }

  // FP8 K/V: each code dequantized with its (sequence, KV head) scale (KvScales); else 1.
  void LoadKeyTile(int32_t seq, int64_t key0, int n, int kv_head, int64_t kv_stride,
                   const Scratch& s) const {
    const int64_t scale_at = int64_t(seq) * a_.num_kv_heads + kv_head;
    const float k_scale = IsFp8Kv(a_) ? a_.kv_scales.k[scale_at] : 1.0f;
    const float v_scale = IsFp8Kv(a_) ? a_.kv_scales.v[scale_at] : 1.0f;
    float row[kMaxHeadDim];
    for (int j = 0; j < n; ++j) {
      const int64_t src = KeyRow(seq, key0 + j) * kv_stride + int64_t(kv_head) * d_;
      LoadRow(kv_dtype_, a_.k, src, d_, row, k_scale);
      for (int c = 0; c < d_; ++c) s.kt[c * kBlockN + j] = row[c];
      LoadRow(kv_dtype_, a_.v, src, d_, s.v + j * d_, v_scale);
    }
    for (int j = n; j < kBlockN; ++j) {
      for (int c = 0; c < d_; ++c) s.kt[c * kBlockN + j] = 0.0f;
    }
  }

  // Masks row scores outside the visible keys, folds the tile into the running max and sum,
  // turns scores into probabilities (relative to the new max) and returns the factor by which
  // the accumulated output must be rescaled.
  static float SoftmaxRow(KeyRange vis, int64_t j0, int n, float* sr, float* m, float* l) {
    float tile_max = kNegInf;
    bool nan = false;
    for (int j = 0; j < n; ++j) {
      const int64_t key = j0 + j;
      if (key < vis.lo || key > vis.hi) sr[j] = kNegInf;
      tile_max = std::max(tile_max, sr[j]);
      nan |= sr[j] != sr[j];
    }
    // std::max drops NaN; a NaN score (NaN in q or in a visible key) must reach o and lse rather
    // than make the row look like one that sees no key.
    const float m_new = nan || *m != *m ? std::numeric_limits<float>::quiet_NaN()
                                        : std::max(*m, tile_max);
    if (m_new == kNegInf) {  // nothing visible yet
      for (int j = 0; j < n; ++j) sr[j] = 0.0f;
      return 1.0f;
    }
    const float alpha = std::exp2(*m - m_new);
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      sr[j] = std::exp2(sr[j] - m_new);
      sum += sr[j];
    }
    *l = *l * alpha + sum;
    *m = m_new;
    return alpha;
  }

  void WriteOutput(const WorkItem& w, int64_t q0, int rows, const Scratch& s) const {
    const int64_t q_stride = int64_t(a_.num_heads) * d_;
    for (int r = 0; r < rows; ++r) {
      const float l = s.l[r];
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // l is NaN in a row that read a NaN
      float* ar = s.acc + r * d_;
      for (int c = 0; c < d_; ++c) ar[c] *= inv;
      const int64_t row = q0 + Token(w, r);
      const int32_t head = Head(w, r);
      StoreRow(a_.dtype, ar, d_, a_.o, row * q_stride + int64_t(head) * d_);
      if (a_.lse) {
        a_.lse[int64_t(head) * a_.total_q + row] =
            l != 0.0f ? (s.m[r] + std::log2(l)) / kLog2e : kNegInf;
      }
    }
  }

  const AttentionArgs& a_;
  const DType kv_dtype_;
  const int d_;
  const int group_;
  const float scale_log2_;
  int64_t* tile_prefix_;
  char* scratch_base_;
};

// The rows args appends (PagedKv::append_k / append_v) into their page rows, before the
// attention reads them there.
void WriteAppendedRows(const AttentionArgs& a) {
  const PagedKv& p = a.paged;
  const size_t row_bytes = DTypeSize(a.dtype) * size_t(a.num_kv_heads) * a.head_dim;
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t s_q = a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b];
    const int64_t off = p.seqlens_k[b] - s_q;
    for (int64_t i = 0; i < s_q; ++i) {
      const int64_t row = PageRow(p, b, off + i);
      const size_t src = size_t(a.cu_seqlens_q[b] + i) * row_bytes;
      std::memcpy(static_cast<char*>(const_cast<void*>(a.k)) + row * row_bytes,
                  static_cast<const char*>(p.append_k) + src, row_bytes);
      std::memcpy(static_cast<char*>(const_cast<void*>(a.v)) + row * row_bytes,
                  static_cast<const char*>(p.append_v) + src, row_bytes);
    }
  }
}

}  // namespace

Status CanImplement(const AttentionArgs& args) {
  Status st = ValidateCommon(args);
  if (!st.ok()) return st;
  if (args.head_dim > kMaxHeadDim) {
    return {StatusCode::kUnimplemented, "head_dim " + std::to_string(args.head_dim) +
                                            " is over the CPU backend's limit of " +
                                            std::to_string(kMaxHeadDim)};
  }
  st = ValidateCuSeqlens(args.cu_seqlens_q, args.batch, args.total_q, args.max_seqlen_q,
                         "cu_seqlens_q");
  if (!st.ok()) return st;
  st = ValidateKvScales(args);
  if (!st.ok()) return st;
  if (IsPaged(args)) return ValidatePageTable(args);
  return ValidateCuSeqlens(args.cu_seqlens_k, args.batch, args.total_k, args.max_seqlen_k,
                           "cu_seqlens_k");
}

size_t WorkspaceBytes(const AttentionArgs& args, int num_workers) {
  return Align64(sizeof(int64_t) * (size_t(std::max(args.batch, 0)) + 1)) +
         size_t(std::max(num_workers, 1)) * ScratchBytes(std::max(args.head_dim, 1));
}

Status Run(const AttentionArgs& args, void* workspace, CpuThreadPool* pool) {
  Status st = CanImplement(args);
  if (!st.ok()) return st;
  if (workspace == nullptr) return {StatusCode::kInvalidArgument, "workspace is null"};
  if (Appends(args.paged)) WriteAppendedRows(args);
  Runner runner(args, static_cast<char*>(workspace));
  const int64_t items = runner.NumItems();
  if (pool) {
    pool->ParallelFor(items, [&](int64_t item, int worker) { runner.RunItem(item, worker); });
  } else {
    for (int64_t i = 0; i < items; ++i) runner.RunItem(i, 0);
  }
  return Status::Ok();
}

}  // namespace attn::kernels::cpu
