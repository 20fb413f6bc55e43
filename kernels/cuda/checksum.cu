/* ChecksumSpans (kernels/backend.h): the CRC-32C of each span of device memory, where the
 * bytes are (a transport that writes a cache in place checks it this way). A thread per span
 * with the byte table in shared memory: the spans are a chunk's rows (at most a chunk, 1 MiB,
 * per call), so one pass beside the copy that wrote them is enough; CUB and cuBLAS have no
 * CRC. The table is built from Crc32cBitwise, the reference's function, byte by byte. */
#include "common/base/crc32c.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ChecksumSpansKernel(const ByteSpan* spans, int n, uint32_t* out) {
  __shared__ uint32_t table[256];
  // Entry b: the register after byte b from zero, with no pre- or post-inversion.
  const uint8_t b = static_cast<uint8_t>(threadIdx.x);
  table[threadIdx.x] = ~Crc32cBitwise(&b, 1, ~0u);
  __syncthreads();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint8_t* p = spans[i].data;
  uint32_t crc = ~0u;
  for (int64_t j = 0; j < spans[i].bytes; ++j) crc = table[(crc ^ p[j]) & 0xff] ^ (crc >> 8);
  out[i] = ~crc;
}

}  // namespace

// `p.out` is device memory here (the backend copies it to the caller's host array).
absl::Status LaunchChecksumSpans(const ChecksumSpansParams& p, const OpMemory& mem,
                                 cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateChecksumSpans(p));
  if (p.n == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(void* spans, mem.table(kTableChecksumSpans, p.spans, sizeof(ByteSpan) * p.n));
  ChecksumSpansKernel<<<(p.n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      static_cast<const ByteSpan*>(spans), p.n, p.out);
  return LaunchStatus("ChecksumSpansKernel");
}

}  // namespace kvwire::kernels::cuda
