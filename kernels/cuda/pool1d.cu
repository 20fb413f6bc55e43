/* Pool1d and RunMeans (kernels/selection.h): a thread per output element, reading its window
 * (or run) in order as the reference does. SnapKV++'s kernels of 63 and 511 columns reread
 * each input that many times, from L1 and L2: the votes of a layer are a few MB at most. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

__global__ void Pool1dKernel(Pool1dParams p) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= p.n) return;
  const float* x = p.x + static_cast<int64_t>(blockIdx.y) * p.n;
  float* y = p.y + static_cast<int64_t>(blockIdx.y) * p.n;
  if (p.kernel == 1) {
    y[j] = x[j];
    return;
  }
  const int half = p.kernel / 2;
  const int64_t lo = j - half > 0 ? j - half : 0;
  const int64_t hi = j + half < p.n - 1 ? j + half : p.n - 1;
  if (p.kind == PoolKind::kMax) {
    float m = -INFINITY;
    for (int64_t i = lo; i <= hi; ++i) m = m < x[i] ? x[i] : m;  // std::max(m, x[i])
    y[j] = m;
  } else {
    float s = 0.f;
    for (int64_t i = lo; i <= hi; ++i) s += x[i];
    y[j] = s / static_cast<float>(p.kernel);
  }
}

__global__ void RunMeansKernel(RunMeansParams p, int runs) {
  const int64_t m = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (m >= runs) return;
  const float* x = p.x + static_cast<int64_t>(blockIdx.y) * p.n;
  const int64_t lo = m * p.run, hi = lo + p.run < p.n ? lo + p.run : p.n;
  float s = 0.f;
  for (int64_t j = lo; j < hi; ++j) s += x[j];
  p.y[static_cast<int64_t>(blockIdx.y) * runs + m] = s / static_cast<float>(hi - lo);
}

}  // namespace

absl::Status LaunchPool1d(const Pool1dParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidatePool1d(p));
  if (p.rows > 65535) return absl::InvalidArgumentError("Pool1d: more than 65535 rows");
  Pool1dKernel<<<dim3((p.n + 255) / 256, p.rows), 256, 0, stream>>>(p);
  return LaunchStatus("Pool1dKernel");
}

absl::Status LaunchRunMeans(const RunMeansParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateRunMeans(p));
  if (p.rows > 65535) return absl::InvalidArgumentError("RunMeans: more than 65535 rows");
  const int runs = (p.n + p.run - 1) / p.run;
  RunMeansKernel<<<dim3((runs + 255) / 256, p.rows), 256, 0, stream>>>(p, runs);
  return LaunchStatus("RunMeansKernel");
}

}  // namespace kvwire::kernels::cuda
