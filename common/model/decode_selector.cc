#include "common/model/decode_selector.h"

#include "common/base/status.h"

namespace kvwire {

absl::StatusOr<bool> DecodeSelector::Select(int layer, const float* q, const LayerCache& cache,
                                            std::vector<int32_t>* indices, int* num_indices) {
  ASSIGN_OR_RETURN(const bool sparse, Plan(layer, cache, num_indices));
  if (!sparse) {
    Done(layer, q, cache, nullptr, 0);
    return false;
  }
  indices->resize(static_cast<size_t>(cache.n_heads) * *num_indices);
  for (int c = 0; c < cache.n_heads; ++c) {
    SelectHead(layer, q, cache, c, indices->data() + static_cast<size_t>(c) * *num_indices);
  }
  Done(layer, q, cache, indices->data(), *num_indices);
  return true;
}

absl::Status DecodeSelector::PlanOnBackend(const std::shared_ptr<kernels::KernelBackend>&, int,
                                           const LayerCache&, const float*, BackendSelection*) {
  return absl::UnimplementedError("this decode selector selects on the host only");
}

}  // namespace kvwire
