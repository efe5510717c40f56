// sm90_variants' builds of the sm_90a kernel, head dim 256, bf16 (see variant_kernels.h).
#include "variant_launch.cuh"

namespace attn::kernels::cuda {

template cudaError_t LaunchVariantSm90<256>(const FlashParams&, Sm90Variant, bool, int, cudaStream_t);

}  // namespace attn::kernels::cuda
