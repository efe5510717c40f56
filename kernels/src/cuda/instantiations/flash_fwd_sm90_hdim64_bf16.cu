// One explicit instantiation: sm_90a flash forward, head dim 64, bf16.
#include "../flash_fwd_sm90_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunFlashFwdSm90<__nv_bfloat16, 64>(const FlashParams&, cudaStream_t);
}  // namespace attn::kernels::cuda
