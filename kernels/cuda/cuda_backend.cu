/* The CUDA backend: device memory, one stream, a cuBLAS handle, and the op launchers of
 * this folder. Ops are asynchronous on the stream; Synchronize (or a copy to the host)
 * waits and surfaces any error raised inside a kernel. */
#include <memory>
#include <mutex>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda_backend.h"

namespace kvwire::kernels {
namespace {

using cuda::CudaStatus;

class CudaBackend final : public KernelBackend {
 public:
  CudaBackend(cudaStream_t stream, cublasHandle_t cublas) : stream_(stream), cublas_(cublas) {}
  ~CudaBackend() override {
    if (scratch_) cudaFree(scratch_);
    if (seqs_.data) cudaFree(seqs_.data);
    if (append_.data) cudaFree(append_.data);
    cublasDestroy(cublas_);
    cudaStreamDestroy(stream_);
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  bool host_addressable() const override { return false; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc"));
    return p;
  }
  void Free(void* ptr) override { cudaFree(ptr); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                      "cudaMemcpy to device");
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                               "cudaMemcpy to host"));
    return Synchronize();
  }
  absl::Status Synchronize() override {
    return CudaStatus(cudaStreamSynchronize(stream_), "kernel execution");
  }

  absl::Status MatMul(const MatMulParams& p) override {
    void* scratch = nullptr;
    if (const size_t bytes = cuda::MatMulScratchBytes(p); bytes > 0) {
      ASSIGN_OR_RETURN(scratch, Scratch(bytes));
    }
    return cuda::LaunchMatMul(p, cublas_, scratch, stream_);
  }
  absl::Status Add(const AddParams& p) override { return cuda::LaunchAdd(p, stream_); }
  absl::Status AppendKv(const AppendKvParams& p) override {
    ASSIGN_OR_RETURN(void* table, Table(&append_, p.seqs, sizeof(KvAppend) * p.batch));
    return cuda::LaunchAppendKv(p, static_cast<const KvAppend*>(table), stream_);
  }
  absl::Status RmsNorm(const RmsNormParams& p) override { return cuda::LaunchRmsNorm(p, stream_); }
  absl::Status Rope(const RopeParams& p) override { return cuda::LaunchRope(p, stream_); }
  absl::Status SwiGlu(const SwiGluParams& p) override { return cuda::LaunchSwiGlu(p, stream_); }
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    return cuda::LaunchPrefillAttention(p, stream_);
  }
  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    ASSIGN_OR_RETURN(void* table, Table(&seqs_, p.seqs, sizeof(DecodeSequence) * p.batch));
    return cuda::LaunchDecodeAttention(p, static_cast<const DecodeSequence*>(table), stream_);
  }

 private:
  // A per-op table of host structs (the batch's sequences) copied to the device for a launch.
  // The copy is queued on the stream, after the kernels that read the previous table. The
  // caller's array may go once this returns: cudaMemcpyAsync from pageable host memory has
  // staged it by then.
  struct DeviceTable {
    void* data = nullptr;
    size_t bytes = 0;
  };
  absl::StatusOr<void*> Table(DeviceTable* t, const void* host, size_t bytes) {
    if (bytes > t->bytes) {
      RETURN_IF_ERROR(Synchronize());  // the old table may still be read by a queued kernel
      if (t->data) cudaFree(t->data);
      t->data = nullptr;
      t->bytes = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&t->data, bytes), "cudaMalloc (op table)"));
      t->bytes = bytes;
    }
    if (bytes > 0) {
      RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(t->data, host, bytes, cudaMemcpyHostToDevice, stream_),
                     "cudaMemcpy (op table)"));
    }
    return t->data;
  }

  absl::StatusOr<void*> Scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      RETURN_IF_ERROR(Synchronize());  // the old buffer may still be in use
      if (scratch_) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&scratch_, bytes), "cudaMalloc scratch"));
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  cudaStream_t stream_;
  cublasHandle_t cublas_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  DeviceTable seqs_, append_;
};

}  // namespace

bool CudaDevicePresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<KernelBackendPtr> MakeCudaBackend() {
  if (!CudaDevicePresent()) {
    return absl::UnavailableError("this build has CUDA but no GPU is visible (cudaGetDeviceCount)");
  }
  cudaStream_t stream;
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(stream);
    return absl::InternalError("cublasCreate failed");
  }
  return KernelBackendPtr(std::make_unique<CudaBackend>(stream, cublas));
}

}  // namespace kvwire::kernels
