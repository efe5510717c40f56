// One explicit instantiation: sm_90a flash forward, head dim 128, fp16.
#include "../flash_fwd_sm90_launch.cuh"

namespace attn::kernels::cuda {
template Sm90Launch PlanFlashFwdSm90<__half, 128>(const FlashParams&, const Sm90Choices&, int);
template cudaError_t RunFlashFwdSm90<__half, 128>(const FlashParams&, const Sm90Launch&, cudaStream_t);
}  // namespace attn::kernels::cuda
