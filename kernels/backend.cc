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

absl::StatusOr<KernelBackendPtr> MakeBackend(BackendKind kind, int threads, size_t memory_limit) {
  if (memory_limit > 0 && (kind == BackendKind::kReference || kind == BackendKind::kCpu)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a memory limit applies to the device backends (cuda, guarded), not ",
                     BackendName(kind), ", whose memory is the host's"));
  }
  switch (kind) {
    case BackendKind::kReference:
      return MakeReferenceBackend();
    case BackendKind::kCpu:
      return MakeCpuBackend(threads);
    case BackendKind::kCuda:
      return MakeCudaBackend(threads, memory_limit);
    case BackendKind::kGuarded:
      return MakeGuardedBackend(threads, memory_limit);
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

bool CudaAvailable() { return CudaDevicePresent(); }

}  // namespace kvwire::kernels
