// fp8_variants' builds of the FP8 forward kernel, head dim 256, o in bf16 (fp8_variant_kernels.h).
#include "fp8_variant_launch.cuh"

namespace attn::kernels::cuda {

template cudaError_t LaunchFp8Variant<256>(const FlashParams&, Fp8Variant, int, cudaStream_t);
template cudaError_t ResetFp8PhaseClocks<256>();
template cudaError_t ReadFp8PhaseClocks<256>(uint64_t (&)[kFp8PhaseSlots]);
template cudaError_t ReadFp8Timeline<256>(uint32_t (&)[kFp8TraceRoles][kFp8TraceMarks][2]);

}  // namespace attn::kernels::cuda
