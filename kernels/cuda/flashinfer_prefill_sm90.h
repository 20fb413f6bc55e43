// FlashInfer's FA3 single prefill for Hopper (TMA loads, warp-specialised wgmma: sm_90a only),
// causal and GQA over dense bf16 rows ([len, heads, head_dim], the last qo_len query rows over
// every key), head_dim 64 or 128. Compiled for sm_90a alone where CMake's CUDA architectures
// include 90 (KVWIRE_HAVE_FA3); flashinfer_prefill.cu calls it on an sm_90 device and FA2
// elsewhere.
#pragma once

#include <cuda_runtime.h>

namespace kvwire::kernels::cuda {

cudaError_t FlashInferFa3Prefill(int head_dim, const void* q, const void* k, const void* v, void* o,
                                 int qo_len, int kv_len, int n_heads, int n_kv_heads, float scale,
                                 cudaStream_t stream);

}  // namespace kvwire::kernels::cuda
