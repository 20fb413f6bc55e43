/* Rotary position embedding, rotate_half convention (Hugging Face Llama): for i < d/2 the
 * pair (x_i, x_{i+d/2}) turns by pos · inv_freq[i], the angle in float32 as Hugging Face
 * computes it. One thread per (row, head, pair), in place. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

__global__ void RopeKernel(float* x, int64_t row_stride, const int32_t* __restrict__ positions,
                           const float* __restrict__ inv_freq, int rows, int heads, int head_dim) {
  const int half = head_dim / 2;
  const int64_t total = static_cast<int64_t>(rows) * heads * half;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(t % half);
    const int h = static_cast<int>((t / half) % heads);
    const int64_t r = t / (static_cast<int64_t>(half) * heads);
    float* v = x + r * row_stride + static_cast<int64_t>(h) * head_dim;
    const float angle = static_cast<float>(positions[r]) * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

}  // namespace

absl::Status LaunchRope(const RopeParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateRope(p));
  const int64_t total = static_cast<int64_t>(p.rows) * p.heads * (p.head_dim / 2);
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
  RopeKernel<<<blocks, 256, 0, stream>>>(p.x, p.row_stride, p.positions, p.inv_freq, p.rows,
                                         p.heads, p.head_dim);
  return LaunchStatus("RopeKernel");
}

}  // namespace kvwire::kernels::cuda
