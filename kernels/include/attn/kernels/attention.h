// The narrow public interface of the attention kernels: plain argument structs and a small
// status type. Nothing here knows about gRPC, protobuf or metrics, and nothing here throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace attn::kernels {

// kFloat8E4M3 is OCP E4M3FN (FP8): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, S.1111.111 is NaN, largest finite value 448. Kernels take it for K and V only
// (AttentionArgs::kv_dtype, with scales); q and o are float32, float16 or bfloat16.
enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };

constexpr size_t DTypeSize(DType t) {
  return t == DType::kFloat32 ? 4 : t == DType::kFloat8E4M3 ? 1 : 2;
}
const char* DTypeName(DType t);

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,   // the arguments can never be run as given
  kUnimplemented,     // valid, but this backend has no kernel for it (head dim, dtype)
  kResourceExhausted, // workspace or device memory too small
  kInternal,          // a device error
};

// A status without exceptions or dependencies; the server turns it into absl::Status.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// K and V read through a page table instead of contiguous rows (the KV cache of sessions).
//
// The caches are pools of fixed-size pages, one pool for K and one for V with the same page
// numbering; page p holds page_size token rows:
//   k_pages, v_pages  [num_pages, page_size, num_kv_heads, head_dim]  (args.k / args.v point here)
// Sequence b's keys are, in order, the rows of pages
//   page_indices[page_indptr[b]] .. page_indices[page_indptr[b+1] - 1]
// (a CSR page table), of which the first seqlens_k[b] rows are used: every page but the last is
// full, so page_indptr[b+1] - page_indptr[b] == ceil(seqlens_k[b] / page_size). Pages may be in
// any order and shared between sequences (a forked prefix). A sequence may have 0 keys.
// Pointers follow the same memory rule as the rest of AttentionArgs.
struct PagedKv {
  int32_t page_size = 0;                 // tokens per page; 0: K/V are contiguous, not paged
  int32_t num_pages = 0;                 // pages in each pool, for bounds checks
  const int32_t* page_indptr = nullptr;  // [batch + 1], page_indptr[0] == 0
  const int32_t* page_indices = nullptr; // [page_indptr[batch]], each in [0, num_pages)
  const int32_t* seqlens_k = nullptr;    // [batch], keys of each sequence
  // Rows appended by this call (a session's step), both set or neither: the keys and values of
  // the last s_q positions of each sequence, [total_q, num_kv_heads, head_dim] with row t for
  // query token t. They are read from here, not from the pages, and written into their page rows
  // (through the page table) by the same call, so that a step needs no copy of its own before
  // its attention. The pools k and v are then written: the caller owns those rows, and nothing
  // else reads or writes them until the call has completed. 16-bit K/V only; on the CUDA backend
  // the decode kernel's (max_seqlen_q <= kDecodeMaxSeqlenQ), 16-byte aligned.
  const void* append_k = nullptr;
  const void* append_v = nullptr;
};

// True when args appends rows to its pages (PagedKv::append_k and append_v).
inline bool Appends(const PagedKv& p) { return p.append_k != nullptr || p.append_v != nullptr; }

// Scales of FP8 K/V (AttentionArgs::kv_dtype == DType::kFloat8E4M3): the value of e4m3 code c of k
// in sequence b, KV head g is E4M3(c) * k[b * num_kv_heads + g], and of v likewise with v. One
// scale per (sequence, KV head) of the launch: a cache whose scales are fixed per KV head (a
// session's) passes them repeated for each of its sequences. Scales must be finite and > 0
// (ValidateKvScales checks host copies). The caller owns both arrays, under the memory rule of
// every pointer of AttentionArgs, and keeps them unchanged until the computation has completed.
struct KvScales {
  const float* k = nullptr;  // [batch, num_kv_heads]
  const float* v = nullptr;  // [batch, num_kv_heads]
};

// Forward attention over a packed varlen batch.
//
// Layouts (row-major, contiguous):
//   q, o  [total_q, num_heads,    head_dim]
//   k, v  [total_k, num_kv_heads, head_dim]
//   lse   [num_heads, total_q] float32, natural log; optional (nullptr)
//   cu_seqlens_q/k [batch + 1] int32, cu[0] == 0, non-decreasing, cu[batch] == total.
// Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key rows likewise.
// All pointers live where the backend computes: host memory for the CPU backend, device memory
// for the CUDA backend (cu_seqlens included), each aligned to its element's size (dtype's for
// q, k, v and o, 4 bytes for lse and the int32 arrays).
//
// Masking, for query i of a sequence with s_q queries and s_k keys, aligned bottom-right:
// the query sits at key position p = i + s_k - s_q, and sees key j when
//   causal:        j <= p
//   window_left:   j >= p - window_left   (when window_left  >= 0)
//   window_right:  j <= p + window_right  (when window_right >= 0)
// A query row that sees no key gets o = 0 and lse = -inf.
// GQA/MQA: query head h reads KV head h / (num_heads / num_kv_heads).
struct AttentionArgs {
  DType dtype = DType::kBFloat16;  // of q and o, and of k and v unless kv_dtype says otherwise
  // Element type of k and v when it is not dtype: DType::kFloat8E4M3 (an FP8 KV cache, contiguous
  // or paged), whose codes are dequantized with kv_scales (KvScales) and computed on in float;
  // dtype then is the type of q and o (float16 or bfloat16 on the CUDA backend, any on the CPU).
  // Unset: dtype. KvDType(args) is the type in effect.
  std::optional<DType> kv_dtype;
  KvScales kv_scales;  // FP8 K/V only
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;

  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int32_t batch = 1;
  int32_t total_q = 0;
  int32_t total_k = 0;
  // Upper bounds on any one sequence's length; the CUDA backend sizes its grid with these.
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_k = 0;

  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;

  // When paged.page_size > 0, k and v are page pools read through paged; cu_seqlens_k and
  // total_k are then not used (cu_seqlens_k may be null) and max_seqlen_k bounds seqlens_k.
  PagedKv paged;

  float softmax_scale = 0.0f;  // 0 means 1/sqrt(head_dim)
  bool causal = false;
  int32_t window_left = -1;    // -1: unbounded
  int32_t window_right = -1;   // -1: unbounded
};

// The element type of k and v: kv_dtype when set, else dtype.
inline DType KvDType(const AttentionArgs& args) { return args.kv_dtype.value_or(args.dtype); }

// True when k and v are FP8 codes with scales (kv_dtype == DType::kFloat8E4M3).
inline bool IsFp8Kv(const AttentionArgs& args) { return KvDType(args) == DType::kFloat8E4M3; }

// The scale actually applied: softmax_scale, or 1/sqrt(head_dim) when it is 0.
float EffectiveSoftmaxScale(const AttentionArgs& args);

// Checks what every backend needs: positive sizes, num_heads % num_kv_heads == 0, non-null
// pointers aligned to their element's size, window values >= -1, dtype not FP8, kv_dtype either
// dtype or FP8 (then kv_scales set). It does not read cu_seqlens or scales (they may be device
// memory).
Status ValidateCommon(const AttentionArgs& args);

// True when args reads K/V through a page table.
inline bool IsPaged(const AttentionArgs& args) { return args.paged.page_size > 0; }

// Checks host-side page table arrays of a paged args: indptr starts at 0 and covers exactly
// ceil(seqlens_k[b] / page_size) pages per sequence, every index is in [0, num_pages), and
// max_seqlen_k bounds every seqlens_k[b] (>= 0).
Status ValidatePageTable(const AttentionArgs& args);

// Checks host-side FP8 K/V scales of args (IsFp8Kv): each of the batch * num_kv_heads k and v
// scales finite and > 0. OK for K/V that are not FP8.
Status ValidateKvScales(const AttentionArgs& args);

// Checks host-side cu_seqlens against batch and totals, and that the declared max lengths bound
// every sequence.
Status ValidateCuSeqlens(const int32_t* cu_seqlens, int32_t batch, int32_t total,
                         int32_t max_seqlen, const char* name);

// FLOPs as FlashAttention's benchmarks count them: 4 * s_q * s_k * d per head, over the keys each
// query actually sees for causal (so a square causal problem counts half). For paged args the
// key counts come from args.paged.seqlens_k (host memory then) and host_cu_seqlens_k is unused.
double AttentionFlops(const AttentionArgs& args, const int32_t* host_cu_seqlens_q,
                      const int32_t* host_cu_seqlens_k);

}  // namespace attn::kernels
