// Makes this process's CUDA context unusable, as a faulting kernel would: a write through an
// invalid address, which leaves a sticky error that every later CUDA call returns.
#pragma once

#include <cuda_runtime_api.h>

namespace attn::testing {

// The error the faulting kernel left (cudaErrorIllegalAddress on current GPUs).
cudaError_t BreakTheCudaContext();

}  // namespace attn::testing
