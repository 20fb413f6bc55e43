#pragma once

#include "kernels/backend.h"

namespace kvwire::kernels {

// The optimised CPU backend (see cpu_backend.cc) with `threads` threads, 0 for all cores.
KernelBackendPtr MakeCpuBackend(int threads);

}  // namespace kvwire::kernels
