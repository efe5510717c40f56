// FP8 forward kernel (sm_90a), e4m3 q/k/v, o in bf16, head dim 256.
#include "../flash_fwd_sm90_fp8_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunFlashFwdSm90Fp8<__nv_bfloat16, 256>(const FlashParams&, int, int, cudaStream_t);
}  // namespace attn::kernels::cuda
