// Entry points of the CUDA kernels, one per .cu file; cuda_backend.cu calls them. Each checks
// its parameters (kernels/validate.h) except MatMul, AppendKv and DecodeAttention, whose
// parameters the backend checks first because it sizes scratch or op tables from them.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace kvwire::kernels::cuda {

absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);
absl::Status LaunchRope(const RopeParams& p, cudaStream_t stream);
absl::Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream);
// `scratch` is a device buffer of at least MatMulScratchBytes(p) bytes.
size_t MatMulScratchBytes(const MatMulParams& p);
absl::Status LaunchMatMul(const MatMulParams& p, cublasHandle_t cublas, void* scratch,
                          cudaStream_t stream);
absl::Status LaunchAdd(const AddParams& p, cudaStream_t stream);
// `seqs_device` is p.seqs copied to device memory.
absl::Status LaunchAppendKv(const AppendKvParams& p, const KvAppend* seqs_device,
                            cudaStream_t stream);
absl::Status LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream);
// `seqs_device` is p.seqs copied to device memory.
absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p,
                                   const DecodeSequence* seqs_device, cudaStream_t stream);

}  // namespace kvwire::kernels::cuda
