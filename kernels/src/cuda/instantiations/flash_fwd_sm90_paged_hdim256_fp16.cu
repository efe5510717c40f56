// One explicit instantiation: sm_90a flash forward over paged K/V, head dim 256, fp16.
#include "../flash_fwd_sm90_launch.cuh"

namespace attn::kernels::cuda {
template Sm90Launch PlanFlashFwdSm90Paged<__half, 256>(const FlashParams&, const Sm90Choices&, int);
template cudaError_t RunFlashFwdSm90Paged<__half, 256>(const FlashParams&, const Sm90Launch&,
                                                       cudaStream_t);
}  // namespace attn::kernels::cuda
