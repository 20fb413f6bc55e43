// Built instead of kernels/cuda/ when KVWIRE_CUDA is off, so callers need no #ifdef.
#include "kernels/cuda_backend.h"

namespace kvwire::kernels {

absl::StatusOr<KernelBackendPtr> MakeCudaBackend(int, size_t) {
  return absl::UnimplementedError(
      "this kvwire build has no CUDA backend; rebuild with -DKVWIRE_CUDA=ON on a machine with "
      "the CUDA toolkit");
}

bool CudaDevicePresent() { return false; }

absl::StatusOr<std::string> CudaDeviceName() { return MakeCudaBackend().status(); }
absl::StatusOr<double> CudaCopyBandwidth(size_t) { return MakeCudaBackend().status(); }
absl::StatusOr<double> CudaBf16GemmFlops(int, int, int) { return MakeCudaBackend().status(); }
absl::StatusOr<DecodeMatMulRates> CudaDecodeMatMulRates(int, int, int) {
  return MakeCudaBackend().status();
}

}  // namespace kvwire::kernels
