/* SwiGLU activation: out[r, i] = silu(g) · u with g = gate_up[r, i] and
 * u = gate_up[r, ffn + i], the gate and up projections having come out of one fused
 * matmul. A grid-stride loop, one element per thread per step. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

__global__ void SwiGluKernel(const float* __restrict__ gate_up, float* __restrict__ out, int rows,
                             int ffn) {
  const int64_t total = static_cast<int64_t>(rows) * ffn;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / ffn;
    const int i = static_cast<int>(t % ffn);
    const float g = gate_up[r * 2 * ffn + i];
    const float u = gate_up[r * 2 * ffn + ffn + i];
    out[t] = g / (1.f + expf(-g)) * u;
  }
}

}  // namespace

absl::Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateSwiGlu(p));
  const int64_t total = static_cast<int64_t>(p.rows) * p.ffn;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
  SwiGluKernel<<<blocks, 256, 0, stream>>>(p.gate_up, p.out, p.rows, p.ffn);
  return LaunchStatus("SwiGluKernel");
}

}  // namespace kvwire::kernels::cuda
