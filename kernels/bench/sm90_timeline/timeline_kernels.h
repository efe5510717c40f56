// The traced builds of the sm_90a forward kernel that sm90_timeline launches (one translation unit
// per head dim, timeline_kernels_d*.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "flash_params.h"

namespace attn::kernels::cuda {

// Launches the traced kernel (bf16) with the wide or narrow tiling of head dim D; `trace` holds
// TraceEntries(...) entries. Sets *consumer_wgs and *grid to what was launched.
template <int D>
cudaError_t LaunchTracedSm90(const FlashParams& params, bool narrow, int sms, cudaStream_t stream,
                             unsigned long long* trace, int* consumer_wgs, int* block_m);

}  // namespace attn::kernels::cuda
