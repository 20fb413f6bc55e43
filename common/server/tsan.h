// ThreadSanitizer annotations for the handoffs gRPC makes between threads. gRPC promises
// that an operation started on one thread (StartCall, StartRead, StartWrite, Finish)
// happens before the callback that reports it runs on another, but it keeps that promise
// inside Debian's libgrpc, which TSan does not see (scripts/sanitize.sh): a reactor
// releases itself before it starts an operation and acquires itself when a callback
// begins, which tells TSan exactly that promise and nothing more. Empty in other builds.
#pragma once

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVWIRE_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KVWIRE_TSAN 1
#endif

#ifdef KVWIRE_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace kvwire {

// Before starting a gRPC operation on `reactor`.
inline void HandOffToGrpc(const void* reactor) {
#ifdef KVWIRE_TSAN
  __tsan_release(const_cast<void*>(reactor));
#endif
}

// First thing in a gRPC callback of `reactor`.
inline void TakeBackFromGrpc(const void* reactor) {
#ifdef KVWIRE_TSAN
  __tsan_acquire(const_cast<void*>(reactor));
#endif
}

}  // namespace kvwire
