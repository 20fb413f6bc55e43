// The guarded backend: the CPU backend's kernels run as a device runs its kernels, so that the
// engine's device path is tested on every machine.
//
//   - Its memory is unreadable by the host (mapped PROT_NONE) except while its queued work
//     runs: code that reads or writes backend memory directly, instead of through
//     CopyToDevice / CopyToHost, dies with SIGSEGV at the offending access.
//   - Ops and copies are queued, as on a stream, and run at the next synchronisation point
//     (Synchronize, CopyToHost, Free): a missing synchronisation shows as stale data. Each
//     thread has a queue of its own, as each thread's lane has its own stream on CUDA: a
//     thread's synchronisation runs its own work only (Free, as cudaFree, everyone's), so work
//     one thread queued and another reads is stale unless the first waited for it.
//   - Every buffer ends at a page that is never readable, and every op checks that each range
//     it reads or writes lies within one of its buffers: a host pointer or an overrun is an
//     InvalidArgument naming the parameter.
//   - A capacity (bytes; 0 for none) makes the out-of-memory paths testable.
// It reports itself as not host-addressable, so the engine takes its device path (weights
// uploaded, activations and KV caches in backend memory). For tests and debugging: each
// synchronisation costs two mprotect calls per live buffer.
#pragma once

#include <cstddef>

#include "kernels/backend.h"

namespace kvwire::kernels {

KernelBackendPtr MakeGuardedBackend(int threads, size_t capacity = 0);

// For tests: the next EndGraph on `backend` (a guarded backend; others are left as they are)
// fails having run nothing, as a graph CUDA could not instantiate would.
void FailNextGraphForTest(KernelBackend& backend);

}  // namespace kvwire::kernels
