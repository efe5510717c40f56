// Debian's gRPC is not built with -fsanitize=thread, so TSan cannot see the ordering gRPC keeps
// between a call into it (StartRawCall, StartCall, StartRead, StartWrite) and the callback that
// follows on one of its threads. These mark that ordering on the object handed over, so that
// TSan checks the client's own accesses across it; they compile to nothing in other builds.
#pragma once

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace attn::client::internal {

#if defined(__SANITIZE_THREAD__)
inline void HandOffToGrpc(const void* object) { __tsan_release(const_cast<void*>(object)); }
inline void TakeBackFromGrpc(const void* object) { __tsan_acquire(const_cast<void*>(object)); }
#else
inline void HandOffToGrpc(const void*) {}
inline void TakeBackFromGrpc(const void*) {}
#endif

}  // namespace attn::client::internal
