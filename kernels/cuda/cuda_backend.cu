/* The CUDA backend: device memory, one stream, a cuBLAS handle, and the op launchers of
 * this folder. Ops are asynchronous on the stream; Synchronize (or a copy to the host)
 * waits and surfaces any error raised inside a kernel. */
#include <cstring>
#include <memory>
#include <mutex>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda_backend.h"
#include "kernels/thread_pool.h"
#include "kernels/validate.h"

namespace kvwire::kernels {
namespace {

using cuda::CudaStatus;

class CudaBackend final : public KernelBackend {
 public:
  CudaBackend(cudaStream_t stream, cublasHandle_t cublas, int threads)
      : stream_(stream), cublas_(cublas), pool_(threads) {}
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    if (scratch_) cudaFree(scratch_);
    for (DeviceTable* t : {&seqs_, &append_}) {
      if (t->data) cudaFree(t->data);
    }
    for (DeviceTable& t : op_tables_) {
      if (t.data) cudaFree(t.data);
    }
    for (Slot& slot : slots_) {
      if (slot.data) cudaFree(slot.data);
    }
    for (Staging& slot : staging_) {
      if (slot.host) cudaFreeHost(slot.host);
      if (slot.done) cudaEventDestroy(slot.done);
    }
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
  // Returns once the copy is done, so `src` may change or go right after (the runtime stages
  // pageable memory for an asynchronous copy only "may"). Uploads are weights, a step's
  // inputs and a sequence's prompt rows, not per-op traffic; op tables go through Table().
  absl::Status DoCopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                               "cudaMemcpy to device"));
    return SyncStream();
  }
  absl::Status DoCopyToHost(void* dst, const void* src, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                               "cudaMemcpy to host"));
    return SyncStream();
  }
  absl::Status Synchronize() override {
    std::lock_guard<std::mutex> lock(mu_);
    return SyncStream();
  }

  // Every op takes mu_: a prefill and a decode step may call from two threads (llama_model.h),
  // and the scratch buffer, the op tables and the cuBLAS handle are shared. Their kernels run
  // in the stream's order, one op after another.
  absl::Status MatMul(const MatMulParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(ValidateMatMul(p));  // before sizing scratch from p
    void* scratch = nullptr;
    if (const size_t bytes = cuda::MatMulScratchBytes(p); bytes > 0) {
      ASSIGN_OR_RETURN(scratch, Scratch(bytes));
    }
    return cuda::LaunchMatMul(p, cublas_, scratch, stream_);
  }
  absl::Status Add(const AddParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchAdd(p, stream_);
  }
  absl::Status AppendKv(const AppendKvParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(ValidateAppendKv(p));  // before sizing the table from p.batch
    ASSIGN_OR_RETURN(void* table, Table(&append_, p.seqs, sizeof(KvAppend) * p.batch));
    return cuda::LaunchAppendKv(p, static_cast<const KvAppend*>(table), stream_);
  }
  absl::Status RmsNorm(const RmsNormParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchRmsNorm(p, stream_);
  }
  absl::Status Rope(const RopeParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchRope(p, stream_);
  }
  absl::Status SwiGlu(const SwiGluParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchSwiGlu(p, stream_);
  }
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchPrefillAttention(p, stream_);
  }
  // Host work between ops (sparse decode selection) on the host's cores, idle while the GPU
  // computes.
  void HostParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) override {
    pool_.ParallelFor(n, 1, fn);
  }

  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(ValidateDecodeAttention(p));
    ASSIGN_OR_RETURN(void* table, Table(&seqs_, p.seqs, sizeof(DecodeSequence) * p.batch));
    return cuda::LaunchDecodeAttention(p, static_cast<const DecodeSequence*>(table), stream_);
  }

  // Selection compute: one .cu file per op, borrowing scratch and tables from here.
  absl::Status WindowVotes(const WindowVotesParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchWindowVotes(p, stream_);
  }
  absl::Status Pool1d(const Pool1dParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchPool1d(p, stream_);
  }
  absl::Status RunMeans(const RunMeansParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchRunMeans(p, stream_);
  }
  absl::Status TopK(const TopKParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchTopK(p, op_memory_, stream_);
  }
  absl::Status HbwSelect(const HbwSelectParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchHbwSelect(p, op_memory_, stream_);
  }
  absl::Status GatherKv(const GatherKvParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchGatherKv(p, stream_);
  }
  absl::Status UpdateSummaries(const UpdateSummariesParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchUpdateSummaries(p, op_memory_, stream_);
  }
  absl::Status PageScores(const PageScoresParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchPageScores(p, op_memory_, stream_);
  }
  absl::Status Sample(const SampleParams& p) override {
    std::lock_guard<std::mutex> lock(mu_);
    return cuda::LaunchSample(p, op_memory_, stream_);
  }

 private:
  // A per-op table of host structs (the batch's sequences) copied to the device for a launch,
  // queued on the stream after the kernels that read the previous table. The copy goes from
  // a pinned staging slot, so it is truly asynchronous and the caller's array may go at once;
  // a ring of slots, each reused only after its last copy finished (an event), lets the host
  // run ahead of the device by that many ops.
  struct DeviceTable {
    void* data = nullptr;
    size_t bytes = 0;
  };
  struct Staging {
    void* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  static constexpr int kStagingSlots = 64;
  absl::StatusOr<void*> Table(DeviceTable* t, const void* host, size_t bytes) {
    if (bytes == 0) return t->data;
    if (bytes > t->bytes) {
      RETURN_IF_ERROR(SyncStream());  // the old table may still be read by a queued kernel
      if (t->data) cudaFree(t->data);
      t->data = nullptr;
      t->bytes = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&t->data, bytes), "cudaMalloc (op table)"));
      t->bytes = bytes;
    }
    Staging& slot = staging_[next_slot_];
    next_slot_ = (next_slot_ + 1) % kStagingSlots;
    if (slot.pending) {
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(slot.done), "cudaEventSynchronize"));
      slot.pending = false;
    }
    if (slot.done == nullptr) {
      RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming),
                                 "cudaEventCreate"));
    }
    if (bytes > slot.bytes) {
      if (slot.host) cudaFreeHost(slot.host);
      slot.host = nullptr;
      slot.bytes = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&slot.host, bytes), "cudaMallocHost (op table)"));
      slot.bytes = bytes;
    }
    std::memcpy(slot.host, host, bytes);
    Count(/*to_device=*/true, bytes);  // it crosses PCIe as any upload does
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(t->data, slot.host, bytes, cudaMemcpyHostToDevice, stream_),
                   "cudaMemcpy (op table)"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(slot.done, stream_), "cudaEventRecord"));
    slot.pending = true;
    return t->data;
  }

  absl::Status SyncStream() {
    return CudaStatus(cudaStreamSynchronize(stream_), "kernel execution");
  }
  absl::StatusOr<void*> Scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      RETURN_IF_ERROR(SyncStream());  // the old buffer may still be in use
      if (scratch_) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&scratch_, bytes), "cudaMalloc scratch"));
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  // The selection ops' scratch slots (cuda::ScratchSlot), grown as Scratch grows its buffer.
  struct Slot {
    void* data = nullptr;
    size_t bytes = 0;
  };
  absl::StatusOr<void*> SlotScratch(int slot, size_t bytes) {
    Slot& s = slots_[slot];
    if (bytes > s.bytes) {
      RETURN_IF_ERROR(SyncStream());  // the old buffer may still be in use
      if (s.data) cudaFree(s.data);
      s.data = nullptr;
      s.bytes = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&s.data, bytes), "cudaMalloc (op scratch)"));
      s.bytes = bytes;
    }
    return s.data;
  }

  cudaStream_t stream_;
  cublasHandle_t cublas_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  Slot slots_[cuda::kScratchSlots];
  DeviceTable op_tables_[cuda::kTables];
  // Called with mu_ held, by the op that received it.
  const cuda::OpMemory op_memory_{
      [this](int slot, size_t bytes) { return SlotScratch(slot, bytes); },
      [this](int table, const void* host, size_t bytes) {
        return Table(&op_tables_[table], host, bytes);
      }};
  ThreadPool pool_;
  std::mutex mu_;  // the ops and copies, one at a time (their host-side state)
  DeviceTable seqs_, append_;
  Staging staging_[kStagingSlots];
  int next_slot_ = 0;
};

}  // namespace

bool CudaDevicePresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<KernelBackendPtr> MakeCudaBackend(int threads) {
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
  return KernelBackendPtr(std::make_unique<CudaBackend>(stream, cublas, threads));
}

}  // namespace kvwire::kernels
