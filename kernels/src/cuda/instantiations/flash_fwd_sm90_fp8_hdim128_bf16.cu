// FP8 forward kernel (sm_90a), e4m3 q/k/v, o in bf16, head dim 128.
#include "../flash_fwd_sm90_fp8_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunFlashFwdSm90Fp8<__nv_bfloat16, 128>(const FlashParams&, int, int, cudaStream_t);
}  // namespace attn::kernels::cuda
