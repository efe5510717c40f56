// sm90_timeline's builds of the sm_90a kernel, head dim 256, bf16 (see timeline_kernels.h).
#include "timeline_launch.cuh"

namespace attn::kernels::cuda {

template cudaError_t LaunchTracedSm90<256>(const FlashParams&, bool, int, cudaStream_t, unsigned long long*,
                                           Sm90TracedShape*);
template cudaError_t LaunchVariantSm90<256>(const FlashParams&, Sm90Variant, bool, int, cudaStream_t);

}  // namespace attn::kernels::cuda
