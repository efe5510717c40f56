// fp8_variants' builds of the FP8 forward kernel, head dim 128, o in bf16 (fp8_variant_kernels.h).
#include "fp8_variant_launch.cuh"

namespace attn::kernels::cuda {

template cudaError_t LaunchFp8Variant<128>(const FlashParams&, Fp8Variant, int, cudaStream_t);
template cudaError_t ResetFp8PhaseClocks<128>();
template cudaError_t ReadFp8PhaseClocks<128>(uint64_t (&)[kFp8PhaseSlots]);
template cudaError_t ReadFp8Timeline<128>(uint32_t (&)[kFp8TraceRoles][kFp8TraceMarks][2]);

}  // namespace attn::kernels::cuda
