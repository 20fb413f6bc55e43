/* TopK (kernels/selection.h) with CUB's segmented radix sort: every item's 64-bit key in the
 * ranking order (ranking.cuh) sorted largest first per segment, then each segment's first k
 * items taken. Items that share a score in runs (pages, chunks) are ranked as runs and
 * expanded, best first, the last run cut to its lowest items. With tie scores, keys cannot hold
 * score, tie and index at once: the items are ranked by (tie, index) first, and that rank
 * takes the index's place beside the score. Ascending output sorts each segment's k indices.
 *
 * Where FlashInfer is built, a call of segments ranked by their runs alone, best first (a decode
 * step's page ranking), takes FlashInfer's filtered top-k instead (flashinfer_topk.h): it finds
 * each row's few best runs without sorting the row, and a block per segment here orders them
 * (CUB's block radix sort, at most 2048) and expands them into the segment's items. */
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/ranking.cuh"
#include "kernels/validate.h"
#if KVWIRE_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_topk.h"
#endif

namespace kvwire::kernels::cuda {
namespace {

struct DeviceSegment {
  TopKSegment s;
  int begin = 0;  // first key of the segment
  int items = 0;  // keys: runs, or items with a tie
  int out_begin = 0;
};

enum class KeyPass { kRuns, kTie, kScoreAfterTie };

__global__ void MakeKeysKernel(const DeviceSegment* segs, KeyPass pass, const int32_t* tie_rank,
                               uint64_t* keys, int32_t* values) {
  const DeviceSegment& d = segs[blockIdx.y];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= d.items) return;
  // A call may mix segments with and without tie scores: those without rank by their runs'
  // keys in every pass (their tie pass ranks them harmlessly).
  uint64_t key = BestFirstKey(d.s.score[i], i);
  if (d.s.tie != nullptr && pass == KeyPass::kTie) {
    key = BestFirstKey(d.s.tie[i], i);
  } else if (d.s.tie != nullptr && pass == KeyPass::kScoreAfterTie) {
    key = (uint64_t{OrderedBits(d.s.score[i])} << 32) |
          (0xFFFFFFFFu - static_cast<uint32_t>(tie_rank[d.begin + i]));
  }
  keys[d.begin + i] = key;
  values[d.begin + i] = i;
}

// rank[item] = its place in the (tie, index) order.
__global__ void TieRankKernel(const DeviceSegment* segs, const int32_t* sorted, int32_t* rank) {
  const DeviceSegment& d = segs[blockIdx.y];
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < d.items) rank[d.begin + sorted[d.begin + p]] = p;
}

// The segment's first k items from its runs, best first: to `staging` (ascending output,
// sorted next) or straight to the segment's out.
__global__ void TakeKernel(const DeviceSegment* segs, const int32_t* sorted, int32_t* staging) {
  const DeviceSegment& d = segs[blockIdx.x];
  int32_t* out = staging ? staging + d.out_begin : d.s.out;
  const int32_t* ranked = sorted + d.begin;
  if (d.s.run == 1) {
    for (int t = threadIdx.x; t < d.s.k; t += blockDim.x) out[t] = ranked[t];
    return;
  }
  if (threadIdx.x != 0) return;
  int taken = 0;
  for (int i = 0; taken < d.s.k && i < d.items; ++i) {
    const int r = ranked[i];
    const int end = min(d.s.n, (r + 1) * d.s.run);
    for (int t = r * d.s.run; t < end && taken < d.s.k; ++t) out[taken++] = t;
  }
}

// The sorted k (ascending output) and the appended positions n, n + 1, ...
__global__ void CopyOutKernel(const DeviceSegment* segs, const int32_t* sorted) {
  const DeviceSegment& d = segs[blockIdx.x];
  for (int t = threadIdx.x; t < d.s.k; t += blockDim.x) d.s.out[t] = sorted[d.out_begin + t];
  for (int j = threadIdx.x; j < d.s.append; j += blockDim.x) d.s.out[d.s.k + j] = d.s.n + j;
}

__global__ void AppendKernel(const DeviceSegment* segs) {
  const DeviceSegment& d = segs[blockIdx.x];
  for (int j = threadIdx.x; j < d.s.append; j += blockDim.x) d.s.out[d.s.k + j] = d.s.n + j;
}

size_t Align(size_t n) { return (n + 255) / 256 * 256; }

#if KVWIRE_HAVE_FLASHINFER
static_assert(kOrderThreads * 8 >= kFlashInferTopKMax);
// OrderedBits(−∞): the runs at or below it (−∞ and NaN) FlashInfer sees alike (StageScoresKernel).
constexpr uint32_t kNegInfBits = 0x007FFFFFu;

// Row y of the staged scores: each run's score as FlashInfer is to rank it
// (StagedForFlashInfer); OrderKernel puts −∞ and NaN apart again.
__global__ void StageScoresKernel(const DeviceSegment* segs, int stride, float* staged) {
  const DeviceSegment& d = segs[blockIdx.y];
  float* row = staged + int64_t{blockIdx.y} * stride;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d.items; i += gridDim.x * blockDim.x) {
    row[i] = StagedForFlashInfer(d.s.score[i]);
  }
}

// A block per segment: the runs FlashInfer chose (`chosen`, `width` a row, in no order) ranked
// best first by their keys, then expanded into the segment's first k items and its appended
// positions. Where the choice reached the runs scored −∞ or NaN in a row it cut, it took them
// by index alone; the ranking order takes every −∞ before any NaN, so those are chosen again.
template <int kOrderItems>
__global__ void __launch_bounds__(kOrderThreads)
    OrderKernel(const DeviceSegment* segs, const int32_t* chosen, int width) {
  using Sort = cub::BlockRadixSort<uint64_t, kOrderThreads, kOrderItems>;
  using Scan = cub::BlockScan<int, kOrderThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int32_t again[kOrderThreads * kOrderItems];
  __shared__ int lows;
  const DeviceSegment& d = segs[blockIdx.x];
  const int32_t* row = chosen + int64_t{blockIdx.x} * width;
  const int m = min(width, d.items);  // a row of width runs or fewer: all of them, then −1
  if (threadIdx.x == 0) lows = 0;
  __syncthreads();
  uint64_t key[kOrderItems];
  int low = 0;
  for (int i = 0; i < kOrderItems; ++i) {
    const int j = threadIdx.x * kOrderItems + i;
    const int32_t r = j < m ? row[j] : -1;
    // 0 is below every run's key (its index part, 2^32 − 1 − index, is never 0).
    key[i] = r >= 0 && r < d.items ? BestFirstKey(d.s.score[r], r) : 0;
    low += key[i] != 0 && (key[i] >> 32) <= kNegInfBits;
  }
  if (low > 0) atomicAdd(&lows, low);
  Sort(temp.sort).SortDescending(key);  // blocked: thread t holds ranks t·kOrderItems on
  __syncthreads();
  const int n_low = lows;
  if (n_low > 0 && d.items > m) {
    // Ranks m − n_low to m − 1 are the −∞ and NaN runs: the first −∞ runs by index, then NaN.
    if (threadIdx.x == 0) {
      int taken = 0;
      for (int pass = 0; pass < 2 && taken < n_low; ++pass) {
        for (int r = 0; r < d.items && taken < n_low; ++r) {
          const uint32_t b = OrderedBits(d.s.score[r]);
          if (pass == 0 ? b == kNegInfBits : b == 0) again[taken++] = r;
        }
      }
    }
    __syncthreads();
    for (int i = 0; i < kOrderItems; ++i) {
      const int rank = threadIdx.x * kOrderItems + i, q = rank - (m - n_low);
      if (q >= 0 && rank < m) key[i] = BestFirstKey(d.s.score[again[q]], again[q]);
    }
  }
  int len[kOrderItems], start[kOrderItems];
  int32_t first[kOrderItems];
  for (int i = 0; i < kOrderItems; ++i) {
    const int rank = threadIdx.x * kOrderItems + i;
    const int32_t r = rank < m ? IndexOfKey(key[i]) : -1;
    first[i] = r >= 0 ? r * d.s.run : 0;
    len[i] = r >= 0 ? min(d.s.n, first[i] + d.s.run) - first[i] : 0;
  }
  __syncthreads();  // temp is reused
  Scan(temp.scan).ExclusiveSum(len, start);
  for (int i = 0; i < kOrderItems; ++i) {
    const int end = min(start[i] + len[i], d.s.k);
    for (int t = start[i]; t < end; ++t) d.s.out[t] = first[i] + (t - start[i]);
  }
  for (int j = threadIdx.x; j < d.s.append; j += blockDim.x) d.s.out[d.s.k + j] = d.s.n + j;
}

// The runs a row must ask FlashInfer for, over the call (the most of any segment), when its
// top-k serves the call: segments ranked by their runs alone, best first, each needing at most
// kFlashInferTopKMax runs (⌈k / run⌉, one more where a short last run could be among them);
// 0 where it does not.
int FlashInferWidth(const TopKParams& p) {
  if (p.ascending) return 0;
  int width = 1;
  for (int i = 0; i < p.count; ++i) {
    const TopKSegment& s = p.segs[i];
    if (s.tie != nullptr) return 0;
    const int items = (s.n + s.run - 1) / s.run;
    const int need = std::min(items, (s.k + s.run - 1) / s.run + (s.n % s.run != 0 ? 1 : 0));
    width = std::max(width, need);
  }
  return width <= kFlashInferTopKMax ? width : 0;
}

absl::Status LaunchTopKFlashInfer(const TopKParams& p, int width, const OpMemory& mem,
                                  cudaStream_t stream) {
  std::vector<DeviceSegment> segs(p.count);
  std::vector<int32_t> lengths(p.count);
  int max_items = 0;
  for (int i = 0; i < p.count; ++i) {
    segs[i].s = p.segs[i];
    segs[i].items = lengths[i] = (p.segs[i].n + p.segs[i].run - 1) / p.segs[i].run;
    max_items = std::max(max_items, segs[i].items);
  }
  const int stride = (max_items + 3) / 4 * 4;  // rows of whole 16-byte vectors, FlashInfer's loads
  if (int64_t{p.count} * stride > (1 << 30)) {
    return absl::InvalidArgumentError("TopK: more than 2^30 items in one call");
  }
  const size_t staged_bytes = Align(sizeof(float) * p.count * stride);
  const size_t chosen_bytes = Align(sizeof(int32_t) * p.count * width);
  ASSIGN_OR_RETURN(void* scratch, mem.scratch(kScratchSort, staged_bytes + chosen_bytes));
  auto* staged = static_cast<float*>(scratch);
  auto* chosen = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(scratch) + staged_bytes);
  ASSIGN_OR_RETURN(void* table,
                   mem.table(kTableTopK, segs.data(), sizeof(DeviceSegment) * segs.size()));
  const auto* dsegs = static_cast<const DeviceSegment*>(table);
  ASSIGN_OR_RETURN(void* lengths_table,
                   mem.table(kTableTopKLengths, lengths.data(), sizeof(int32_t) * lengths.size()));
  const dim3 grid(std::min((max_items + 255) / 256, 64), p.count);
  StageScoresKernel<<<grid, 256, 0, stream>>>(dsegs, stride, staged);
  RETURN_IF_ERROR(LaunchStatus("StageScoresKernel"));
  RETURN_IF_ERROR(LaunchFlashInferTopK(staged, static_cast<const int32_t*>(lengths_table), p.count,
                                       stride, width, chosen, stream));
  WithOrderItems(width, [&](auto items) {
    OrderKernel<items.value><<<p.count, kOrderThreads, 0, stream>>>(dsegs, chosen, width);
  });
  return LaunchStatus("OrderKernel");
}
#endif  // KVWIRE_HAVE_FLASHINFER

}  // namespace

absl::Status LaunchTopK(const TopKParams& p, const OpMemory& mem, cudaStream_t stream,
                        bool flashinfer) {
  RETURN_IF_ERROR(ValidateTopK(p));
  if (p.count == 0) return absl::OkStatus();
  if (p.count > 65535) return absl::InvalidArgumentError("TopK: more than 65535 segments");
#if KVWIRE_HAVE_FLASHINFER
  if (flashinfer) {
    if (const int width = FlashInferWidth(p); width > 0) {
      return LaunchTopKFlashInfer(p, width, mem, stream);
    }
  }
#endif
  std::vector<DeviceSegment> segs(p.count);
  std::vector<int> begin(p.count + 1), out_begin(p.count + 1);
  int64_t items = 0, outs = 0;
  int max_items = 0;
  bool tie = false;
  for (int i = 0; i < p.count; ++i) {
    DeviceSegment& d = segs[i];
    d.s = p.segs[i];
    d.items = d.s.tie ? d.s.n : (d.s.n + d.s.run - 1) / d.s.run;
    d.begin = static_cast<int>(items);
    d.out_begin = static_cast<int>(outs);
    begin[i] = d.begin;
    out_begin[i] = d.out_begin;
    items += d.items;
    outs += d.s.k;
    max_items = std::max(max_items, d.items);
    tie |= d.s.tie != nullptr;
    if (items > (1 << 30) || outs > (1 << 30)) {
      return absl::InvalidArgumentError("TopK: more than 2^30 items in one call");
    }
  }
  begin[p.count] = static_cast<int>(items);
  out_begin[p.count] = static_cast<int>(outs);
  const int n = static_cast<int>(items), k_total = static_cast<int>(outs);

  // Scratch: keys and values twice, the tie ranks, the ascending pass's indices twice, and
  // CUB's temporary storage (sized by CUB's own query, which does no work).
  size_t sort_temp = 0, asc_temp = 0;
  RETURN_IF_ERROR(
      CudaStatus(cub::DeviceSegmentedRadixSort::SortPairsDescending(
                     nullptr, sort_temp, static_cast<const uint64_t*>(nullptr),
                     static_cast<uint64_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                     static_cast<int32_t*>(nullptr), n, p.count, static_cast<const int*>(nullptr),
                     static_cast<const int*>(nullptr), 0, 64, stream),
                 "cub segmented sort (size)"));
  if (p.ascending) {
    RETURN_IF_ERROR(CudaStatus(
        cub::DeviceSegmentedRadixSort::SortKeys(
            nullptr, asc_temp, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
            k_total, p.count, static_cast<const int*>(nullptr), static_cast<const int*>(nullptr), 0,
            32, stream),
        "cub segmented sort (size)"));
  }
  const size_t keys_bytes = Align(sizeof(uint64_t) * n), values_bytes = Align(sizeof(int32_t) * n);
  const size_t asc_bytes = p.ascending ? Align(sizeof(int32_t) * k_total) : 0;
  const size_t total = 2 * keys_bytes + (tie ? 3 : 2) * values_bytes + 2 * asc_bytes +
                       Align(std::max(sort_temp, asc_temp));
  ASSIGN_OR_RETURN(void* scratch, mem.scratch(kScratchSort, total));
  auto* at = static_cast<uint8_t*>(scratch);
  auto take = [&](size_t bytes) {
    void* ptr = at;
    at += bytes;
    return ptr;
  };
  auto* keys_in = static_cast<uint64_t*>(take(keys_bytes));
  auto* keys_out = static_cast<uint64_t*>(take(keys_bytes));
  auto* values_in = static_cast<int32_t*>(take(values_bytes));
  auto* values_out = static_cast<int32_t*>(take(values_bytes));
  auto* tie_rank = tie ? static_cast<int32_t*>(take(values_bytes)) : nullptr;
  auto* staging = p.ascending ? static_cast<int32_t*>(take(asc_bytes)) : nullptr;
  auto* staging_sorted = p.ascending ? static_cast<int32_t*>(take(asc_bytes)) : nullptr;
  void* temp = take(Align(std::max(sort_temp, asc_temp)));

  ASSIGN_OR_RETURN(void* table,
                   mem.table(kTableTopK, segs.data(), sizeof(DeviceSegment) * segs.size()));
  const auto* dsegs = static_cast<const DeviceSegment*>(table);
  // Offsets: the segments' key ranges, then their output ranges, in one table.
  std::vector<int> offsets(begin);
  offsets.insert(offsets.end(), out_begin.begin(), out_begin.end());
  ASSIGN_OR_RETURN(void* off_table,
                   mem.table(kTableTopKOffsets, offsets.data(), sizeof(int) * offsets.size()));
  const int* key_offsets = static_cast<const int*>(off_table);
  const int* out_offsets = key_offsets + p.count + 1;

  const dim3 grid((max_items + 255) / 256, p.count);
  auto sort = [&](const char* what) {
    size_t bytes = sort_temp;
    return CudaStatus(cub::DeviceSegmentedRadixSort::SortPairsDescending(
                          temp, bytes, keys_in, keys_out, values_in, values_out, n, p.count,
                          key_offsets, key_offsets + 1, 0, 64, stream),
                      what);
  };
  if (tie) {
    MakeKeysKernel<<<grid, 256, 0, stream>>>(dsegs, KeyPass::kTie, nullptr, keys_in, values_in);
    RETURN_IF_ERROR(LaunchStatus("MakeKeysKernel"));
    RETURN_IF_ERROR(sort("cub segmented sort (tie scores)"));
    TieRankKernel<<<grid, 256, 0, stream>>>(dsegs, values_out, tie_rank);
    RETURN_IF_ERROR(LaunchStatus("TieRankKernel"));
  }
  if (tie) {
    MakeKeysKernel<<<grid, 256, 0, stream>>>(dsegs, KeyPass::kScoreAfterTie, tie_rank, keys_in,
                                             values_in);
  } else {
    MakeKeysKernel<<<grid, 256, 0, stream>>>(dsegs, KeyPass::kRuns, nullptr, keys_in, values_in);
  }
  RETURN_IF_ERROR(LaunchStatus("MakeKeysKernel"));
  RETURN_IF_ERROR(sort("cub segmented sort"));
  TakeKernel<<<p.count, 128, 0, stream>>>(dsegs, values_out, staging);
  RETURN_IF_ERROR(LaunchStatus("TakeKernel"));
  if (!p.ascending) {
    AppendKernel<<<p.count, 128, 0, stream>>>(dsegs);
    return LaunchStatus("AppendKernel");
  }
  size_t bytes = asc_temp;
  RETURN_IF_ERROR(CudaStatus(
      cub::DeviceSegmentedRadixSort::SortKeys(temp, bytes, staging, staging_sorted, k_total,
                                              p.count, out_offsets, out_offsets + 1, 0, 32, stream),
      "cub segmented sort (ascending)"));
  CopyOutKernel<<<p.count, 128, 0, stream>>>(dsegs, staging_sorted);
  return LaunchStatus("CopyOutKernel");
}

}  // namespace kvwire::kernels::cuda
