// The CUDA backend. Declared in every build; defined in kernels/cuda/ when the build has
// CUDA (KVWIRE_CUDA), and as a stub that reports UnimplementedError otherwise.
#pragma once

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvwire::kernels {

absl::StatusOr<KernelBackendPtr> MakeCudaBackend();
bool CudaDevicePresent();

}  // namespace kvwire::kernels
