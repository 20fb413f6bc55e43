/* The device's two ceilings, measured in the same run as what is compared against them
 * (bench/gpu_bench.cc): a device-to-device copy and cuBLAS's bf16 GEMM. Each is the median
 * of timed repetitions (CUDA events) after warm-ups, on random data. */
#include <cublas_v2.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda_backend.h"

namespace kvwire::kernels {
namespace {

using cuda::CublasStatus;
using cuda::CudaStatus;

__global__ void FillRandomBf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // SplitMix64 of the index: uniform in [-1, 1).
    uint64_t x = seed + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    p[i] = __float2bfloat16(static_cast<float>(x >> 40) * 0x1.0p-23f - 1.f);
  }
}

// Device buffers and events freed on every path.
struct Scope {
  std::vector<void*> buffers;
  cudaEvent_t start = nullptr, stop = nullptr;
  cublasHandle_t cublas = nullptr;
  ~Scope() {
    for (void* p : buffers) cudaFree(p);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (cublas) cublasDestroy(cublas);
  }
  absl::StatusOr<void*> Alloc(size_t bytes) {
    void* p = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc"));
    buffers.push_back(p);
    return p;
  }
  absl::Status Events() {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&start), "cudaEventCreate"));
    return CudaStatus(cudaEventCreate(&stop), "cudaEventCreate");
  }
  // Median milliseconds of `reps` runs of f after `warm` untimed ones.
  template <typename F>
  absl::StatusOr<double> MedianMs(int warm, int reps, F&& f) {
    for (int i = 0; i < warm; ++i) RETURN_IF_ERROR(f());
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(start), "cudaEventRecord"));
      RETURN_IF_ERROR(f());
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(stop), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(stop), "cudaEventSynchronize"));
      float t = 0;
      RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime"));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

}  // namespace

absl::StatusOr<std::string> CudaDeviceName() {
  if (!CudaDevicePresent()) return absl::UnavailableError("no GPU is visible");
  int dev = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&dev), "cudaGetDevice"));
  cudaDeviceProp prop;
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties"));
  return absl::StrCat(prop.name, ", ", prop.multiProcessorCount, " SMs, ",
                      prop.totalGlobalMem >> 30, " GiB");
}

absl::StatusOr<double> CudaCopyBandwidth(size_t bytes) {
  Scope s;
  RETURN_IF_ERROR(s.Events());
  ASSIGN_OR_RETURN(void* a, s.Alloc(bytes));
  ASSIGN_OR_RETURN(void* b, s.Alloc(bytes));
  FillRandomBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(a), bytes / 2, 7);
  RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "FillRandomBf16"));
  ASSIGN_OR_RETURN(const double ms, s.MedianMs(3, 20, [&] {
    return CudaStatus(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy D2D");
  }));
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

absl::StatusOr<double> CudaBf16GemmFlops(int m, int n, int k) {
  Scope s;
  RETURN_IF_ERROR(s.Events());
  if (cublasCreate(&s.cublas) != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError("cublasCreate failed");
  }
  ASSIGN_OR_RETURN(void* a, s.Alloc(size_t{2} * m * k));
  ASSIGN_OR_RETURN(void* b, s.Alloc(size_t{2} * n * k));
  ASSIGN_OR_RETURN(void* c, s.Alloc(size_t{4} * m * n));
  FillRandomBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(a), int64_t{m} * k, 1);
  FillRandomBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(b), int64_t{n} * k, 2);
  RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "FillRandomBf16"));
  const float alpha = 1.f, beta = 0.f;
  // The engine's prefill call: bf16 inputs, float32 accumulation and output.
  ASSIGN_OR_RETURN(const double ms, s.MedianMs(3, 10, [&]() -> absl::Status {
    const cublasStatus_t st = cublasGemmEx(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, b,
                                           CUDA_R_16BF, k, a, CUDA_R_16BF, k, &beta, c, CUDA_R_32F,
                                           n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    return CublasStatus(st, "cublasGemmEx");
  }));
  return 2.0 * m * n * k / (ms * 1e-3);
}

absl::StatusOr<DecodeMatMulRates> CudaDecodeMatMulRates(int m, int n, int k) {
  if (m < 1 || m > 16 || n < 1 || k < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode MatMul rates need 1 <= m <= 16 and n, k >= 1, got m=", m, " n=", n, " k=", k));
  }
  Scope s;
  RETURN_IF_ERROR(s.Events());
  if (cublasCreate(&s.cublas) != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError("cublasCreate failed");
  }
  ASSIGN_OR_RETURN(void* w, s.Alloc(size_t{2} * n * k));
  ASSIGN_OR_RETURN(void* x, s.Alloc(size_t{4} * m * k));
  ASSIGN_OR_RETURN(void* y, s.Alloc(size_t{4} * m * n));
  FillRandomBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w), int64_t{n} * k, 3);
  RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "FillRandomBf16"));
  MatMulParams p;
  p.x = static_cast<const float*>(x);
  p.w = w;
  p.w_dtype = DType::kBF16;
  p.y = static_cast<float*>(y);
  p.m = m;
  p.n = n;
  p.k = k;
  // x's values do not change the time; zeros will do. xb is where each kernel rounds x to bf16.
  RETURN_IF_ERROR(CudaStatus(cudaMemset(x, 0, size_t{4} * m * k), "cudaMemset"));
  ASSIGN_OR_RETURN(void* xb,
                   s.Alloc(std::max(cuda::MatMulScratchBytes(p, cuda::MatMulKernel::kGemv),
                                    cuda::MatMulScratchBytes(p, cuda::MatMulKernel::kCublas))));
  DecodeMatMulRates rates;
  for (const auto kernel : {cuda::MatMulKernel::kGemv, cuda::MatMulKernel::kCublas}) {
    ASSIGN_OR_RETURN(const double ms, s.MedianMs(3, 20, [&] {
      return cuda::LaunchMatMul(p, s.cublas, xb, /*stream=*/nullptr, kernel);
    }));
    const double rate = 2.0 * n * k / (ms * 1e-3);
    (kernel == cuda::MatMulKernel::kGemv ? rates.gemv : rates.cublas) = rate;
  }
  return rates;
}

}  // namespace kvwire::kernels
