// Debian's gRPC is not built with -fsanitize=thread, so TSan cannot see the ordering gRPC
// guarantees between a call into it (registering a service, StartRead, StartWrite, Finish) and
// the callback that follows on another of its threads (a handler, OnReadDone, OnWriteDone,
// OnDone). These mark that ordering on the object handed over, so that TSan checks attnd's own
// accesses across it; they compile to nothing in other builds.
#pragma once

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace attn {

#if defined(__SANITIZE_THREAD__)
inline void HandOffToGrpc(const void* object) { __tsan_release(const_cast<void*>(object)); }
inline void TakeBackFromGrpc(const void* object) { __tsan_acquire(const_cast<void*>(object)); }
#else
inline void HandOffToGrpc(const void*) {}
inline void TakeBackFromGrpc(const void*) {}
#endif

}  // namespace attn
