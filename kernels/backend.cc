#include "kernels/backend.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda_backend.h"
#include "kernels/guarded_backend.h"
#include "kernels/reference.h"

namespace kvwire::kernels {

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

absl::StatusOr<std::string> KernelBackend::ExportMemory(void*, size_t) {
  return absl::UnimplementedError(absl::StrCat(
      "the ", BackendName(kind()),
      " backend's memory is this process's host memory; only a device backend (cuda) exports "
      "memory to another process"));
}

absl::StatusOr<void*> KernelBackend::ImportMemory(const std::string&, size_t) {
  return absl::UnimplementedError(absl::StrCat(
      "the ", BackendName(kind()),
      " backend cannot map another process's device memory; only a device backend (cuda) can"));
}

absl::StatusOr<std::unique_ptr<PeerLink>> KernelBackend::OpenLink(std::string*) {
  return absl::UnimplementedError(absl::StrCat(
      "the ", BackendName(kind()),
      " backend has no link to another node's memory; only a device backend (cuda, with NCCL) "
      "has"));
}

absl::Status KernelBackend::BeginGraph(int64_t) {
  return absl::UnimplementedError(absl::StrCat(
      "the ", BackendName(kind()),
      " backend runs each op as it is called; only a device backend (cuda; guarded, which "
      "emulates it) records a step as a graph"));
}

absl::Status KernelBackend::EndGraph() { return BeginGraph(0); }

absl::StatusOr<std::unique_ptr<PeerLink>> KernelBackend::JoinLink(const std::string& offer) {
  std::string unused;
  return OpenLink(&unused).status();
}

}  // namespace kvwire::kernels
