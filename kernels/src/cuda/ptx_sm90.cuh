// PTX wrappers of the sm_90a forward kernel: wgmma shared-memory descriptors and group control,
// register reallocation, named barriers, and the TMA/mbarrier calls (through CCCL's cuda::ptx).
// The wgmma instructions themselves are in wgmma_ops.cuh (one function per shape).
#pragma once

#include <cuda/ptx>

#include <cstdint>
#if defined(ATTN_SM90_HANG_TRAP)
#include <cstdio>
#endif

#include "wgmma_ops.cuh"

namespace attn::kernels::cuda::ptx {

namespace cp = ::cuda::ptx;

// Descriptor of a shared-memory operand stored as 128-byte-swizzled rows (what a TMA box with
// CU_TENSOR_MAP_SWIZZLE_128B and a 64-element inner box writes), tiles aligned to 1024 bytes.
//   K-major (Q, K): rows of 64 elements along K; 8-row groups 1024 B apart (SBO); the leading
//     offset is unused. A K step of 16 elements is +32 B inside the 128-byte row.
//   MN-major (V as the B of P V): rows are keys (the K of that product), 64 head-dim elements
//     each; lbo = bytes between 64-wide head-dim slabs, SBO = 8 keys = 1024 B. A K step of 16 keys
//     is +2048 B.
__device__ __forceinline__ uint64_t SmemDesc(uint32_t addr, uint32_t lbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma
// issue/wait point (reordering them would serialise the asynchronous products).
template <int N>
__device__ __forceinline__ void RegFence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int kRegs>
__device__ __forceinline__ void SetMaxNRegInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxNRegDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Barrier `id` among `threads` threads (a multiple of 32); id 0 is __syncthreads'.
__device__ __forceinline__ void NamedBarSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on barrier `id` without waiting (the producer side of a bar.sync elsewhere).
__device__ __forceinline__ void NamedBarArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) { cp::mbarrier_init(bar, count); }

// Publishes mbarrier initialisation to the async proxy (TMA) before first use.
__device__ __forceinline__ void FenceMbarInit() { cp::fence_mbarrier_init(cp::sem_release, cp::scope_cluster); }

__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  cp::mbarrier_arrive_expect_tx(cp::sem_release, cp::scope_cta, cp::space_shared, bar, bytes);
}

// Adds transaction bytes to the current phase without arriving (the arrival comes later).
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  cp::mbarrier_expect_tx(cp::sem_relaxed, cp::scope_cta, cp::space_shared, bar, bytes);
}

__device__ __forceinline__ void MbarArrive(uint64_t* bar) { cp::mbarrier_arrive(bar); }

// Blocks until the phase of `bar` with the given parity has completed.
//
// Builds with ATTN_SM90_HANG_TRAP (CMake option of the same name; a debugging build, never the
// shipped one) give up after about 2^32 clock cycles (2 s at the H200's clocks; a launch's
// longest legitimate wait is microseconds): the thread prints which barrier of which CTA it
// waited on, and traps, so that a protocol error ends the launch with an error (the process gets
// cudaErrorLaunchFailure) instead of hanging the GPU.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
#if defined(ATTN_SM90_HANG_TRAP)
  const long long start = clock64();
  while (!cp::mbarrier_try_wait_parity(bar, parity)) {
    if (clock64() - start > (1ll << 32)) {
      printf("MbarWait: no completion: block %d thread %d, barrier at shared 0x%x, parity %u\n",
             int(blockIdx.x), int(threadIdx.x),
             unsigned(__cvta_generic_to_shared(bar)), unsigned(parity));
      __trap();
    }
  }
#else
  while (!cp::mbarrier_try_wait_parity(bar, parity)) {
  }
#endif
}

// 4-D tiled TMA load into shared memory, completing on `bar` (transaction bytes).
__device__ __forceinline__ void TmaLoad4d(void* dst, const void* tmap, int c0, int c1, int c2, int c3,
                                          uint64_t* bar) {
  const int32_t coords[4] = {c0, c1, c2, c3};
  cp::cp_async_bulk_tensor(cp::space_cluster, cp::space_global, dst, tmap, coords, bar);
}

// 3-D tiled TMA load into shared memory, completing on `bar` (transaction bytes).
__device__ __forceinline__ void TmaLoad3d(void* dst, const void* tmap, int c0, int c1, int c2, uint64_t* bar) {
  const int32_t coords[3] = {c0, c1, c2};
  cp::cp_async_bulk_tensor(cp::space_cluster, cp::space_global, dst, tmap, coords, bar);
}

// 4-D tiled TMA store from shared memory (bulk-group completion), then the group calls around it.
__device__ __forceinline__ void TmaStore4d(const void* tmap, const void* src, int c0, int c1, int c2, int c3) {
  const int32_t coords[4] = {c0, c1, c2, c3};
  cp::cp_async_bulk_tensor(cp::space_global, cp::space_shared, tmap, coords, src);
}
__device__ __forceinline__ void BulkCommit() { cp::cp_async_bulk_commit_group(); }
// Waits until the committed bulk stores have read their shared memory (it may be reused).
__device__ __forceinline__ void BulkWaitRead() { cp::cp_async_bulk_wait_group_read(cp::n32_t<0>{}); }
// Waits until the committed bulk stores are complete.
__device__ __forceinline__ void BulkWait() { cp::cp_async_bulk_wait_group(cp::n32_t<0>{}); }

// Makes this thread's ordinary shared-memory writes visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void FenceProxyAsyncShared() { cp::fence_proxy_async(cp::space_shared); }

}  // namespace attn::kernels::cuda::ptx
