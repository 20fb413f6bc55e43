/* PackSpans (kernels/backend.h): a chunk's rows, scattered over pages, to and from one packed
 * buffer (what the nccl KV transport sends as one message). A block per span, 16 bytes a
 * thread where both ends are 16-byte aligned (a row of 64 bf16 is 128 bytes), bytes
 * otherwise. cudaMemcpyBatchAsync would do the same from the host's array but takes a call
 * per chunk of host-side setup per span; one launch over an uploaded table is the cheaper. */
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kThreads = 128;

struct PackedSpan {
  uint8_t* data;
  int64_t bytes;
  int64_t at;  // where the span's bytes are in the packed buffer
};

__global__ void PackSpansKernel(const PackedSpan* spans, uint8_t* packed, bool unpack) {
  const PackedSpan s = spans[blockIdx.x];
  uint8_t* from = unpack ? packed + s.at : s.data;
  uint8_t* to = unpack ? s.data : packed + s.at;
  const bool vector = ((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) |
                        static_cast<uintptr_t>(s.bytes)) &
                       15) == 0;
  if (vector) {
    const int64_t n = s.bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < s.bytes; i += blockDim.x) to[i] = from[i];
  }
}

}  // namespace

absl::Status LaunchPackSpans(const PackSpansParams& p, const OpMemory& mem, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidatePackSpans(p));
  if (p.n == 0) return absl::OkStatus();
  std::vector<PackedSpan> table(p.n);
  int64_t at = 0;
  for (int i = 0; i < p.n; ++i) {
    table[i] = {const_cast<uint8_t*>(p.spans[i].data), p.spans[i].bytes, at};
    at += p.spans[i].bytes;
  }
  ASSIGN_OR_RETURN(void* spans,
                   mem.table(kTablePackSpans, table.data(), sizeof(PackedSpan) * table.size()));
  PackSpansKernel<<<p.n, kThreads, 0, stream>>>(static_cast<const PackedSpan*>(spans), p.packed,
                                                p.unpack);
  return LaunchStatus("PackSpansKernel");
}

}  // namespace kvwire::kernels::cuda
