/* Launches PageScores' kernel (page_scores.cuh says what it computes): the segments' table, the
 * work buffer, the page tables of exact scores' caches. */
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/page_scores.cuh"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {

absl::Status LaunchPageScores(const PageScoresParams& p, const OpMemory& mem, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidatePageScores(p));
  if (p.count == 0) return absl::OkStatus();
  page_scoring::Plan plan = page_scoring::PlanFor(p);
  std::vector<page_scoring::DeviceSegment>& segs = plan.segs;
  const int64_t work = plan.work;
  const size_t shared = plan.shared;
  if (shared > 48 * 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("PageScores: head_dim ", p.head_dim, " with ", plan.max_group,
                     " query heads per cache head needs more than 48 KiB of shared memory"));
  }
  ASSIGN_OR_RETURN(void* buffer,
                   mem.scratch(kScratchWork, sizeof(float) * std::max<int64_t>(work, 1)));
  std::vector<KvLayout*> layouts;
  std::vector<int> lens;
  for (page_scoring::DeviceSegment& seg : segs) {
    if (seg.s.kind != PageScoreKind::kExact) continue;
    layouts.push_back(&seg.s.kv);
    lens.push_back(seg.s.coding.PagedRows(seg.s.len));
  }
  RETURN_IF_ERROR(UploadPageTables(layouts, lens, mem, kTablePageScorePages));
  ASSIGN_OR_RETURN(void* table, mem.table(kTablePageScores, segs.data(),
                                          sizeof(page_scoring::DeviceSegment) * segs.size()));
  return DispatchDType(p.dtype, [&]<typename T>() {
    page_scoring::PageScoresKernel<T><<<p.count, page_scoring::kThreads, shared, stream>>>(
        static_cast<const page_scoring::DeviceSegment*>(table), p.head_dim,
        static_cast<float*>(buffer));
    return LaunchStatus("PageScoresKernel");
  });
}

}  // namespace kvwire::kernels::cuda
