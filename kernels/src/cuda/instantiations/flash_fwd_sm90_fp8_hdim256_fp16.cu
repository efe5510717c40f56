// FP8 forward kernel (sm_90a), e4m3 q/k/v, o in fp16, head dim 256.
#include "../flash_fwd_sm90_fp8_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunFlashFwdSm90Fp8<__half, 256>(const FlashParams&, int, int, cudaStream_t);
}  // namespace attn::kernels::cuda
