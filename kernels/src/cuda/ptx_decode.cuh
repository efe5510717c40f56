// PTX wrappers only the decode kernels use (ptx.cuh has those they share with the forward
// kernels): the programmatic-dependent-launch trigger and the e4m3 (OCP E4M3FN) conversions of the
// FP8 K/V decode kernel.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace attn::kernels::cuda::ptx {

// Programmatic dependent launch: lets the grid launched after this one as its programmatic
// dependent (the decode combine) start once every CTA of this grid has called this or exited; that
// grid still waits for this one's completion and memory (GridDependencyWait) before reading what
// it wrote. A no-op without a dependent. sm_90+.
__device__ __forceinline__ void GridDependencyLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Two e4m3 codes (the low and high byte of `pair`) -> two fp16 (low and high half of the result),
// exactly: every e4m3 value is an fp16 value; codes 0x7F and 0xFF are NaN. One cvt.f16x2.e4m3x2 on
// sm_89+ (cuda_fp8.h emulates it before).
__device__ __forceinline__ uint32_t E4m3x2ToHalf2(uint16_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Bytes 0 and 2 of x to the low half, bytes 1 and 3 to the high half.
__device__ __forceinline__ uint32_t InterleaveBytePairs(uint32_t x) {
  return __byte_perm(x, 0, 0x3120);
}

}  // namespace attn::kernels::cuda::ptx
