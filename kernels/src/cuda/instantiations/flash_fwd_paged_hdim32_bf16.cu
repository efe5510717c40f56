// One explicit instantiation: flash forward over paged K/V, head dim 32, bf16.
#include "../flash_fwd_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunFlashFwdPaged<__nv_bfloat16, 32>(const FlashParams&, cudaStream_t);
}  // namespace attn::kernels::cuda
