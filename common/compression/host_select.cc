// LayerSelector::Select, the host's entry (tools, tests): in a file of its own, so that what
// links the compression's configuration alone (the request translation, the OpenAI front)
// does not link the CPU backend it makes.
#include "common/base/status.h"
#include "common/compression/compression.h"
#include "kernels/cpu_backend.h"

namespace kvwire {

absl::StatusOr<KeptRows> LayerSelector::Select(int layer, int len, const WindowScores* scores) {
  if (host_ == nullptr) host_ = kernels::MakeCpuBackend(1);
  int count = 0;
  ASSIGN_OR_RETURN(const int32_t* kept, SelectOn(*host_, layer, len, scores, &count));
  KeptRows rows(cache_heads(), std::vector<int32_t>(count));
  for (int c = 0; c < cache_heads(); ++c) {
    RETURN_IF_ERROR(
        host_->CopyToHost(rows[c].data(), kept + int64_t{c} * count, count * sizeof(int32_t)));
  }
  return rows;
}

}  // namespace kvwire
