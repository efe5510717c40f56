#include "backends/cuda_util.h"

#include <thread>

namespace attn {

absl::Status CreateLaneStream(cudaStream_t* stream, cudaEvent_t (&events)[4]) {
  RETURN_IF_CUDA_ERROR("cudaStreamCreate", cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
  for (cudaEvent_t& e : events) {
    const unsigned flags = &e == &events[3] ? cudaEventBlockingSync : cudaEventDefault;
    RETURN_IF_CUDA_ERROR("cudaEventCreate", cudaEventCreateWithFlags(&e, flags));
  }
  return absl::OkStatus();
}

void DestroyLaneStream(cudaStream_t stream, cudaEvent_t (&events)[4]) {
  for (cudaEvent_t e : events) {
    if (e) cudaEventDestroy(e);
  }
  if (stream) cudaStreamDestroy(stream);
}

bool IsStickyCudaError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

cudaError_t PollEvent(cudaEvent_t event, double sleep_us, std::chrono::microseconds poll_for) {
  if (sleep_us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(sleep_us)));
  }
  const auto until = std::chrono::steady_clock::now() + poll_for;
  cudaError_t e;
  while ((e = cudaEventQuery(event)) == cudaErrorNotReady &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
  return e == cudaErrorNotReady ? cudaEventSynchronize(event) : e;
}

}  // namespace attn
