/* GatherKv (kernels/selection.h): the kept K/V rows of one layer into a contiguous send buffer
 * in the cache dtype. A block per (cache head, kept slot), a thread per element of the row. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

template <typename T>
__global__ void GatherKvKernel(GatherKvParams p) {
  const int64_t item = blockIdx.x;  // c · count + t
  const int c = static_cast<int>(item / p.count);
  const int64_t tok = p.kept[item];
  const int64_t g = static_cast<int64_t>(c / (p.n_cache_heads / p.n_kv_heads)) * p.head_dim;
  const float* k = p.k + tok * p.kv_stride + g;
  const float* v = p.v + tok * p.kv_stride + g;
  T* ko = static_cast<T*>(p.k_out) + item * p.head_dim;
  T* vo = static_cast<T*>(p.v_out) + item * p.head_dim;
  for (int i = threadIdx.x; i < p.head_dim; i += blockDim.x) {
    ko[i] = FromF32<T>(k[i]);
    vo[i] = FromF32<T>(v[i]);
  }
}

}  // namespace

absl::Status LaunchGatherKv(const GatherKvParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateGatherKv(p));
  const int64_t blocks = int64_t{p.n_cache_heads} * p.count;
  if (blocks > 0x7fffffff) return absl::InvalidArgumentError("GatherKv: too many rows");
  const int threads = std::min(256, (p.head_dim + 31) / 32 * 32);
  return DispatchDType(p.dtype, [&]<typename T>() {
    GatherKvKernel<T><<<static_cast<int>(blocks), threads, 0, stream>>>(p);
    return LaunchStatus("GatherKvKernel");
  });
}

}  // namespace kvwire::kernels::cuda
