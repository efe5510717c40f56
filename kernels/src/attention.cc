#include "attn/kernels/attention.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

namespace attn::kernels {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
  }
  return "unknown";
}

float EffectiveSoftmaxScale(const AttentionArgs& args) {
  if (args.softmax_scale != 0.0f) return args.softmax_scale;
  return 1.0f / std::sqrt(static_cast<float>(args.head_dim));
}

namespace {
Status Invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }

// Every array is read and written as its element type: it must start at a multiple of that
// type's size (null pointers pass; they are checked where they are required).
Status CheckAlignment(const AttentionArgs& a) {
  const size_t elem = DTypeSize(a.dtype);
  struct Array {
    const void* p;
    size_t align;
    const char* name;
  };
  const Array arrays[] = {{a.q, elem, "q"},
                          {a.k, elem, "k"},
                          {a.v, elem, "v"},
                          {a.o, elem, "o"},
                          {a.lse, sizeof(float), "lse"},
                          {a.cu_seqlens_q, sizeof(int32_t), "cu_seqlens_q"},
                          {a.cu_seqlens_k, sizeof(int32_t), "cu_seqlens_k"},
                          {a.paged.page_indptr, sizeof(int32_t), "paged.page_indptr"},
                          {a.paged.page_indices, sizeof(int32_t), "paged.page_indices"},
                          {a.paged.seqlens_k, sizeof(int32_t), "paged.seqlens_k"},
                          {a.paged.append_k, elem, "paged.append_k"},
                          {a.paged.append_v, elem, "paged.append_v"}};
  for (const Array& x : arrays) {
    if (reinterpret_cast<uintptr_t>(x.p) % x.align != 0) {
      return Invalid(std::string(x.name) + " is not aligned to " + std::to_string(x.align) +
                     " bytes, the size of its elements");
    }
  }
  return Status::Ok();
}
}  // namespace

Status ValidateCommon(const AttentionArgs& a) {
  if (a.batch < 1) return Invalid("batch must be >= 1, got " + std::to_string(a.batch));
  const bool paged = IsPaged(a);
  if (a.total_q < 1 || (!paged && a.total_k < 1)) {
    return Invalid("total_q and total_k must be >= 1, got " + std::to_string(a.total_q) + " and " +
                   std::to_string(a.total_k));
  }
  if (a.num_heads < 1 || a.num_kv_heads < 1 || a.head_dim < 1) {
    return Invalid("num_heads, num_kv_heads and head_dim must be >= 1");
  }
  if (a.num_heads % a.num_kv_heads != 0) {
    return Invalid("num_heads (" + std::to_string(a.num_heads) + ") must be a multiple of " +
                   "num_kv_heads (" + std::to_string(a.num_kv_heads) + ")");
  }
  if (a.max_seqlen_q < 1 || a.max_seqlen_k < 1) {
    return Invalid("max_seqlen_q and max_seqlen_k must be >= 1");
  }
  if (a.window_left < -1 || a.window_right < -1) {
    return Invalid("window_left and window_right must be >= -1");
  }
  if (!std::isfinite(a.softmax_scale)) return Invalid("softmax_scale must be finite");
  if (a.dtype == DType::kFloat8E4M3) {
    return Invalid("dtype (of q and o) must be float32, float16 or bfloat16: float8_e4m3 is for k "
                   "and v (kv_dtype)");
  }
  if (a.kv_dtype && *a.kv_dtype != a.dtype && *a.kv_dtype != DType::kFloat8E4M3) {
    return Invalid(std::string("kv_dtype must be dtype (") + DTypeName(a.dtype) +
                   ") or float8_e4m3, got " + DTypeName(*a.kv_dtype));
  }
  if (IsFp8Kv(a) && (!a.kv_scales.k || !a.kv_scales.v)) {
    return Invalid("kv_scales.k and kv_scales.v must be set for float8_e4m3 k and v");
  }
  if (!a.q || !a.k || !a.v || !a.o || !a.cu_seqlens_q || (!paged && !a.cu_seqlens_k)) {
    return Invalid("q, k, v, o, cu_seqlens_q and cu_seqlens_k must be set");
  }
  if (a.paged.page_size < 0) return Invalid("paged.page_size must be >= 0");
  if (paged && (a.paged.num_pages < 1 || !a.paged.page_indptr || !a.paged.page_indices ||
                !a.paged.seqlens_k)) {
    return Invalid("paged: num_pages must be >= 1 and page_indptr, page_indices, seqlens_k set");
  }
  if (Appends(a.paged)) {
    if (!paged || !a.paged.append_k || !a.paged.append_v) {
      return Invalid("paged.append_k and paged.append_v must be set together, on paged k and v");
    }
    if (IsFp8Kv(a)) return Invalid("paged.append_k and append_v need 16-bit k and v, not float8_e4m3");
  }
  return CheckAlignment(a);
}

Status ValidatePageTable(const AttentionArgs& a) {
  const PagedKv& p = a.paged;
  if (p.page_indptr[0] != 0) return Invalid("paged.page_indptr[0] must be 0");
  for (int32_t b = 0; b < a.batch; ++b) {
    const int64_t len = p.seqlens_k[b];
    if (len < 0 || len > a.max_seqlen_k) {
      return Invalid("paged.seqlens_k[" + std::to_string(b) + "] = " + std::to_string(len) +
                     " is outside [0, max_seqlen_k = " + std::to_string(a.max_seqlen_k) + "]");
    }
    if (Appends(p) && len < a.cu_seqlens_q[b + 1] - a.cu_seqlens_q[b]) {
      return Invalid("paged: sequence " + std::to_string(b) + " appends more rows than its " +
                     std::to_string(len) + " keys");
    }
    const int64_t pages = static_cast<int64_t>(p.page_indptr[b + 1]) - p.page_indptr[b];
    if (pages != (len + p.page_size - 1) / p.page_size) {
      return Invalid("paged: sequence " + std::to_string(b) + " has " + std::to_string(pages) +
                     " pages for " + std::to_string(len) + " keys of page_size " +
                     std::to_string(p.page_size));
    }
    for (int32_t i = p.page_indptr[b]; i < p.page_indptr[b + 1]; ++i) {
      if (p.page_indices[i] < 0 || p.page_indices[i] >= p.num_pages) {
        return Invalid("paged.page_indices[" + std::to_string(i) + "] = " +
                       std::to_string(p.page_indices[i]) + " is outside [0, num_pages = " +
                       std::to_string(p.num_pages) + ")");
      }
    }
  }
  return Status::Ok();
}

Status ValidateKvScales(const AttentionArgs& a) {
  if (!IsFp8Kv(a)) return Status::Ok();
  const int64_t n = int64_t(a.batch) * a.num_kv_heads;
  for (const auto& [scales, name] : {std::pair{a.kv_scales.k, "kv_scales.k"},
                                     std::pair{a.kv_scales.v, "kv_scales.v"}}) {
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(scales[i]) || scales[i] <= 0.0f) {
        return Invalid(std::string(name) + "[" + std::to_string(i) + "] = " +
                       std::to_string(scales[i]) + " (sequence " +
                       std::to_string(i / a.num_kv_heads) + ", KV head " +
                       std::to_string(i % a.num_kv_heads) + ") must be finite and > 0");
      }
    }
  }
  return Status::Ok();
}

Status ValidateCuSeqlens(const int32_t* cu, int32_t batch, int32_t total, int32_t max_seqlen,
                         const char* name) {
  if (cu[0] != 0) return Invalid(std::string(name) + "[0] must be 0, got " + std::to_string(cu[0]));
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (len < 0) {
      return Invalid(std::string(name) + " must not decrease: " + name + "[" +
                     std::to_string(b + 1) + "] = " + std::to_string(cu[b + 1]) + " < " +
                     std::to_string(cu[b]));
    }
    if (len > max_seqlen) {
      return Invalid(std::string(name) + ": sequence " + std::to_string(b) + " has " +
                     std::to_string(len) + " tokens, more than max_seqlen " +
                     std::to_string(max_seqlen));
    }
  }
  if (cu[batch] != total) {
    return Invalid(std::string(name) + " must end at " + std::to_string(total) + ", got " +
                   std::to_string(cu[batch]));
  }
  return Status::Ok();
}

double AttentionFlops(const AttentionArgs& a, const int32_t* cu_q, const int32_t* cu_k) {
  double pairs = 0;
  for (int32_t b = 0; b < a.batch; ++b) {
    const double keys = IsPaged(a) ? a.paged.seqlens_k[b] : cu_k[b + 1] - cu_k[b];
    pairs += static_cast<double>(cu_q[b + 1] - cu_q[b]) * keys;
  }
  const double f = 4.0 * pairs * a.num_heads * a.head_dim;
  return a.causal ? f / 2 : f;
}

}  // namespace attn::kernels
