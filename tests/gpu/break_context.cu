#include "break_context.h"

namespace attn::testing {
namespace {

__global__ void WriteThroughBadPointer(int* p) { *p = 1; }

}  // namespace

cudaError_t BreakTheCudaContext() {
  WriteThroughBadPointer<<<1, 1>>>(reinterpret_cast<int*>(0x10));
  return cudaDeviceSynchronize();
}

}  // namespace attn::testing
