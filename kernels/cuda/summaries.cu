/* Launches UpdateSummaries' kernel (summaries.cuh says what it computes), over a table of the
 * (segment, cache head) items with new tokens and their caches' page tables. */
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/summaries.cuh"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {

absl::Status LaunchUpdateSummaries(const UpdateSummariesParams& p, const OpMemory& mem,
                                   cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateUpdateSummaries(p));
  for (int i = 1; i < p.count; ++i) {
    if (p.segs[i].layout.dtype != p.segs[0].layout.dtype) {
      return absl::InvalidArgumentError("UpdateSummaries: segments of different dtypes");
    }
  }
  std::vector<summary_update::HeadItem> items = summary_update::ItemsFor(p);
  if (items.empty()) return absl::OkStatus();
  const DType dtype = items.front().s.layout.dtype;
  std::vector<KvLayout*> layouts;
  std::vector<int> lens;
  for (summary_update::HeadItem& item : items) {
    layouts.push_back(&item.s.kv);
    lens.push_back(item.s.coding.PagedRows(item.s.len));
  }
  RETURN_IF_ERROR(UploadPageTables(layouts, lens, mem, kTableSummaryPages));
  ASSIGN_OR_RETURN(void* table, mem.table(kTableSummaries, items.data(),
                                          sizeof(summary_update::HeadItem) * items.size()));
  return DispatchDType(dtype, [&]<typename T>() {
    summary_update::UpdateSummariesKernel<T>
        <<<static_cast<int>(items.size()), summary_update::kThreads, 0, stream>>>(
            static_cast<const summary_update::HeadItem*>(table));
    return LaunchStatus("UpdateSummariesKernel");
  });
}

}  // namespace kvwire::kernels::cuda
