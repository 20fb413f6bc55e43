// Helpers shared by the CUDA kernels: status conversion, element loads and stores, warp
// reductions.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "kernels/cuda/dispatch.cuh"  // after CUDA's element types (cuda_bf16.h, cuda_fp16.h)

namespace kvwire::kernels::cuda {

// A failed call's error also stays in the runtime's last-error slot, where the next launch's
// check (LaunchStatus) would find it and blame that kernel: a non-sticky error (an allocation
// that failed) is cleared here, once reported. A sticky one (a fault inside a kernel) stays
// and fails every later call, as it must.
// Whether `err` leaves the context unusable (every later call fails with it until the process
// restarts), as CUDA's documentation lists them.
inline bool StickyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
      return true;
    default:
      return false;
  }
}
// The process's first sticky error, recorded by CudaStatus (cuda_backend.cu); the CUDA backend's
// fault() reports it.
void RecordStickyError(const absl::Status& status);

inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  absl::Status st = absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
  if (StickyCudaError(err)) RecordStickyError(st);
  return st;
}

// A cuBLAS call's status; on failure the launch error it may have left is cleared with it, as
// CudaStatus clears its own, so that the next kernel's check does not take it for its own.
inline absl::Status CublasStatus(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, " failed: ", cublasGetStatusString(st)));
}

// Checks the launch itself; errors inside the kernel surface at the next synchronisation.
inline absl::Status LaunchStatus(const char* kernel) {
  return CudaStatus(cudaGetLastError(), kernel);
}

template <typename T>
__device__ __forceinline__ float ToF32(T v);
template <>
__device__ __forceinline__ float ToF32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float ToF32<__half>(__half v) {
  return __half2float(v);
}

// Float32 to an element type, rounding to nearest even (as FromFloat on the host).
template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromF32<__half>(float v) {
  return __float2half_rn(v);
}

// The block's dynamic shared memory (the launch's third parameter) as T.
template <typename T>
__device__ __forceinline__ T* DynamicShared() {
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  return reinterpret_cast<T*>(dynamic_shared);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace kvwire::kernels::cuda
