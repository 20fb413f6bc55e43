/* The element-wise ops of a decode step on the device: the residual Add, and AppendKv,
 * which stores each sequence's new K and V rows (float32, after RoPE) in its cache's dtype
 * at token t of every cache head. One block per (sequence, cache head, K or V), a thread per
 * element. Tested against the host backends' loops (kernels/host_memory.h). */
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

__global__ void AddKernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[t] += x[t];
  }
}

template <typename T>
__global__ void AppendKvKernel(const KvAppend* __restrict__ seqs, int n_kv_heads, int n_cache_heads,
                               int d) {
  const int item = blockIdx.x;  // ((b · n_cache_heads) + c) · 2 + (0: K, 1: V)
  const int which = item % 2;
  const int c = (item / 2) % n_cache_heads;
  const KvAppend& s = seqs[item / 2 / n_cache_heads];
  const int g = c / (n_cache_heads / n_kv_heads);
  const float* src = (which == 0 ? s.k : s.v) + static_cast<int64_t>(g) * d;
  T* dst = static_cast<T*>(which == 0 ? s.k_cache : s.v_cache) + s.layout.Row(c, s.t, d);
  for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = FromF32<T>(src[i]);
}

}  // namespace

absl::Status UploadPageTables(const std::vector<KvLayout*>& layouts, const std::vector<int>& lens,
                              const OpMemory& mem, int table) {
  std::vector<int32_t> flat;
  std::vector<int64_t> at(layouts.size(), -1);
  for (size_t i = 0; i < layouts.size(); ++i) {
    const KvLayout& l = *layouts[i];
    if (l.pages == nullptr) continue;
    at[i] = static_cast<int64_t>(flat.size());
    flat.insert(flat.end(), l.pages, l.pages + l.TableEntries(lens[i]));
  }
  if (flat.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(void* device, mem.table(table, flat.data(), flat.size() * sizeof(int32_t)));
  for (size_t i = 0; i < layouts.size(); ++i) {
    if (at[i] >= 0) layouts[i]->pages = static_cast<const int32_t*>(device) + at[i];
  }
  return absl::OkStatus();
}

absl::Status LaunchAdd(const AddParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateAdd(p));
  if (p.n == 0) return absl::OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((p.n + 255) / 256, 65535));
  AddKernel<<<blocks, 256, 0, stream>>>(p.x, p.y, p.n);
  return LaunchStatus("AddKernel");
}

absl::Status LaunchAppendKv(const AppendKvParams& p, const KvAppend* seqs_device,
                            cudaStream_t stream) {
  if (p.batch == 0) return absl::OkStatus();
  const int64_t blocks = int64_t{p.batch} * p.n_cache_heads * 2;
  if (blocks > 0x7fffffff) return absl::InvalidArgumentError("AppendKv: batch too large");
  const int threads = std::min(256, (p.head_dim + 31) / 32 * 32);
  return DispatchDType(p.kv_dtype, [&]<typename T>() {
    AppendKvKernel<T><<<static_cast<int>(blocks), threads, 0, stream>>>(
        seqs_device, p.n_kv_heads, p.n_cache_heads, p.head_dim);
    return LaunchStatus("AppendKvKernel");
  });
}

}  // namespace kvwire::kernels::cuda
