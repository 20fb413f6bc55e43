/* MatMul y[m, n] = x[m, k] · Wᵀ (+ bias), W row-major [n, k] in f32, bf16 or f16.
 *
 * With bf16 W, x is rounded to bf16 first (backend.h): each product is then exact in
 * float32, as on tensor cores.
 *
 * Decode-sized m (≤ kGemvMaxRows; against bf16 W, one row unless asked for more): a GEMV
 * (matmul.cuh), each warp 1, 2 or 4 rows of W.
 *
 * Otherwise cuBLAS. bf16 W: x rounded to bf16 into scratch, then cublasGemmEx with
 * bf16 inputs and float32 accumulation and output (the tensor cores). f32 W: cublasSgemm
 * (no TF32: the product is float32's). f16 W: widened to float32 in scratch, then
 * cublasSgemm, since the reference multiplies unrounded x by f16 W. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/matmul.cuh"

namespace kvwire::kernels::cuda {
namespace {

static_assert(decode_gemv::kGemvMaxRows == cuda::kGemvMaxRows);

template <typename T>
__global__ void WidenKernel(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[t] = ToF32(src[t]);
  }
}

// x [m, k] (row stride xs) rounded to bf16, packed [m, k].
__global__ void RoundToBf16Kernel(const float* __restrict__ x, int64_t xs, __nv_bfloat16* dst,
                                  int m, int k) {
  const int64_t total = static_cast<int64_t>(m) * k;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[t] = __float2bfloat16_rn(x[(t / k) * xs + t % k]);
  }
}

__global__ void AddBiasKernel(float* y, int64_t ys, const float* __restrict__ bias, int m, int n) {
  const int64_t total = static_cast<int64_t>(m) * n;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[(t / n) * ys + t % n] += bias[t % n];
  }
}

template <typename T, int M, bool kRoundX>
absl::Status LaunchGemvKernel(const MatMulParams& p, const decode_gemv::GemvPlan& g, int64_t ys,
                              cudaStream_t stream) {
  const T* w = static_cast<const T*>(p.w);
  if (g.vec) {
    decode_gemv::GemvKernel<T, M, true, kRoundX>
        <<<g.blocks, g.threads, 0, stream>>>(g.x, g.xs, g.x_vec, w, p.bias, p.y, ys, p.m, p.n, p.k);
  } else {
    decode_gemv::GemvKernel<T, M, false, kRoundX>
        <<<g.blocks, g.threads, 0, stream>>>(g.x, g.xs, false, w, p.bias, p.y, ys, p.m, p.n, p.k);
  }
  return LaunchStatus("GemvKernel");
}

template <typename T, int M>
absl::Status LaunchGemv(const MatMulParams& p, int64_t xs, int64_t ys, void* scratch,
                        cudaStream_t stream) {
  const decode_gemv::GemvPlan g = decode_gemv::PlanGemv<M>(p, xs, scratch, sizeof(T));
  if (!g.round_first) return LaunchGemvKernel<T, M, true>(p, g, ys, stream);
  // Rounding first is for bf16 W and two rows or more, which DispatchRows gives an M > 1.
  if constexpr (std::is_same_v<T, __nv_bfloat16> && M > 1) {
    const int64_t total = static_cast<int64_t>(p.m) * p.k;
    decode_gemv::RoundRowsKernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
        p.x, xs, static_cast<float*>(scratch), p.m, p.k);
    RETURN_IF_ERROR(LaunchStatus("RoundRowsKernel"));
    return LaunchGemvKernel<T, M, false>(p, g, ys, stream);
  } else {
    return absl::InternalError(absl::StrCat("MatMul: the GEMV for ", M, " rows of x against ",
                                            DTypeName(p.w_dtype), " W does not round x first"));
  }
}

int GridFor(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
}

// Whether a call runs on the GEMV. Against bf16 W only for one row of x unless asked: for more it
// reads x rounded beforehand (RoundRowsKernel, as cuBLAS's path does; it once rounded each
// element per row of W, an F2F beside every FFMA, near a third of the memory's rate at 8 rows),
// which has not yet run on a GPU beside cuBLAS's tensor cores. gpu_bench sets the two side by
// side per batch: what this switch is to be set by.
bool Gemv(const MatMulParams& p, MatMulKernel kernel) {
  if (kernel != MatMulKernel::kAuto) return kernel == MatMulKernel::kGemv;
  return p.m <= (p.w_dtype == DType::kBF16 ? 1 : kGemvMaxRows);
}

}  // namespace

size_t MatMulScratchBytes(const MatMulParams& p, MatMulKernel kernel) {
  if (Gemv(p, kernel)) return decode_gemv::GemvScratchBytes(p);
  switch (p.w_dtype) {
    case DType::kBF16:
      return static_cast<size_t>(p.m) * p.k * sizeof(__nv_bfloat16);
    case DType::kF16:
      return static_cast<size_t>(p.n) * p.k * sizeof(float);
    case DType::kF32:
      return 0;
  }
  return 0;
}

absl::Status LaunchMatMul(const MatMulParams& p, cublasHandle_t cublas, void* scratch,
                          cudaStream_t stream, MatMulKernel kernel) {
  const int64_t xs = p.x_stride ? p.x_stride : p.k;
  const int64_t ys = p.y_stride ? p.y_stride : p.n;
  if (Gemv(p, kernel) && p.m > kGemvMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("MatMul: the GEMV takes up to ", kGemvMaxRows, " rows, got ", p.m));
  }
  if (MatMulScratchBytes(p, kernel) > 0 && scratch == nullptr) {
    return absl::InternalError("MatMul: no scratch buffer");
  }
  if (Gemv(p, kernel)) {
    return DispatchDType(p.w_dtype, [&]<typename T>() {
      return decode_gemv::DispatchRows(
          p.m, [&]<int M>() { return LaunchGemv<T, M>(p, xs, ys, scratch, stream); });
    });
  }
  // Row-major Y = X·Wᵀ is column-major Yᵀ = W_cmᵀ · X_cm with W_cm = [k, n], X_cm = [k, m].
  // Through cuBLAS's 64-bit API: a 16K-token prefill's logits over a 128K vocabulary are 2^31
  // elements.
  const float alpha = 1.f, beta = 0.f;
  cublasStatus_t st;
  const char* call;
  if (p.w_dtype == DType::kBF16) {
    auto* xb = static_cast<__nv_bfloat16*>(scratch);
    RoundToBf16Kernel<<<GridFor(static_cast<int64_t>(p.m) * p.k), 256, 0, stream>>>(p.x, xs, xb,
                                                                                    p.m, p.k);
    RETURN_IF_ERROR(LaunchStatus("RoundToBf16Kernel"));
    call = "cublasGemmEx_64 (bf16 x bf16 -> f32)";
    st = cublasGemmEx_64(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, p.w, CUDA_R_16BF,
                         p.k, xb, CUDA_R_16BF, p.k, &beta, p.y, CUDA_R_32F, ys, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
  } else {
    const float* wf = static_cast<const float*>(p.w);
    if (p.w_dtype == DType::kF16) {
      const int64_t total = static_cast<int64_t>(p.n) * p.k;
      WidenKernel<__half><<<GridFor(total), 256, 0, stream>>>(static_cast<const __half*>(p.w),
                                                              static_cast<float*>(scratch), total);
      RETURN_IF_ERROR(LaunchStatus("WidenKernel"));
      wf = static_cast<const float*>(scratch);
    }
    call = "cublasSgemm_64";
    st = cublasSgemm_64(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, wf, p.k, p.x, xs,
                        &beta, p.y, ys);
  }
  RETURN_IF_ERROR(CublasStatus(st, call));
  if (p.bias) {
    AddBiasKernel<<<GridFor(static_cast<int64_t>(p.m) * p.n), 256, 0, stream>>>(p.y, ys, p.bias,
                                                                                p.m, p.n);
    return LaunchStatus("AddBiasKernel");
  }
  return absl::OkStatus();
}

}  // namespace kvwire::kernels::cuda
