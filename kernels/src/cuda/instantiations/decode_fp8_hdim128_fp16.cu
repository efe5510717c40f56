// One explicit instantiation: split-KV decode over FP8 (e4m3) K/V, contiguous and paged, + combine,
// head dim 128, q and o fp16.
#include "../decode_fp8_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunDecodeFp8<__half, 128>(const DecodeParams&, bool, cudaStream_t);
}  // namespace attn::kernels::cuda
