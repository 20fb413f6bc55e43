// The guarded backend: the CPU backend's kernels on memory that the host cannot touch between
// ops. Every buffer it allocates is mapped PROT_NONE except while one of its ops (or copies)
// runs, so code that reads or writes backend memory directly, instead of through
// CopyToDevice / CopyToHost, dies with SIGSEGV at the offending access. It reports itself as
// not host-addressable, so the engine takes its device path (weights uploaded, activations and
// KV caches in backend memory), which a machine without a GPU then runs and tests against the
// CPU engine. Ops are serialised by a mutex, as one CUDA stream serialises them. For tests and
// debugging: every op costs two mprotect calls per live buffer.
#pragma once

#include "kernels/backend.h"

namespace kvwire::kernels {

KernelBackendPtr MakeGuardedBackend(int threads);

}  // namespace kvwire::kernels
