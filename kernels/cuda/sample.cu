/* Sample (kernels/selection.h): the step's tokens drawn on the device, so that only the ids and
 * their log-probabilities come back to the host. Per row, one block finds the maximum, the
 * greedy argmax (lowest id on ties) and the log-sum-exp (in double, as the host); a row that
 * samples also writes each candidate's probability exp((logit - max) / T) as a key in the
 * ranking order and its total. CUB's segmented radix sort orders the candidates, and one warp
 * per row walks them: top-k, then the smallest prefix reaching top-p, then the first whose
 * cumulative probability exceeds u · mass, the sums in double by warp scans. The host sums in
 * one sequential pass: the sums agree to double rounding, so the tokens are the host's except
 * where u · mass falls within that rounding of a boundary.
 *
 * Where every sampling row of the call has a top-k of at most 2048 and FlashInfer is built, the
 * walk needs only those candidates in order: FlashInfer's filtered top-k finds them without
 * sorting the vocabulary (flashinfer_topk.h), and a block per row orders them by their keys
 * (CUB's block radix sort), where the segmented sort ordered every row's whole vocabulary. */
#include <cub/block/block_radix_sort.cuh>
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

constexpr int kThreads = 256;

struct RowStats {
  float max;
  int32_t argmax;
  double sum_exp;  // Σ exp(logit - max), for the log-probability
  double total;    // Σ exp((logit - max) / T), the candidates' mass
};

struct Pick {
  float value;
  int32_t index;
};

__device__ __forceinline__ Pick Better(Pick a, Pick b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

// A sampling row's candidates go to `keys` (for the segmented sort) or, where it is null, to
// `staged` (for FlashInfer's top-k, row stride `staged_stride`): the probability as
// StagedForFlashInfer gives it, which OrderChosenKernel makes a key again (no probability is
// −∞ or −0, so −∞ there is NaN).
__global__ void RowStatsKernel(const float* logits, int64_t stride, int vocab,
                               const SampleRow* rows, uint64_t* keys, RowStats* stats,
                               float* staged, int64_t staged_stride) {
  __shared__ Pick picks[32];
  __shared__ double sums[32];
  const int b = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const float* x = logits + b * stride;
  Pick best{x[0], 0};
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = Better(best, Pick{x[i], i});
  for (int o = 16; o > 0; o >>= 1) {
    Pick other{__shfl_xor_sync(0xffffffffu, best.value, o),
               __shfl_xor_sync(0xffffffffu, best.index, o)};
    best = Better(best, other);
  }
  if (lane == 0) picks[warp] = best;
  __syncthreads();
  best = picks[0];
  for (int w = 1; w < warps; ++w) best = Better(best, picks[w]);
  const float mx = best.value;
  const float temperature = rows[b].params.temperature;
  double sum_exp = 0, total = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    sum_exp += exp(static_cast<double>(x[i] - mx));
    if (temperature > 0.f) {
      const float p = expf((x[i] - mx) / temperature);
      total += p;
      if (keys) {
        keys[b * static_cast<int64_t>(vocab) + i] = BestFirstKey(p, i);
      } else {
        staged[b * staged_stride + i] = StagedForFlashInfer(p);
      }
    }
  }
  for (int pass = 0; pass < 2; ++pass) {
    double v = pass == 0 ? sum_exp : total;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sums[warp] = v;
    __syncthreads();
    v = 0;
    for (int w = 0; w < warps; ++w) v += sums[w];
    (pass == 0 ? sum_exp : total) = v;
  }
  if (threadIdx.x == 0) stats[b] = RowStats{mx, best.index, sum_exp, total};
}

// The inclusive prefix sums of a warp's values, in double.
__device__ __forceinline__ double WarpScan(double v) {
  const int lane = threadIdx.x % 32;
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// The first i < keep whose cumulative probability (from 0) reaches `target`: `at_least` → ≥,
// else >. keep when none does; the sum of all keep in *sum.
__device__ int FirstCrossing(const uint64_t* sorted, int keep, double target, bool at_least,
                             double* sum) {
  const int lane = threadIdx.x % 32;
  double carry = 0;
  int found = keep;
  for (int base = 0; base < keep; base += 32) {
    const int i = base + lane;
    const double p =
        i < keep ? static_cast<double>(FromOrderedBits(static_cast<uint32_t>(sorted[i] >> 32)))
                 : 0.0;
    const double cum = carry + WarpScan(p);
    const bool hit = i < keep && (at_least ? cum >= target : cum > target);
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (mask != 0 && found == keep) found = base + __ffs(mask) - 1;
    carry = __shfl_sync(0xffffffffu, cum, 31);
    if (found != keep && sum == nullptr) break;
  }
  if (sum != nullptr) *sum = carry;
  return found;
}

__global__ void DrawKernel(const float* logits, int64_t stride, int vocab, const SampleRow* rows,
                           const RowStats* stats, const uint64_t* sorted, int64_t sorted_stride,
                           SampledToken* out) {
  const int b = blockIdx.x;
  const RowStats st = stats[b];
  const SamplingParams sp = rows[b].params;
  int32_t id = st.argmax;
  if (sp.temperature > 0.f) {
    const uint64_t* row = sorted + b * sorted_stride;
    int keep = vocab;
    if (sp.top_k > 0) keep = min(keep, sp.top_k);
    if (sp.top_p < 1.f) {
      const int i = FirstCrossing(row, keep, sp.top_p * st.total, true, nullptr);
      keep = min(keep, i + 1);
    }
    double mass = 0;
    FirstCrossing(row, keep, 0, true, &mass);
    const int i = FirstCrossing(row, keep, rows[b].uniform * mass, false, nullptr);
    id = IndexOfKey(row[i < keep ? i : keep - 1]);
  }
  if (threadIdx.x == 0) {
    const float x = logits[b * stride + id];
    out[b] = SampledToken{id, static_cast<float>(x - st.max - log(st.sum_exp))};
  }
}

size_t Align(size_t n) { return (n + 255) / 256 * 256; }

#if KVWIRE_HAVE_FLASHINFER
static_assert(kOrderThreads * 8 >= kFlashInferTopKMax);

// A block per sampling row: the candidates FlashInfer chose (`chosen`, `width` a row, in no
// order) ranked by their keys into `sorted` (`width` a row), as the segmented sort would leave
// a row's first places. FlashInfer takes NaN candidates (staged as −∞, below every
// probability) by index, as the ranking order does.
template <int kItems>
__global__ void __launch_bounds__(kOrderThreads)
    OrderChosenKernel(const SampleRow* rows, const int32_t* chosen, int width, int vocab,
                      const float* staged, int64_t staged_stride, uint64_t* sorted) {
  using Sort = cub::BlockRadixSort<uint64_t, kOrderThreads, kItems>;
  __shared__ typename Sort::TempStorage temp;
  const int b = blockIdx.x;
  if (rows[b].params.temperature <= 0.f) return;  // greedy: nothing to order
  const int m = min(width, vocab);
  uint64_t key[kItems];
  for (int i = 0; i < kItems; ++i) {
    const int j = threadIdx.x * kItems + i;
    const int32_t id = j < m ? chosen[int64_t{b} * width + j] : -1;
    if (id >= 0 && id < vocab) {
      const float p = staged[b * staged_stride + id];
      key[i] = BestFirstKey(p == -INFINITY ? NAN : p, id);
    } else {
      key[i] = 0;  // below every candidate's key
    }
  }
  Sort(temp).SortDescending(key);  // blocked: thread t holds places t·kItems on
  for (int i = 0; i < kItems; ++i) {
    const int place = threadIdx.x * kItems + i;
    if (place < m) sorted[int64_t{b} * width + place] = key[i];
  }
}

// The candidates each row's walk needs through FlashInfer's top-k: the most of any sampling
// row's min(top_k, vocab), when each has a top-k of 1 to kFlashInferTopKMax; 0 otherwise.
int ChosenWidth(const SampleParams& p) {
  int width = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SamplingParams& sp = p.rows[b].params;
    if (sp.temperature <= 0.f) continue;
    if (sp.top_k < 1 || sp.top_k > kFlashInferTopKMax) return 0;
    width = std::max(width, std::min(sp.top_k, p.vocab));
  }
  return width;
}
#endif  // KVWIRE_HAVE_FLASHINFER

}  // namespace

absl::Status LaunchSample(const SampleParams& p, const OpMemory& mem, cudaStream_t stream,
                          bool flashinfer) {
  RETURN_IF_ERROR(ValidateSample(p));
  if (p.batch == 0) return absl::OkStatus();
  const int64_t stride = p.stride ? p.stride : p.vocab;
  const int64_t items = int64_t{p.batch} * p.vocab;
  if (items > (1 << 30)) return absl::InvalidArgumentError("Sample: batch · vocab above 2^30");
#if KVWIRE_HAVE_FLASHINFER
  if (const int width = flashinfer ? ChosenWidth(p) : 0; width > 0) {
    const int64_t staged_stride = (p.vocab + 3) / 4 * 4;  // whole 16-byte vectors a row
    const size_t sorted_bytes = Align(sizeof(uint64_t) * p.batch * width);
    const size_t stats_bytes = Align(sizeof(RowStats) * p.batch);
    const size_t staged_bytes = Align(sizeof(float) * p.batch * staged_stride);
    ASSIGN_OR_RETURN(void* scratch,
                     mem.scratch(kScratchSort, sorted_bytes + stats_bytes + staged_bytes +
                                                   Align(sizeof(int32_t) * p.batch * width)));
    auto* at = static_cast<uint8_t*>(scratch);
    auto* sorted = reinterpret_cast<uint64_t*>(at);
    auto* stats = reinterpret_cast<RowStats*>(at + sorted_bytes);
    auto* staged = reinterpret_cast<float*>(at + sorted_bytes + stats_bytes);
    auto* chosen = reinterpret_cast<int32_t*>(at + sorted_bytes + stats_bytes + staged_bytes);
    // A greedy row is a row of length 0 for FlashInfer: nothing is read of it.
    std::vector<int32_t> lengths(p.batch);
    for (int b = 0; b < p.batch; ++b) {
      lengths[b] = p.rows[b].params.temperature > 0.f ? p.vocab : 0;
    }
    ASSIGN_OR_RETURN(void* rows, mem.table(kTableSample, p.rows, sizeof(SampleRow) * p.batch));
    const auto* drows = static_cast<const SampleRow*>(rows);
    // (The offsets' table holds the lengths: this path sorts no segments.)
    ASSIGN_OR_RETURN(void* lengths_table, mem.table(kTableSampleOffsets, lengths.data(),
                                                    sizeof(int32_t) * lengths.size()));
    RowStatsKernel<<<p.batch, kThreads, 0, stream>>>(p.logits, stride, p.vocab, drows, nullptr,
                                                     stats, staged, staged_stride);
    RETURN_IF_ERROR(LaunchStatus("RowStatsKernel"));
    RETURN_IF_ERROR(LaunchFlashInferTopK(staged, static_cast<const int32_t*>(lengths_table),
                                         p.batch, static_cast<int>(staged_stride), width, chosen,
                                         stream));
    WithOrderItems(width, [&](auto items) {
      OrderChosenKernel<items.value><<<p.batch, kOrderThreads, 0, stream>>>(
          drows, chosen, width, p.vocab, staged, staged_stride, sorted);
    });
    RETURN_IF_ERROR(LaunchStatus("OrderChosenKernel"));
    DrawKernel<<<p.batch, 32, 0, stream>>>(p.logits, stride, p.vocab, drows, stats, sorted, width,
                                           p.out);
    return LaunchStatus("DrawKernel");
  }
#endif
  // Rows that sample sort their vocab; greedy rows are empty segments.
  std::vector<int> offsets(2 * p.batch);
  bool any = false;
  for (int b = 0; b < p.batch; ++b) {
    const bool sorts = p.rows[b].params.temperature > 0.f;
    any |= sorts;
    offsets[b] = b * p.vocab;
    offsets[p.batch + b] = sorts ? (b + 1) * p.vocab : b * p.vocab;
  }
  size_t temp = 0;
  if (any) {
    RETURN_IF_ERROR(CudaStatus(
        cub::DeviceSegmentedRadixSort::SortKeysDescending(
            nullptr, temp, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
            static_cast<int>(items), p.batch, static_cast<const int*>(nullptr),
            static_cast<const int*>(nullptr), 0, 64, stream),
        "cub segmented sort (size)"));
  }
  const size_t keys_bytes = any ? Align(sizeof(uint64_t) * items) : 0;
  const size_t stats_bytes = Align(sizeof(RowStats) * p.batch);
  ASSIGN_OR_RETURN(void* scratch,
                   mem.scratch(kScratchSort, 2 * keys_bytes + stats_bytes + Align(temp)));
  auto* keys = static_cast<uint64_t*>(scratch);
  auto* sorted = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(scratch) + keys_bytes);
  auto* stats = reinterpret_cast<RowStats*>(static_cast<uint8_t*>(scratch) + 2 * keys_bytes);
  void* cub_temp = static_cast<uint8_t*>(scratch) + 2 * keys_bytes + stats_bytes;
  ASSIGN_OR_RETURN(void* rows, mem.table(kTableSample, p.rows, sizeof(SampleRow) * p.batch));
  const auto* drows = static_cast<const SampleRow*>(rows);
  RowStatsKernel<<<p.batch, kThreads, 0, stream>>>(p.logits, stride, p.vocab, drows, keys, stats,
                                                   nullptr, 0);
  RETURN_IF_ERROR(LaunchStatus("RowStatsKernel"));
  if (any) {
    ASSIGN_OR_RETURN(void* off,
                     mem.table(kTableSampleOffsets, offsets.data(), sizeof(int) * offsets.size()));
    const int* begin = static_cast<const int*>(off);
    RETURN_IF_ERROR(CudaStatus(cub::DeviceSegmentedRadixSort::SortKeysDescending(
                                   cub_temp, temp, keys, sorted, static_cast<int>(items), p.batch,
                                   begin, begin + p.batch, 0, 64, stream),
                               "cub segmented sort (sampling)"));
  }
  DrawKernel<<<p.batch, 32, 0, stream>>>(p.logits, stride, p.vocab, drows, stats, sorted, p.vocab,
                                         p.out);
  return LaunchStatus("DrawKernel");
}

}  // namespace kvwire::kernels::cuda
