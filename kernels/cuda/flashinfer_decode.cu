/* Decode attention through FlashInfer's batch decode (flashinfer_decode.h says which calls, and
 * how kvwire's caches map onto its page tables). Compiled with the CCCL that FlashInfer's wheel
 * bundles ahead of the toolkit's (kernels/CMakeLists.txt), and FlashInfer's templates
 * instantiated here ahead of time for our head dims, where its Python package would generate
 * them at run time. Tested against ReferenceBackend::DecodeAttention by
 * BackendOpsTest.DecodeAttentionWithoutProbabilities on cuda. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/flashinfer_decode.h"

namespace kvwire::kernels::cuda {
namespace {

std::atomic<int64_t> launches{0};

// The parameters FlashInfer's batch decode reads: those of its generated
// batch_decode_customize_config for the default attention variant (no RoPE in the kernel: our
// keys are cached after it; no sliding window, soft cap or ALiBi).
struct Params {
  using DTypeQ = float;
  using DTypeKV = __nv_bfloat16;
  using DTypeO = half;
  using IdType = int32_t;

  DTypeQ* q;
  flashinfer::paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;
  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;
  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;
  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;

  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t) const { return 1; }
  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};
using Variant =
    flashinfer::DefaultAttention</*use_custom_mask=*/false, /*use_sliding_window=*/false,
                                 /*use_logits_soft_cap=*/false, /*use_alibi=*/false>;
constexpr auto kNoRope = flashinfer::PosEncodingMode::kNone;

bool GroupDispatched(int group) {
  return group == 1 || group == 2 || group == 3 || group == 4 || group == 6 || group == 8 ||
         group == 16;
}

// Request r = (sequence r / n_cache_heads, cache head r % n_cache_heads): its page table's
// entries are the rows it attends, counted from k0 in rows of head_dim elements.
__global__ void RowIndices(const DecodeSequence* __restrict__ seqs, int n_cache_heads, int d,
                           int elem_bytes, const char* k0, const int32_t* __restrict__ indptr,
                           int32_t* __restrict__ rows) {
  const int r = blockIdx.x;
  const DecodeSequence& s = seqs[r / n_cache_heads];
  const int c = r % n_cache_heads;
  const int64_t base = (static_cast<const char*>(s.k) - k0) / (int64_t{d} * elem_bytes);
  const int begin = indptr[r], count = indptr[r + 1] - begin;
  for (int j = threadIdx.x; j < count; j += blockDim.x) {
    const int t = s.indices ? s.indices[int64_t{c} * s.num_indices + j] : j;
    rows[begin + j] = static_cast<int32_t>(base + s.layout.Row(c, t, d) / d);
  }
}

// FlashInfer's outputs, request by request ([sequence][query head][dim]), widened into each
// sequence's `out`.
__global__ void WidenOut(const DecodeSequence* __restrict__ seqs, int per_seq,
                         const half* __restrict__ o, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    seqs[i / per_seq].out[i % per_seq] = __half2float(o[i]);
  }
}

// The last decode plan a thread made, whatever its head dim: every Run<D> plans into the lane's
// one int workspace, so a plan kept per head dim could name another's contents.
struct LastPlan {
  uint64_t lane = 0, epoch = 0;
  uint32_t head_dim = 0;
  int group = 0;
  std::vector<int32_t> indptr;
  void* int_ws = nullptr;
  size_t float_bytes = 0;
  flashinfer::DecodePlanInfo plan;
};
thread_local LastPlan last_plan;

template <uint32_t D>
absl::Status Run(const DecodeAttentionParams& p, const DecodeSequence* seqs_device,
                 const OpMemory& mem, cudaStream_t stream) {
  const int group = p.n_heads / p.n_cache_heads;
  const int requests = p.batch * p.n_cache_heads;
  const DecodeSequence& first = p.seqs[0];
  const char* k0 = static_cast<const char*>(first.k);
  for (int s = 1; s < p.batch; ++s) k0 = std::min(k0, static_cast<const char*>(p.seqs[s].k));
  const int64_t v_minus_k =
      static_cast<const char*>(first.v) - static_cast<const char*>(first.k);  // bytes

  std::vector<int32_t> indptr(requests + 1, 0);
  for (int s = 0; s < p.batch; ++s) {
    const DecodeSequence& q = p.seqs[s];
    const int count = q.indices ? q.num_indices : q.len;
    for (int c = 0; c < p.n_cache_heads; ++c) {
      const int r = s * p.n_cache_heads + c;
      indptr[r + 1] = indptr[r] + count;
    }
  }
  const std::vector<int32_t> last_page_len(requests, 1);

  // Split-KV's work partition (FlashInfer's plan), on the host from the lengths: once per decode
  // step, since every layer of a step has the same lengths. The last plan made on this lane
  // stays in its int workspace, which nothing else writes, unless the copy that put it there
  // was dropped unrun (a new epoch). While the lane records a graph, the plan goes up from host
  // memory the graph reads when it runs. The plan is the one a step op by op makes (not
  // FlashInfer's for CUDA graphs, whose fixed grid splits every request and merges partial
  // outputs in f16): a step's graph is recorded anew each step, and its results stay those of
  // the step op by op.
  const bool graph = mem.recorded_host != nullptr;
  LastPlan& last = last_plan;
  size_t float_bytes = 0, int_bytes = 0;
  flashinfer::DecodePlanInfo plan;
  std::vector<uint8_t> int_pageable;
  void* int_host = nullptr;
  cudaError_t planned = cudaSuccess;
  const bool same = last.lane == mem.lane && mem.lane != 0 && last.epoch == mem.epoch &&
                    last.head_dim == D && last.group == group && last.indptr == indptr;
  void* float_ws = nullptr;
  void* int_ws = nullptr;
  if (same) {
    plan = last.plan;
    ASSIGN_OR_RETURN(float_ws,
                     mem.scratch(kScratchFlashInferFloat, std::max<size_t>(last.float_bytes, 16)));
    ASSIGN_OR_RETURN(int_ws, mem.scratch(kScratchFlashInferInt, 16));
  }
  if (!same || int_ws != last.int_ws) {
    DISPATCH_GQA_GROUP_SIZE(group, GROUP_SIZE, {
      auto estimate =
          flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP_SIZE, D, kNoRope,
                                                                          Variant, Params>;
      planned = flashinfer::DecodePlanWorkspaceSize<D, kNoRope, Variant, Params>(
          float_bytes, int_bytes, indptr.data(), requests, group, /*page_size=*/1,
          /*enable_cuda_graph=*/false, stream, estimate);
    });
    RETURN_IF_ERROR(CudaStatus(planned, "FlashInfer DecodePlanWorkspaceSize"));
    ASSIGN_OR_RETURN(float_ws,
                     mem.scratch(kScratchFlashInferFloat, std::max<size_t>(float_bytes, 16)));
    ASSIGN_OR_RETURN(int_ws, mem.scratch(kScratchFlashInferInt, std::max<size_t>(int_bytes, 16)));
    if (graph) {
      ASSIGN_OR_RETURN(int_host, mem.recorded_host(std::max<size_t>(int_bytes, 16)));
    } else {
      int_pageable.resize(std::max<size_t>(int_bytes, 16));
      int_host = int_pageable.data();
    }
    DISPATCH_GQA_GROUP_SIZE(group, GROUP_SIZE, {
      auto estimate =
          flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP_SIZE, D, kNoRope,
                                                                          Variant, Params>;
      // Pageable int_host: the copy FlashInfer queues from it is staged before it returns.
      planned = flashinfer::DecodePlan<D, kNoRope, Variant, Params>(
          float_ws, float_bytes, int_ws, int_host, int_bytes, plan, indptr.data(), requests, group,
          /*page_size=*/1, /*enable_cuda_graph=*/false, stream, estimate);
    });
    RETURN_IF_ERROR(CudaStatus(planned, "FlashInfer DecodePlan"));
    last.lane = mem.lane;
    last.head_dim = D;
    last.epoch = mem.epoch;
    last.group = group;
    last.indptr = indptr;
    last.int_ws = int_ws;
    last.float_bytes = float_bytes;
    last.plan = plan;
  }

  // The page tables: each request's rows, made on the device from the sequences' layouts.
  ASSIGN_OR_RETURN(void* indptr_d, mem.table(kTableFlashInferIndptr, indptr.data(),
                                             sizeof(int32_t) * indptr.size()));
  ASSIGN_OR_RETURN(void* last_d, mem.table(kTableFlashInferLastPage, last_page_len.data(),
                                           sizeof(int32_t) * last_page_len.size()));
  const int elem_bytes = static_cast<int>(DTypeSize(p.kv_dtype));
  ASSIGN_OR_RETURN(void* rows_d, mem.scratch(kScratchFlashInferRows,
                                             sizeof(int32_t) * std::max(indptr.back(), 1)));
  RowIndices<<<requests, 128, 0, stream>>>(seqs_device, p.n_cache_heads, p.head_dim, elem_bytes, k0,
                                           static_cast<const int32_t*>(indptr_d),
                                           static_cast<int32_t*>(rows_d));
  RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "FlashInfer RowIndices"));

  // Queries: the batch's rows where they lie when they are one array, else gathered.
  const int64_t per_seq = int64_t{p.n_heads} * p.head_dim;
  bool contiguous = true;
  for (int s = 1; s < p.batch; ++s) contiguous &= p.seqs[s].q == first.q + s * per_seq;
  float* q = const_cast<float*>(first.q);
  if (!contiguous) {
    ASSIGN_OR_RETURN(void* gathered,
                     mem.scratch(kScratchFlashInferQ, sizeof(float) * per_seq * p.batch));
    q = static_cast<float*>(gathered);
    for (int s = 0; s < p.batch; ++s) {
      RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(q + s * per_seq, p.seqs[s].q, sizeof(float) * per_seq,
                                     cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync (FlashInfer queries)"));
    }
  }
  ASSIGN_OR_RETURN(void* o, mem.scratch(kScratchFlashInferOut, sizeof(half) * per_seq * p.batch));

  // One KV head per request, pages of one row: a page is head_dim elements.
  auto* k = reinterpret_cast<__nv_bfloat16*>(const_cast<char*>(k0));
  auto* v = reinterpret_cast<__nv_bfloat16*>(const_cast<char*>(k0) + v_minus_k);
  const int64_t strides[4] = {p.head_dim, p.head_dim, p.head_dim, 1};  // page, head, entry, dim
  flashinfer::paged_kv_t<__nv_bfloat16, int32_t> paged(
      /*num_heads=*/1, /*page_size=*/1, D, requests, flashinfer::QKVLayout::kHND, k, v, strides,
      static_cast<int32_t*>(rows_d), static_cast<int32_t*>(indptr_d),
      static_cast<int32_t*>(last_d));
  Params params{};
  params.q = q;
  params.paged_kv = paged;
  params.o = static_cast<half*>(o);
  params.lse = nullptr;
  params.maybe_alibi_slopes = nullptr;
  params.logits_soft_cap = 0.0;
  params.sm_scale = p.scale;
  params.rope_rcp_scale = 1.0;
  params.rope_rcp_theta = 1.0;
  params.num_qo_heads = group;
  params.q_stride_n = group * p.head_dim;
  params.q_stride_h = p.head_dim;
  params.window_left = -1;
  params.enable_pdl = false;
  params.request_indices =
      flashinfer::GetPtrFromBaseOffset<int32_t>(int_ws, plan.request_indices_offset);
  params.kv_tile_indices =
      flashinfer::GetPtrFromBaseOffset<int32_t>(int_ws, plan.kv_tile_indices_offset);
  params.o_indptr = flashinfer::GetPtrFromBaseOffset<int32_t>(int_ws, plan.o_indptr_offset);
  params.kv_chunk_size_ptr =
      flashinfer::GetPtrFromBaseOffset<int32_t>(int_ws, plan.kv_chunk_size_ptr_offset);
  // Split-KV's blocks past the partitioned requests idle by it (none without CUDA-graph plans).
  params.block_valid_mask =
      plan.split_kv ? flashinfer::GetPtrFromBaseOffset<bool>(int_ws, plan.block_valid_mask_offset)
                    : nullptr;
  params.partition_kv = false;
  params.padded_batch_size = plan.padded_batch_size;
  half* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (plan.split_kv) {
    tmp_v = flashinfer::GetPtrFromBaseOffset<half>(float_ws, plan.v_offset);
    tmp_s = flashinfer::GetPtrFromBaseOffset<float>(float_ws, plan.s_offset);
  }
  RETURN_IF_ERROR(CudaStatus(flashinfer::BatchDecodeWithPagedKVCacheDispatched<D, kNoRope, Variant>(
                                 params, tmp_v, tmp_s, /*enable_pdl=*/false, stream),
                             "FlashInfer BatchDecodeWithPagedKVCache"));

  const int64_t n = per_seq * p.batch;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  WidenOut<<<blocks, 256, 0, stream>>>(seqs_device, static_cast<int>(per_seq),
                                       static_cast<const half*>(o), n);
  RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "FlashInfer WidenOut"));
  launches.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace

bool FlashInferDecodeServes(const DecodeAttentionParams& p) {
  if (p.kv_dtype != DType::kBF16 || (p.head_dim != 64 && p.head_dim != 128) || p.batch < 1 ||
      p.n_cache_heads < 1 || p.n_heads % p.n_cache_heads != 0 ||
      !GroupDispatched(p.n_heads / p.n_cache_heads)) {
    return false;
  }
  const DecodeSequence& first = p.seqs[0];
  const int64_t row_bytes = int64_t{p.head_dim} * 2;
  const auto* k0 = static_cast<const char*>(first.k);
  const int64_t v_minus_k = static_cast<const char*>(first.v) - k0;
  if (v_minus_k % row_bytes != 0) return false;
  int64_t rows = 0;
  for (int s = 0; s < p.batch; ++s) {
    const DecodeSequence& q = p.seqs[s];
    // Paged caches in the dtype, no probabilities; one K-to-V distance for the whole batch
    // (FlashInfer takes one base for each), rows at whole head_dims from one another.
    if (q.layout.pages == nullptr || q.coding.coded() || q.probs != nullptr) return false;
    const int count = q.indices ? q.num_indices : q.len;
    if (count < 1) return false;
    const auto* k = static_cast<const char*>(q.k);
    if (static_cast<const char*>(q.v) - k != v_minus_k || (k - k0) % row_bytes != 0) return false;
    if (q.layout.page_stride % p.head_dim != 0) return false;
    rows += int64_t{count} * p.n_cache_heads;
  }
  return rows < (int64_t{1} << 31);
}

absl::Status LaunchFlashInferDecode(const DecodeAttentionParams& p,
                                    const DecodeSequence* seqs_device, const OpMemory& mem,
                                    cudaStream_t stream) {
  // FlashInfer reports a group size it does not dispatch by throwing (checked above, and kept
  // from unwinding through our callers here).
  try {
    return p.head_dim == 64 ? Run<64>(p, seqs_device, mem, stream)
                            : Run<128>(p, seqs_device, mem, stream);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("FlashInfer batch decode: ", e.what()));
  }
}

int64_t FlashInferDecodeLaunches() { return launches.load(std::memory_order_relaxed); }

}  // namespace kvwire::kernels::cuda
