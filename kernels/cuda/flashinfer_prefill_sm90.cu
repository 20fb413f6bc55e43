/* FlashInfer's FA3 single prefill (flashinfer_prefill_sm90.h), its template instantiated here
 * ahead of time for our head dims, as the Python package generates it from
 * single_prefill_sm90_kernel_inst.jinja at run time. Tested against
 * ReferenceBackend::PrefillAttention by BackendOpsTest.PrefillAttentionInBf16 on an sm_90 GPU. */
#include <flashinfer/attention/hopper/default_params.cuh>
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/cutlass_utils.cuh>

#include "kernels/cuda/flashinfer_prefill_sm90.h"

namespace kvwire::kernels::cuda {
namespace {

using Params = flashinfer::SinglePrefillParams<cutlass::bfloat16_t, cutlass::bfloat16_t,
                                               cutlass::bfloat16_t, int32_t>;

template <uint32_t D>
cudaError_t Run(Params& params, cudaStream_t stream) {
  return flashinfer::SinglePrefillWithKVCacheDispatched<D, D, flashinfer::MaskMode::kCausal,
                                                        /*LEFT_SLIDING_WINDOW=*/false,
                                                        flashinfer::StandardAttention>(params,
                                                                                       stream);
}

}  // namespace

cudaError_t FlashInferFa3Prefill(int head_dim, const void* q, const void* k, const void* v, void* o,
                                 int qo_len, int kv_len, int n_heads, int n_kv_heads, float scale,
                                 cudaStream_t stream) {
  Params params{};
  params.q_ptr = static_cast<cutlass::bfloat16_t*>(const_cast<void*>(q));
  params.k_ptr = static_cast<cutlass::bfloat16_t*>(const_cast<void*>(k));
  params.v_ptr = static_cast<cutlass::bfloat16_t*>(const_cast<void*>(v));
  params.o_ptr = static_cast<cutlass::bfloat16_t*>(o);
  params.lse_ptr = nullptr;  // (the epilogue skips it)
  params.additional_params.logits_soft_cap = 0.f;
  params.additional_params.sm_scale = scale;
  // Dense rows, NHD: a token's heads side by side.
  params.q_stride_n = params.o_stride_n = int64_t{n_heads} * head_dim;
  params.k_stride_n = params.v_stride_n = int64_t{n_kv_heads} * head_dim;
  params.q_stride_h = params.k_stride_h = params.v_stride_h = params.o_stride_h = head_dim;
  params.qo_len = qo_len;
  params.kv_len = kv_len;  // causal from the bottom right: row i sees keys <= i + kv - qo
  params.num_qo_heads = n_heads;
  params.num_kv_heads = n_kv_heads;
  params.group_size = n_heads / n_kv_heads;
  params.window_left = -1;
  params.causal = true;
  return head_dim == 64 ? Run<64>(params, stream) : Run<128>(params, stream);
}

}  // namespace kvwire::kernels::cuda
