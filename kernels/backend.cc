#include "kernels/backend.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda_backend.h"
#include "kernels/guarded_backend.h"
#include "kernels/reference.h"

namespace kvwire::kernels {

absl::string_view BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kReference:
      return "reference";
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
    case BackendKind::kGuarded:
      return "guarded";
  }
  return "?";
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "reference") return BackendKind::kReference;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  if (name == "guarded") return BackendKind::kGuarded;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", name, "'; expected reference, cpu, cuda or guarded"));
}

absl::StatusOr<KernelBackendPtr> MakeBackend(BackendKind kind, int threads) {
  switch (kind) {
    case BackendKind::kReference:
      return MakeReferenceBackend();
    case BackendKind::kCpu:
      return MakeCpuBackend(threads);
    case BackendKind::kCuda:
      return MakeCudaBackend(threads);
    case BackendKind::kGuarded:
      return MakeGuardedBackend(threads);
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

bool CudaAvailable() { return CudaDevicePresent(); }

}  // namespace kvwire::kernels
