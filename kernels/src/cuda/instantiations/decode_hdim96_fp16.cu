// One explicit instantiation: split-KV decode (contiguous and paged K/V) + combine, head dim 96, fp16.
#include "../decode_launch.cuh"

namespace attn::kernels::cuda {
template cudaError_t RunDecode<__half, 96>(const DecodeParams&, bool, cudaStream_t);
}  // namespace attn::kernels::cuda
