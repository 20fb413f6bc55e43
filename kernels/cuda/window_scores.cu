/* The observation window's attention scores (SnapKV's: PrefillAttentionParams::window) for a
 * prefill whose attention FlashInfer computed, which returns no probabilities: the window's
 * queries gathered into [n_heads, window, head_dim], then per KV head one cuBLAS product of its
 * query heads' rows with every key (f32, strided-batched over the KV heads, written straight
 * into window_scores [n_heads, window, len]), then a causal softmax per row. The product is what
 * a GEMM is for; the plain kernel walked every key once per row on one warp. Tested against
 * ReferenceBackend::PrefillAttention by BackendOpsTest.PrefillAttentionInBf16 on cuda. */
#include <atomic>
#include <cub/block/block_reduce.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {
namespace {

std::atomic<int64_t> launches{0};
constexpr int kThreads = 256;

// out[h, i, :] = the query of head h in window row i (prompt row first + i).
__global__ void GatherWindowQueries(const float* __restrict__ q, int64_t q_stride, int first,
                                    int window, int n_heads, int d, float* __restrict__ out) {
  const int64_t total = int64_t{n_heads} * window * d;
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total;
       x += int64_t{gridDim.x} * blockDim.x) {
    const int e = static_cast<int>(x % d);
    const int i = static_cast<int>((x / d) % window);
    const int h = static_cast<int>(x / (int64_t{d} * window));
    out[x] = q[(first + i) * q_stride + int64_t{h} * d + e];
  }
}

// Row r = (head, window row i) of scaled logits, in place: softmax over keys 0..len-window+i,
// zero after (as the reference: the maximum, the exponentials' sum, each one over it).
__global__ void CausalSoftmaxRows(float* scores, int len, int window) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float shared;
  float* s = scores + int64_t{blockIdx.x} * len;
  const int last = len - window + static_cast<int>(blockIdx.x % window);
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= last; j += kThreads) mx = fmaxf(mx, s[j]);
  mx = Reduce(temp).Reduce(mx, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) shared = mx;
  __syncthreads();
  mx = shared;
  float sum = 0.f;
  for (int j = threadIdx.x; j <= last; j += kThreads) sum += __expf(s[j] - mx);
  __syncthreads();  // temp is reused
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) shared = sum;
  __syncthreads();
  const float inv = 1.f / shared;
  for (int j = threadIdx.x; j < len; j += kThreads)
    s[j] = j <= last ? __expf(s[j] - mx) * inv : 0.f;
}

}  // namespace

absl::Status LaunchWindowScores(const PrefillAttentionParams& p, cublasHandle_t cublas,
                                const OpMemory& mem, cudaStream_t stream) {
  if (p.window <= 0) return absl::OkStatus();
  const int group = p.n_heads / p.n_kv_heads, d = p.head_dim, w = p.window;
  const int64_t rows = int64_t{p.n_heads} * w;
  ASSIGN_OR_RETURN(void* gathered, mem.scratch(kScratchWork, sizeof(float) * rows * d));
  auto* qw = static_cast<float*>(gathered);
  const int blocks = static_cast<int>(std::min<int64_t>((rows * d + 255) / 256, 4096));
  GatherWindowQueries<<<blocks, 256, 0, stream>>>(p.q, p.q_stride, p.len - w, w, p.n_heads, d, qw);
  RETURN_IF_ERROR(LaunchStatus("GatherWindowQueries"));
  // Row-major S_g [group·w, len] = Q_g · K_gᵀ is column-major S_gᵀ = K_gᵀ(col-major) · Q_g: K_g
  // is column-major [d, len] at k + g·d with leading dimension kv_stride, Q_g [d, group·w].
  // The 64-bit API: K spans kv_stride · len elements, past 2^31 for an 8B model at 512K tokens.
  const float alpha = p.scale, beta = 0.f;
  const cublasStatus_t st = cublasSgemmStridedBatched_64(
      cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.len, int64_t{group} * w, d, &alpha, p.k, p.kv_stride, d,
      qw, d, int64_t{group} * w * d, &beta, p.window_scores, p.len, int64_t{group} * w * p.len,
      p.n_kv_heads);
  RETURN_IF_ERROR(CublasStatus(st, "cublasSgemmStridedBatched_64 (window scores)"));
  CausalSoftmaxRows<<<static_cast<int>(rows), kThreads, 0, stream>>>(p.window_scores, p.len, w);
  RETURN_IF_ERROR(LaunchStatus("CausalSoftmaxRows"));
  launches.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

int64_t WindowScoreLaunches() { return launches.load(std::memory_order_relaxed); }

}  // namespace kvwire::kernels::cuda
