/* Dense decode attention over coded caches: which calls the kernel (coded_decode.cuh, with the
 * split of a call into blocks) serves, and its launch. */
#include <atomic>
#include <climits>

#include "kernels/cuda/coded_decode.cuh"
#include "kernels/cuda/coded_decode.h"

namespace kvwire::kernels::cuda {
namespace {

using coded_decode::CodedDecodeKernel;
using coded_decode::kThreads;

std::atomic<int64_t> launches{0};

// Key rows are read in 16-byte loads; value rows in 4-byte (fp8) or 2-byte loads (int8 rows
// are d + 2 bytes; int4's, two bytes of codes at a time).
bool Aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
bool AlignedStrides(const KvLayout& l, int bytes) {
  return l.page_stride % bytes == 0 && l.head_stride % bytes == 0;
}

}  // namespace

bool CodedDecodeServes(const DecodeAttentionParams& p) {
  if (p.batch <= 0 || p.n_cache_heads <= 0 || p.n_heads % p.n_cache_heads != 0) return false;
  const int group = p.n_heads / p.n_cache_heads;
  if (group != 1 && group != 2 && group != 4 && group != 8) return false;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  for (int b = 0; b < p.batch; ++b) {
    const DecodeSequence& s = p.seqs[b];
    if (!s.coding.coded() || s.indices != nullptr || s.probs != nullptr || s.len <= 0) return false;
    const int v_align = s.coding.format == KvFormat::kFP8 ? 4 : 2;
    if (!Aligned(s.k, 16) || !AlignedStrides(s.layout, 16) || !Aligned(s.v, v_align) ||
        !AlignedStrides(s.coding.v_layout, v_align)) {
      return false;
    }
  }
  return true;
}

absl::Status LaunchCodedDecode(const DecodeAttentionParams& p, const DecodeSequence* seqs_device,
                               const OpMemory& mem, cudaStream_t stream) {
  if (!CodedDecodeServes(p)) {
    return absl::InvalidArgumentError(
        "coded decode: a call this kernel does not serve (CodedDecodeServes)");
  }
  const int64_t items = int64_t{p.batch} * p.n_cache_heads;
  if (items > INT_MAX) return absl::InvalidArgumentError("coded decode: too many sequences");
  const coded_decode::Split split = coded_decode::SplitFor(p);
  const int per = split.per, chunks = split.chunks;
  float *part_m = nullptr, *part_l = nullptr, *part_acc = nullptr;
  if (chunks > 1) {
    const int64_t n = int64_t{p.batch} * p.n_heads * chunks;
    ASSIGN_OR_RETURN(void* scratch,
                     mem.scratch(kScratchWork, sizeof(float) * n * (2 + int64_t{p.head_dim})));
    part_m = static_cast<float*>(scratch);
    part_l = part_m + n;
    part_acc = part_l + n;
  }
  const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(chunks));
  const int group = p.n_heads / p.n_cache_heads;
  RETURN_IF_ERROR(DispatchDType(p.kv_dtype, [&]<typename T>() {
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, stream>>>(seqs_device, p.n_cache_heads, p.head_dim, p.scale,
                                            chunks, per, part_m, part_l, part_acc);
      return LaunchStatus("CodedDecodeKernel");
    };
    switch (group) {
      case 1:
        return launch(CodedDecodeKernel<T, 1>);
      case 2:
        return launch(CodedDecodeKernel<T, 2>);
      case 4:
        return launch(CodedDecodeKernel<T, 4>);
      default:
        return launch(CodedDecodeKernel<T, 8>);
    }
  }));
  launches.fetch_add(1, std::memory_order_relaxed);
  if (chunks == 1) return absl::OkStatus();
  return LaunchMergeDecodeChunks(p, seqs_device, chunks, part_m, part_l, part_acc, stream);
}

int64_t CodedDecodeLaunches() { return launches.load(std::memory_order_relaxed); }

}  // namespace kvwire::kernels::cuda
