// One explicit instantiation: flash forward over paged K/V, head dim 32, fp16.
#include "../flash_fwd_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunFlashFwdPaged<__half, 32>(const FlashParams&, cudaStream_t);
}  // namespace attn::kernels::cuda
