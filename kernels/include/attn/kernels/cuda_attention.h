// CUDA backend of attention forward, fp16 and bf16, contiguous or paged K/V (PagedKv in
// attention.h). A plan (MakePlan) picks one of two kernel families and how to launch it, from
// host-known values only (batch, heads, head dim, max lengths, mask, paged or not, the device's SM
// count); Run launches what the plan says. The plan of one batch shape serves every launch of it.
//  - decode (max_seqlen_q <= 16 queries per sequence): a split-KV ("flash-decoding") kernel. One
//    CTA computes all the query heads of one KV head (GQA packed as rows of mma.sync m16n8k16
//    tiles), so each K/V byte is read once per group; where the batch leaves SMs idle the keys of
//    each sequence are split over enough CTAs to fill every CTA slot of the GPU (batch-1 decode
//    included), and a combine kernel, launched as a programmatic dependent (sm_90), merges the
//    splits by their LSE (or, with PlanOptions::decode_fused_combine, the last CTA of each group
//    of splits does). The fp32 partials live in the caller's workspace
//    (Plan::workspace_bytes). FP8 K/V (AttentionArgs::kv_dtype float8_e4m3, head dims 64, 128 and
//    256) runs a kernel of the same structure that converts the e4m3 codes to fp16 in registers
//    (the k scale folded into the softmax scale, the v scale into the normalisation).
//  - forward (everything else): one fused FlashAttention kernel in two generations:
//    generation 2 (sm_90a: wgmma, TMA, warp specialisation) on compute capability 9.0 devices where
//    CanImplementGen2 holds (head dims 64/128/256 compiled for 90a; contiguous K/V, and paged K/V
//    with pages of a multiple of 8 tokens when forced: see MakePlan); generation 1
//    (FlashAttention-2 class: mma.sync m16n8k16, ldmatrix, cp.async pipeline) everywhere else,
//    reading K/V through the page table when paged (chunked prefill over a cached prefix).
//    FP8 K/V (contiguous or paged) with more than 16 queries per sequence runs here too, in two
//    steps on the caller's stream: a conversion kernel writes the e4m3 codes times their scales
//    (KvScales), rounded once to dtype, as contiguous K/V rows into the workspace (paged K/V
//    gathered through the page table, so that the contiguous kernels run), then the forward
//    kernel above runs on those 16-bit rows. It computes in 16 bits like the fp16/bf16 path (no
//    FP8 tensor-core math), so its speed is that of the 16-bit forward plus the conversion.
//    All-FP8 attention (q too): DequantizeFp8Q converts q first.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attn/kernels/attention.h"

namespace attn::kernels::cuda {

// True when this build carries CUDA kernels (the library was compiled with nvcc).
bool Compiled();

// OK when a kernel of this build can run args: dtype fp16/bf16, a compiled head dim, sizes in
// range (paged: num_pages * page_size < 2^31); FP8 K/V with at most 16 queries per sequence (the
// FP8 decode kernel): head dim 64, 128 or 256 on a compute capability 9.0 device; with more (the
// forward path): any compiled head dim, and batch * max_seqlen_k < 2^31 when paged. Does not read
// cu_seqlens, page tables or FP8 scales (device memory);
// callers validate them on the host first (ValidateCuSeqlens, ValidatePageTable, ValidateKvScales).
Status CanImplement(const AttentionArgs& args);

// Which kernel Run uses. kAuto: the decode kernel for decode shapes, else generation 2 where
// CanImplementGen2 holds (contiguous or paged K/V), else generation 1. kGen1 / kGen2 force that
// forward kernel for every shape (tests and benchmarks compare the two on the same arguments).
enum class FwdGeneration : uint8_t { kAuto = 0, kGen1 = 1, kGen2 = 2 };

// Choices a plan would otherwise make by its own rules: benchmarks and tests set them to compare the
// alternatives on the same arguments. The defaults are the rules.
struct PlanOptions {
  FwdGeneration generation = FwdGeneration::kAuto;
  int decode_splits = 0;  // decode kernels: > 0 forces that many KV splits (at most 64)
  // Decode kernels with splits: the split kernel's last CTA of each (sequence, KV head, row block)
  // merges the splits, on counters at the workspace's start that the caller keeps zeroed
  // (Plan::decode_counter_bytes), instead of a combine kernel launched after it: one launch less.
  bool decode_fused_combine = false;
  // Generation 2:
  int gen2_tiling = 0;          // 0 its estimate; 1 wide; 2 narrow; 3 narrow for causal <= 1k queries
  int gen2_row_cut = -1;        // -1 its rule; 0 plain, 1 narrow tail, 2 short head (3-warpgroup tilings)
  int gen2_l2_group_mib = -1;   // -1 its rule; 0 one group of all pairs; N: groups of K/V <= N MiB
  int gen2_l2_phases = -1;      // -1 its rule; 0 off; 1 on (under the tile counter)
  bool gen2_tile_counter = true;  // false: no tile counter (the fixed tile order; no workspace)
  bool gen2_dynamic = true;       // false: the fixed tile order even with the counter
  bool gen2_tma_store_o = true;   // false: O stored from registers
  // FP8 K/V (contiguous or paged) with 16-bit q on a forward shape: q quantized to e4m3 on the
  // device (one scale per (sequence, KV head), amax / 448) and the FP8 tensor-core kernel
  // (RunFp8Attention's), where it serves the launch (CanImplementFp8TensorCores); false, or where
  // it does not: the conversion to 16 bits. Adds q's and P's e4m3 rounding to the result.
  bool fp8_tensor_cores = false;
  // The FP8 tensor-core kernel's query tile rows: 0 its rule (at head dim 128, 192 unless 128-row
  // tiles finish the launch sooner, counted in rounds of the GPU's SMs; else 128); 128; 192 (head
  // dim 128).
  int fp8_tile_rows = 0;
};

// What Run launches for one batch shape (MakePlan). Plain values; valid for the device it was made
// on.
struct Plan {
  // kFp8TensorCores: FP8 K/V with 16-bit q, q quantized on the device (PlanOptions).
  enum class Kernel : uint8_t { kDecode, kGen1, kGen2, kFp8TensorCores };
  Kernel kernel = Kernel::kGen1;
  bool paged = false;
  // Device scratch Run needs, in bytes: the decode kernel's split-KV partials (splits * total_q *
  // num_heads * (head_dim + 1) floats; 0 without splits), or 16 for generation 2's tile counter
  // where its plan takes tiles from one (gen2_tile_counter); else 0. FP8 K/V on a forward kernel
  // (fp8_dequant): that kernel's own scratch plus the converted K and V (2 * fp8_kv_rows *
  // num_kv_heads * head_dim 16-bit values) and, paged, the sequences' row offsets. Pass Run a buffer of at least
  // this size, 256-byte aligned, used by one launch at a time (launches on one stream may share
  // it).
  size_t workspace_bytes = 0;
  // Decode kernel: row blocks of 16 packed (query, head) rows, KV splits, and whether the combine
  // kernel is a programmatic dependent launch (sm_90+).
  int decode_m_blocks = 1;
  int decode_splits = 1;
  bool decode_pdl = false;
  // PlanOptions::decode_fused_combine where the plan splits: the workspace's first
  // decode_counter_bytes are counters that must be zero when Run is called, and Run's launch
  // leaves them zero when it completes: a workspace kept for one stream's launches needs zeroing
  // only when it is allocated and after a launch of another plan that wrote there.
  bool decode_fused_combine = false;
  size_t decode_counter_bytes = 0;
  // Generation 2: the tiling, the row cut, L2 groups and phases of the cost order, tiles from the
  // workspace's counter, O through TMA stores, and the SM count of the persistent grid.
  bool gen2_narrow = false;
  int gen2_row_cut = 0;
  int gen2_l2_group_pairs = 1;
  bool gen2_l2_phases = false;
  bool gen2_tile_counter = false;
  bool gen2_tma_store_o = true;
  int gen2_sms = 0;
  // FP8 K/V on a forward kernel (kGen1 or kGen2 above, planned for the 16-bit K/V): Run first
  // converts K and V into the workspace, fp8_kv_rows rows each (total_k; paged: batch *
  // max_seqlen_k, a host-known bound on the sum of seqlens_k, the rows past the sum zeroed), behind
  // the forward kernel's own fp8_inner_workspace_bytes.
  bool fp8_dequant = false;
  int64_t fp8_kv_rows = 0;
  size_t fp8_inner_workspace_bytes = 0;
  // kFp8TensorCores: the kernel's query tile rows (PlanOptions::fp8_tile_rows).
  int fp8_tile_rows = 0;
};

// The plan for args (CanImplement must hold; a forced generation 2 needs CanImplementGen2). Reads
// no device memory (cu_seqlens and page tables are not looked at). Run's own choice (kAuto) takes
// generation 2 wherever CanImplementGen2 holds, paged or not (kGen1 forces generation 1).
Status MakePlan(const AttentionArgs& args, const PlanOptions& options, Plan* plan);

// Enqueues the computation of args as plan says (plan from MakePlan for args' shape: the same
// batch, heads, head dim, max lengths, mask and layout). Never allocates, never synchronizes and
// never reads device memory from the host; returns the launch error, if any
// (cudaErrorInvalidValue when CanImplement fails or a needed workspace is null). Generation 2
// without a workspace keeps its fixed tile order.
cudaError_t Run(const AttentionArgs& args, const Plan& plan, void* workspace, cudaStream_t stream);

// The plan's workspace for args under the default options (MakePlan); 0 when CanImplement fails.
size_t WorkspaceBytes(const AttentionArgs& args);

// True when the default plan sends args to the decode kernel (max_seqlen_q <= 16).
bool UsesDecodeKernel(const AttentionArgs& args);

// MakePlan with the default options, then Run: all pointers in args and workspace are device
// pointers.
cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream);

// OK when the generation-2 forward kernel can run args on the current device: CanImplement
// holds, the device has compute capability 9.0, the build compiled the kernel for this head dim
// (ATTN_CUDA_ARCHS lists 90a), q, k and v are 16-byte aligned, and paged K/V has pages of a
// multiple of 8 tokens. FP8 K/V: on the contiguous 16-bit K/V they are converted to.
Status CanImplementGen2(const AttentionArgs& args);

// As Run above, with the kernel chosen by gen (PlanOptions::generation); cudaErrorInvalidValue when
// a forced generation cannot run args (CanImplementGen2 for kGen2), and for FP8 K/V on a decode
// shape (a forced forward needs more workspace than WorkspaceBytes: use MakePlan). A forced generation 2 on a
// decode shape uses the tile counter only when WorkspaceBytes(args) covers it (the caller sized
// the workspace for the default plan).
cudaError_t Run(const AttentionArgs& args, void* workspace, cudaStream_t stream, FwdGeneration gen);

// All-FP8 attention's first step: writes q_out [total_q, num_heads, head_dim] in args.dtype (fp16
// or bf16) as E4M3(q_codes) * q_scales[b * num_kv_heads + h / (num_heads / num_kv_heads)] for query
// head h of a row of sequence b (args.cu_seqlens_q, device), rounded once; then Run args with
// args.q = q_out and FP8 K/V computes (q_scale q) . (k_scale k) as the CPU backend does. Device
// pointers; enqueued on stream, no allocation; cudaErrorInvalidValue for arguments it cannot take.
cudaError_t DequantizeFp8Q(const AttentionArgs& args, const void* q_codes, const float* q_scales,
                           void* q_out, cudaStream_t stream);

// All-FP8 attention on FP8 tensor cores: both products in e4m3 on wgmma (sm_90a; head dims 128
// and 256 compiled for 90a; contiguous K/V). args as for DequantizeFp8Q followed by Run, except
// that args.q holds q's e4m3 codes; q_scales [batch, num_kv_heads] as there (device; finite and
// > 0, as the kv_scales: the caller validates them, ValidateKvScales-style). P is rounded
// to e4m3 for the P V product (after a scaling by 2^8 that the normalisation takes back), as FP8
// attention kernels do: the result carries that rounding on top of the inputs' (docs/FP8.md).
// V is first transposed into the workspace (Fp8AttentionWorkspaceBytes: about num_kv_heads *
// head_dim * (total_k + 128 * (batch + 1)) bytes, 256-byte aligned), then the kernel runs; both
// on stream, no allocation.
Status CanImplementFp8Attention(const AttentionArgs& args);
// Whether a plan with PlanOptions::fp8_tensor_cores runs args (FP8 K/V, contiguous or paged, 16-bit
// q, more than 16 queries per sequence) on the FP8 tensor-core kernel: head dims 128 and 256 on a
// compute capability 9.0 device, q, k and v 16-byte aligned.
Status CanImplementFp8TensorCores(const AttentionArgs& args);
size_t Fp8AttentionWorkspaceBytes(const AttentionArgs& args);
cudaError_t RunFp8Attention(const AttentionArgs& args, const float* q_scales, void* workspace,
                            cudaStream_t stream);
// The query tile rows RunFp8Attention takes for args on the current device (0 without one).
int Fp8AttentionTileRows(const AttentionArgs& args);
// How the FP8 tensor-core kernel of head_dim on tile_rows-row query tiles (Plan::fp8_tile_rows,
// Fp8AttentionTileRows) scales and sums P (docs/FP8.md), which decides P's rounding to e4m3.
struct Fp8SoftmaxRule {
  // Each row's P is summed after its rounding: LSE is then the log of the sum of the weights O is
  // normalised by, which differs from the sum of the unrounded p by up to an e4m3 step (1/16
  // relative) on rows whose weight sits on a few keys.
  bool sums_rounded_p = false;
  // > 0: the 16 rows of a warp (query rows 16i.. of the sequence) keep the max their P is scaled to
  // until one of them grows past it by more than lazy_rescale_eighths / 8 (log2 units), so P
  // reaches 2^(lazy_rescale_eighths / 8) of the row's max weight before its rounding; a warp
  // holding rows past the sequence's end rescales on every key tile.
  int lazy_rescale_eighths = 0;
};
Fp8SoftmaxRule Fp8TensorCoreSoftmaxRule(int head_dim, int tile_rows);

// Head dims compiled into this build, ascending; count written to *n.
const int* CompiledHeadDims(int* n);

}  // namespace attn::kernels::cuda
