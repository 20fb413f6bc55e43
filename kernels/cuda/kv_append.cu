/* The element-wise ops of a decode step on the device: EmbedRows, and AppendKv (its kernel in
 * kv_append.cuh), and the page tables' upload. Tested against the host backends' loops
 * (kernels/host_memory.h). */
#include <unordered_map>
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/kv_append.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {

absl::Status UploadPageTables(const std::vector<KvLayout*>& layouts, const std::vector<int>& lens,
                              const OpMemory& mem, int table) {
  // One copy of each table, as long as its longest use: the heads of a cache (a summary or
  // exact-score item each) share their cache's table, which copied per head would go up
  // n_heads times over (hundreds of MB a step at 32K tokens and batch 32).
  std::unordered_map<const int32_t*, int64_t> entries, at;
  std::vector<const int32_t*> order;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const KvLayout& l = *layouts[i];
    if (l.pages == nullptr) continue;
    auto [it, added] = entries.try_emplace(l.pages, 0);
    if (added) order.push_back(l.pages);
    it->second = std::max(it->second, l.TableEntries(lens[i]));
  }
  if (order.empty()) return absl::OkStatus();
  std::vector<int32_t> flat;
  for (const int32_t* pages : order) {
    at[pages] = static_cast<int64_t>(flat.size());
    flat.insert(flat.end(), pages, pages + entries[pages]);
  }
  ASSIGN_OR_RETURN(void* device, mem.table(table, flat.data(), flat.size() * sizeof(int32_t)));
  std::vector<const int32_t*> copies(layouts.size(), nullptr);  // before any layout changes
  for (size_t i = 0; i < layouts.size(); ++i) {
    if (layouts[i]->pages != nullptr) {
      copies[i] = static_cast<const int32_t*>(device) + at.find(layouts[i]->pages)->second;
    }
  }
  for (size_t i = 0; i < layouts.size(); ++i) {
    if (copies[i] != nullptr) layouts[i]->pages = copies[i];
  }
  return absl::OkStatus();
}

// One block per row: the table's row of ids[i], widened into out's row i.
template <typename T>
__global__ void EmbedRowsKernel(const T* __restrict__ table, const int32_t* __restrict__ ids,
                                int hidden, float* __restrict__ out) {
  const T* src = table + int64_t{ids[blockIdx.x]} * hidden;
  float* dst = out + int64_t{blockIdx.x} * hidden;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = ToF32(src[j]);
}

absl::Status LaunchEmbedRows(const EmbedRowsParams& p, const int32_t* ids_device,
                             cudaStream_t stream) {
  if (p.n == 0) return absl::OkStatus();
  return DispatchDType(p.dtype, [&]<typename T>() {
    EmbedRowsKernel<T>
        <<<p.n, 256, 0, stream>>>(static_cast<const T*>(p.table), ids_device, p.hidden, p.out);
    return LaunchStatus("EmbedRowsKernel");
  });
}

absl::Status LaunchAppendKv(const AppendKvParams& p, const KvAppend* seqs_device,
                            cudaStream_t stream) {
  if (p.batch == 0) return absl::OkStatus();
  const int64_t blocks = int64_t{p.batch} * p.n_cache_heads * 2;
  if (blocks > 0x7fffffff) return absl::InvalidArgumentError("AppendKv: batch too large");
  const int threads = append_kv::ThreadsFor(p.head_dim);
  return DispatchDType(p.kv_dtype, [&]<typename T>() {
    append_kv::AppendKvKernel<T><<<static_cast<int>(blocks), threads, 0, stream>>>(
        seqs_device, p.n_kv_heads, p.n_cache_heads, p.head_dim, p.kv_dtype);
    return LaunchStatus("AppendKvKernel");
  });
}

}  // namespace kvwire::kernels::cuda
