/* Prefill attention through FlashInfer's single prefill (flashinfer_prefill.h), its template
 * instantiated here ahead of time for our head dims. Tested against
 * ReferenceBackend::PrefillAttention by BackendOpsTest.PrefillAttentionInBf16 on cuda. */
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/fastdiv.cuh>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/flashinfer_prefill.h"
#if KVWIRE_HAVE_FA3
#include "kernels/cuda/flashinfer_prefill_sm90.h"
#endif

namespace kvwire::kernels::cuda {
namespace {

std::atomic<int64_t> launches{0}, fa3_launches{0};

// The parameters of FlashInfer's generated single_prefill_customize_config for its FA2 default
// attention variant (no RoPE in the kernel: our keys come rotated; no mask beyond causal).
struct Params {
  using DTypeQ = __nv_bfloat16;
  using DTypeKV = __nv_bfloat16;
  using DTypeO = __nv_bfloat16;
  using IdType = int32_t;
  DTypeQ* q;
  DTypeKV* k;
  DTypeKV* v;
  DTypeO* o;
  float* lse;
  flashinfer::uint_fastdiv group_size;
  uint8_t* maybe_custom_mask;
  float* maybe_alibi_slopes;
  uint8_t* maybe_k_cache_sf;
  uint8_t* maybe_v_cache_sf;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;
  uint32_t qo_len;
  uint32_t kv_len;
  uint32_t num_qo_heads;
  uint32_t num_kv_heads;
  uint32_t q_stride_n;
  uint32_t q_stride_h;
  uint32_t k_stride_n;
  uint32_t k_stride_h;
  uint32_t v_stride_n;
  uint32_t v_stride_h;
  uint32_t head_dim;
  int32_t window_left;
  bool partition_kv;

  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t) const { return qo_len; }
  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t) const { return kv_len; }
};
using Variant =
    flashinfer::DefaultAttention</*use_custom_mask=*/false, /*use_sliding_window=*/false,
                                 /*use_logits_soft_cap=*/false, /*use_alibi=*/false>;

// Rows [0, rows) of `cols` floats each, `stride` apart, into dense bf16 rows.
__global__ void ToBf16Rows(const float* __restrict__ src, int64_t stride, int64_t rows, int cols,
                           __nv_bfloat16* __restrict__ dst) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __float2bfloat16(src[(i / cols) * stride + i % cols]);
  }
}

__global__ void WidenRows(const __nv_bfloat16* __restrict__ src, int64_t rows, int cols,
                          float* __restrict__ dst, int64_t stride) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[(i / cols) * stride + i % cols] = __bfloat162float(src[i]);
  }
}

int Blocks(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 8192)); }

// FlashInfer's bf16 output rows widened into `out` from row q_begin on; the call counted.
absl::Status Widen(const PrefillAttentionParams& p, const __nv_bfloat16* oh, int64_t qo, int q_cols,
                   cudaStream_t stream) {
  WidenRows<<<Blocks(qo * q_cols), 256, 0, stream>>>(
      oh, qo, q_cols, p.out + p.q_begin * p.out_stride, p.out_stride);
  RETURN_IF_ERROR(LaunchStatus("FlashInfer prefill WidenRows"));
  launches.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

template <uint32_t D>
absl::Status Run(const PrefillAttentionParams& p, const OpMemory& mem, cudaStream_t stream,
                 bool fa3) {
  const int64_t qo = p.len - p.q_begin, kv = p.len;
  const int q_cols = p.n_heads * p.head_dim, kv_cols = p.n_kv_heads * p.head_dim;
  ASSIGN_OR_RETURN(void* q, mem.scratch(kScratchFlashInferQ, sizeof(__nv_bfloat16) * qo * q_cols));
  ASSIGN_OR_RETURN(void* k, mem.scratch(kScratchFlashInferK, sizeof(__nv_bfloat16) * kv * kv_cols));
  ASSIGN_OR_RETURN(void* v, mem.scratch(kScratchFlashInferV, sizeof(__nv_bfloat16) * kv * kv_cols));
  ASSIGN_OR_RETURN(void* o,
                   mem.scratch(kScratchFlashInferOut, sizeof(__nv_bfloat16) * qo * q_cols));
  auto* qh = static_cast<__nv_bfloat16*>(q);
  auto* kh = static_cast<__nv_bfloat16*>(k);
  auto* vh = static_cast<__nv_bfloat16*>(v);
  auto* oh = static_cast<__nv_bfloat16*>(o);
  ToBf16Rows<<<Blocks(qo * q_cols), 256, 0, stream>>>(p.q + p.q_begin * p.q_stride, p.q_stride, qo,
                                                      q_cols, qh);
  ToBf16Rows<<<Blocks(kv * kv_cols), 256, 0, stream>>>(p.k, p.kv_stride, kv, kv_cols, kh);
  ToBf16Rows<<<Blocks(kv * kv_cols), 256, 0, stream>>>(p.v, p.kv_stride, kv, kv_cols, vh);
  RETURN_IF_ERROR(LaunchStatus("FlashInfer prefill ToBf16Rows"));

#if KVWIRE_HAVE_FA3
  if (fa3) {
    RETURN_IF_ERROR(CudaStatus(
        FlashInferFa3Prefill(D, qh, kh, vh, oh, static_cast<int>(qo), static_cast<int>(kv),
                             p.n_heads, p.n_kv_heads, p.scale, stream),
        "FlashInfer SinglePrefillWithKVCache (FA3, sm_90a)"));
    fa3_launches.fetch_add(1, std::memory_order_relaxed);
    return Widen(p, oh, qo, q_cols, stream);
  }
#endif
  Params params{};
  params.q = qh;
  params.k = kh;
  params.v = vh;
  params.o = oh;
  params.lse = nullptr;
  params.group_size = flashinfer::uint_fastdiv(p.n_heads / p.n_kv_heads);
  params.logits_soft_cap = 0.0;
  params.sm_scale = p.scale;
  params.rope_rcp_scale = 1.0;
  params.rope_rcp_theta = 1.0;
  params.qo_len = static_cast<uint32_t>(qo);
  params.kv_len = static_cast<uint32_t>(kv);
  params.num_qo_heads = p.n_heads;
  params.num_kv_heads = p.n_kv_heads;
  params.q_stride_n = q_cols;
  params.q_stride_h = p.head_dim;
  params.k_stride_n = params.v_stride_n = kv_cols;
  params.k_stride_h = params.v_stride_h = p.head_dim;
  params.head_dim = p.head_dim;
  params.window_left = -1;
  params.partition_kv = false;
  // No split-KV workspace (tmp null): a prompt's rows give the grid its work.
  RETURN_IF_ERROR(CudaStatus(
      flashinfer::SinglePrefillWithKVCacheDispatched<D, D, flashinfer::PosEncodingMode::kNone,
                                                     /*USE_FP16_QK_REDUCTION=*/false,
                                                     flashinfer::MaskMode::kCausal, Variant>(
          params, /*tmp=*/nullptr, stream),
      "FlashInfer SinglePrefillWithKVCache"));
  return Widen(p, oh, qo, q_cols, stream);
}

}  // namespace

bool FlashInferPrefillServes(const PrefillAttentionParams& p) {
  return p.precision == DType::kBF16 && (p.head_dim == 64 || p.head_dim == 128) &&
         p.len - p.q_begin >= 1 && int64_t{p.len} * p.n_heads * p.head_dim < (int64_t{1} << 31);
}

bool FlashInferFa3Serves() {
#if KVWIRE_HAVE_FA3
  int device = 0, major = 0, minor = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
#else
  return false;
#endif
}

absl::Status LaunchFlashInferPrefill(const PrefillAttentionParams& p, const OpMemory& mem,
                                     cudaStream_t stream, bool fa3) {
  try {  // FlashInfer reports what it cannot run by throwing
    return p.head_dim == 64 ? Run<64>(p, mem, stream, fa3) : Run<128>(p, mem, stream, fa3);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("FlashInfer single prefill: ", e.what()));
  }
}

int64_t FlashInferPrefillLaunches() { return launches.load(std::memory_order_relaxed); }
int64_t FlashInferFa3PrefillLaunches() { return fa3_launches.load(std::memory_order_relaxed); }

}  // namespace kvwire::kernels::cuda
