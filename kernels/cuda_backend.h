// The CUDA backend. Declared in every build; defined in kernels/cuda/ when the build has
// CUDA (KVWIRE_CUDA), and as a stub that reports UnimplementedError otherwise.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvwire::kernels {

// `threads` host threads for the host work between ops (0: all hardware threads);
// `memory_limit` caps what it allocates (bytes; 0: the device's memory).
absl::StatusOr<KernelBackendPtr> MakeCudaBackend(int threads = 0, size_t memory_limit = 0);
bool CudaDevicePresent();

// The device's ceilings, for benchmarks that set a measurement against them in the same run:
// a device-to-device copy of `bytes` (bytes read plus bytes written per second), and cuBLAS's
// bf16 GEMM with float32 accumulation (FLOP/s, 2·m·n·k per product).
absl::StatusOr<std::string> CudaDeviceName();
absl::StatusOr<double> CudaCopyBandwidth(size_t bytes);
absl::StatusOr<double> CudaBf16GemmFlops(int m, int n, int k);
// MatMul of m ≤ 16 rows of x against bf16 W [n, k], as a decode step's projections: bytes of W
// read per second through kvwire's GEMV and through cuBLAS (x rounded to bf16, then
// cublasGemmEx), each the median of timed calls, side by side.
struct DecodeMatMulRates {
  double gemv = 0, cublas = 0;
};
absl::StatusOr<DecodeMatMulRates> CudaDecodeMatMulRates(int m, int n, int k);

}  // namespace kvwire::kernels
