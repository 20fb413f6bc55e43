/* The CUDA backend: device memory, and the op launchers of this folder, with the work of each
 * host thread on a lane of its own: a compute stream (ops, uploads, synchronous downloads), a
 * copy stream (asynchronous downloads, which overlap the compute stream's later work), a
 * cuBLAS handle, scratch and op tables. A prefill thread and a decode thread therefore queue
 * and wait independently: no lock is held across a wait, and the GPU may run both streams'
 * work at once. Every public entry of the engine ends with a synchronisation of its lane, so
 * memory one thread wrote is complete before another reads it (weights at load; a cache
 * prefilled on one thread and decoded on another goes through the host).
 *
 * Uploads go through pinned staging slots, each reused once its last copy finished (an
 * event), so CopyToDevice returns at once and the caller's buffer may go. Errors inside a
 * kernel surface at the next synchronisation of the lane. */
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/coded_decode.h"
#include "kernels/cuda/cuda_util.cuh"
#if KVWIRE_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_decode.h"
#include "kernels/cuda/flashinfer_prefill.h"
#include "kernels/cuda/flashinfer_topk.h"
#endif
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/nccl_link.h"
#include "kernels/cuda_backend.h"
#include "kernels/thread_pool.h"
#include "kernels/validate.h"

namespace kvwire::kernels {
namespace cuda {
namespace {
std::mutex sticky_mu;
absl::Status sticky_error;  // the process's first sticky CUDA error
}  // namespace
void RecordStickyError(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(sticky_mu);
  if (sticky_error.ok()) sticky_error = status;
}
absl::Status StickyError() {
  std::lock_guard<std::mutex> lock(sticky_mu);
  return sticky_error;
}
}  // namespace cuda

namespace {

using cuda::CudaStatus;

// cudaFree and cudaFreeHost wait for the whole device, and a device-wide wait while a stream
// records a graph invalidates the recording, whichever thread waits. So every buffer this file
// frees goes through Released(): at once while no lane in the process records, else held, and
// freed by the next release made while none does (cudaFree then waits for the graphs that may
// still read them). A recording lane never frees: it would wait on its own unlaunched work.
class Releases {
 public:
  // The frees run under the lock, so that a recording cannot begin while one is under way.
  void Release(void* p, bool pinned) {
    std::lock_guard<std::mutex> lock(mu_);
    if (recording_ > 0) {
      held_.emplace_back(p, pinned);
      return;
    }
    std::vector<std::pair<void*, bool>> now;
    now.swap(held_);
    now.emplace_back(p, pinned);
    for (auto [q, host] : now) {
      if (q == nullptr) continue;
      if (host) {
        cudaFreeHost(q);
      } else {
        cudaFree(q);
      }
    }
  }
  void BeginRecording() {
    std::lock_guard<std::mutex> lock(mu_);
    ++recording_;
  }
  void EndRecording() {
    std::lock_guard<std::mutex> lock(mu_);
    --recording_;
  }

 private:
  std::mutex mu_;
  int recording_ = 0;
  std::vector<std::pair<void*, bool>> held_;
};
Releases& Released() {
  static auto* releases = new Releases();
  return *releases;
}

// A cache's page tables for UploadPageTables, at `len` tokens: its keys' (or rows') and a coded
// cache's values', each for the rows in its pages.
void AddPageTables(KvLayout* kv, KvCoding* coding, int len, std::vector<KvLayout*>* layouts,
                   std::vector<int>* lens) {
  layouts->push_back(kv);
  lens->push_back(coding->PagedRows(len));
  if (coding->coded()) {
    layouts->push_back(&coding->v_layout);
    lens->push_back(coding->PagedRows(len));
  }
}

// A pinned host buffer and the event after its last copy.
struct Staging {
  void* host = nullptr;
  size_t bytes = 0;
  cudaEvent_t done = nullptr;
  bool pending = false;

  // Waits for the previous copy, then makes the buffer at least `n` bytes.
  absl::Status Ready(size_t n) {
    if (pending) {
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(done), "cudaEventSynchronize (staging)"));
      pending = false;
    }
    if (done == nullptr) {
      RETURN_IF_ERROR(
          CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate"));
    }
    if (n > bytes) {
      if (host) Released().Release(host, /*pinned=*/true);
      host = nullptr;
      bytes = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&host, n), "cudaMallocHost (staging)"));
      bytes = n;
    }
    return absl::OkStatus();
  }
  void Release() {
    if (pending) cudaEventSynchronize(done);
    if (host) Released().Release(host, /*pinned=*/true);
    if (done) cudaEventDestroy(done);
  }
};

// A device buffer that grows.
struct DeviceBuffer {
  void* data = nullptr;
  size_t bytes = 0;
};

// One host thread's share of the device (see the file comment).
std::atomic<uint64_t> next_lane_id{1};

struct Lane {
  const uint64_t id = next_lane_id.fetch_add(1);  // OpMemory::lane
  cudaStream_t compute = nullptr, copy = nullptr;
  cublasHandle_t cublas = nullptr;
  DeviceBuffer matmul_scratch, slots[cuda::kScratchSlots];
  DeviceBuffer seqs_table, append_table, op_tables[cuda::kTables];
  static constexpr int kTableSlots = 64;  // the host runs up to this many ops ahead
  Staging table_staging[kTableSlots];
  int next_table = 0;
  static constexpr int kUploadSlots = 4;
  static constexpr size_t kUploadChunk = size_t{8} << 20;
  Staging uploads[kUploadSlots];
  int next_upload = 0;
  Staging download;  // synchronous downloads
  // A graph being recorded (BeginGraph): the compute stream captures; op tables and uploads are
  // copied into `arena` (pinned host memory that stays as it is until the graph has run, since
  // the graph's copies read it then), and the buffers Grow replaces meanwhile are held
  // (Released) until no lane records.
  bool capturing = false;
  int64_t capture_key = 0;
  absl::Status capture_error;  // what already voids the recording (a Free)
  // Counts the recordings dropped unrun (aborted, or failed before launch): OpMemory::epoch.
  uint64_t epoch = 0;
  struct Chunk {
    void* host = nullptr;
    size_t bytes = 0, used = 0;
  };
  std::vector<Chunk> arena;
  size_t arena_at = 0;
  // The executable graph of each key, updated in place step after step; the event after the
  // last one launched (the arena is reused once it has passed).
  std::unordered_map<int64_t, cudaGraphExec_t> graphs;
  cudaEvent_t graph_done = nullptr;
  bool graph_pending = false;
  // cuBLAS's workspace, given to it so that a captured product allocates nothing.
  void* cublas_workspace = nullptr;
  // Asynchronous downloads: the pinned buffer each lands in, copied to `dst` by WaitCopy.
  struct Pending {
    void* dst;
    size_t bytes;
    Staging staging;
  };
  std::map<KernelBackend::CopyTicket, Pending> pending;
  std::vector<Staging> spare;  // staging of finished downloads, for the next ones

  ~Lane() {
    if (capturing) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(compute, &g);
      if (g) cudaGraphDestroy(g);
      Released().EndRecording();
    }
    if (compute) cudaStreamSynchronize(compute);
    if (copy) cudaStreamSynchronize(copy);
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    if (graph_done) cudaEventDestroy(graph_done);
    for (Chunk& c : arena) Released().Release(c.host, /*pinned=*/true);
    Released().Release(cublas_workspace, /*pinned=*/false);
    for (DeviceBuffer* b : {&matmul_scratch, &seqs_table, &append_table}) {
      Released().Release(b->data, /*pinned=*/false);
    }
    for (DeviceBuffer& b : slots) Released().Release(b.data, /*pinned=*/false);
    for (DeviceBuffer& b : op_tables) Released().Release(b.data, /*pinned=*/false);
    for (Staging& s : table_staging) s.Release();
    for (Staging& s : uploads) s.Release();
    download.Release();
    for (auto& [t, p] : pending) p.staging.Release();
    for (Staging& s : spare) s.Release();
    if (cublas) cublasDestroy(cublas);
    if (compute) cudaStreamDestroy(compute);
    if (copy) cudaStreamDestroy(copy);
  }

  // cuBLAS on this lane with its workspace, made at the lane's first product (a thread that
  // only copies, as gRPC's writing a received cache, never needs its 32 MiB) or before a
  // recording begins (BeginGraph), never while one records.
  static constexpr size_t kCublasWorkspace = size_t{32} << 20;  // cuBLAS's own for Hopper
  absl::StatusOr<cublasHandle_t> Cublas() {
    if (cublas != nullptr) return cublas;
    void* workspace = nullptr;
    RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&workspace, kCublasWorkspace), "cudaMalloc (cuBLAS workspace)"));
    cublasHandle_t handle = nullptr;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
      Released().Release(workspace, /*pinned=*/false);
      return absl::InternalError("cublasCreate failed");
    }
    // Bound to the compute stream once, then given its workspace (cublasSetStream would put
    // back the default one, which a captured product may allocate).
    if (cublasSetStream(handle, compute) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(handle, workspace, kCublasWorkspace) != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(handle);
      Released().Release(workspace, /*pinned=*/false);
      return absl::InternalError("cublasSetStream or cublasSetWorkspace failed");
    }
    cublas = handle;
    cublas_workspace = workspace;
    return cublas;
  }

  absl::Status Sync() {
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(copy), "kernel execution (copy stream)"));
    return CudaStatus(cudaStreamSynchronize(compute), "kernel execution");
  }

  // A buffer of at least `bytes`, the old one freed once the work that may use it is done
  // (while recording, once the graph has run: Released holds it). It grows by half again at
  // least: a decode step's page tables and rows grow a little every step, and each growth waits
  // for the device.
  absl::StatusOr<void*> Grow(DeviceBuffer* b, size_t bytes, const char* what) {
    if (bytes > b->bytes) {
      bytes = std::max(bytes, b->bytes + b->bytes / 2);
      if (!capturing) RETURN_IF_ERROR(Sync());
      if (b->data) Released().Release(b->data, /*pinned=*/false);
      b->data = nullptr;
      b->bytes = 0;
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(&b->data, bytes), what));
      b->bytes = bytes;
    }
    return b->data;
  }

  // `bytes` of the arena, 16-byte aligned, for the graph being recorded.
  absl::StatusOr<void*> ArenaTake(size_t bytes) {
    bytes = (std::max<size_t>(bytes, 1) + 15) / 16 * 16;
    for (; arena_at < arena.size(); ++arena_at) {
      Chunk& c = arena[arena_at];
      if (c.used + bytes <= c.bytes) {
        void* p = static_cast<uint8_t*>(c.host) + c.used;
        c.used += bytes;
        return p;
      }
    }
    Chunk c;
    c.bytes = std::max(bytes, arena.empty() ? size_t{1} << 20 : 2 * arena.back().bytes);
    RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&c.host, c.bytes), "cudaMallocHost (graph arena)"));
    c.used = bytes;
    arena.push_back(c);
    arena_at = arena.size() - 1;
    return c.host;
  }
  // The bytes at `host` into device memory at `dst` by a copy the graph being recorded makes.
  absl::Status RecordUpload(void* dst, const void* host, size_t bytes, const char* what) {
    if (bytes == 0) return absl::OkStatus();  // a graph's copy nodes are never empty
    ASSIGN_OR_RETURN(void* staged, ArenaTake(bytes));
    std::memcpy(staged, host, bytes);
    return CudaStatus(cudaMemcpyAsync(dst, staged, bytes, cudaMemcpyHostToDevice, compute), what);
  }

  // A per-op table of host structs copied to the device for a launch, queued after the
  // kernels that read the previous table.
  absl::StatusOr<void*> Table(DeviceBuffer* t, const void* host, size_t bytes, size_t* counted) {
    if (bytes == 0) return t->data;
    ASSIGN_OR_RETURN(void* data, Grow(t, bytes, "cudaMalloc (op table)"));
    *counted += bytes;
    if (capturing) {
      RETURN_IF_ERROR(RecordUpload(data, host, bytes, "op table (recorded)"));
      return data;
    }
    Staging& slot = table_staging[next_table];
    next_table = (next_table + 1) % kTableSlots;
    RETURN_IF_ERROR(slot.Ready(bytes));
    std::memcpy(slot.host, host, bytes);
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(data, slot.host, bytes, cudaMemcpyHostToDevice, compute), "op table"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(slot.done, compute), "cudaEventRecord"));
    slot.pending = true;
    return data;
  }
};

// Which kernels attention runs on where both can ($KVWIRE_CUDA_ATTENTION): FlashInfer's (batch
// decode; single prefill for a bf16 model) and coded_decode.cu's (dense decode over coded
// caches), or only kvwire's plain ones ("native": decode_attention.cu, also the one for sparse
// selections and probabilities; prefill_attention.cu), so that a benchmark can set the two
// side by side on one device.
enum class AttentionKernel { kFlashInfer, kNative };

class CudaBackend final : public KernelBackend {
 public:
  CudaBackend(int threads, size_t memory_limit, AttentionKernel attention_kernel, bool prefill_fa3,
              bool coded_decode, int bf16_gemv_rows, bool flashinfer_topk)
      : pool_(threads),
        limit_(memory_limit),
        attention_kernel_(attention_kernel),
        prefill_fa3_(prefill_fa3),
        coded_decode_(coded_decode),
        bf16_gemv_rows_(bf16_gemv_rows),
        flashinfer_topk_(flashinfer_topk) {}
  ~CudaBackend() override {
    lanes_.clear();
    for (void* p : imported_) cudaIpcCloseMemHandle(p);
    for (auto& [p, bytes] : allocations_) Released().Release(p, /*pinned=*/false);
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  bool host_addressable() const override { return false; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    bytes = std::max<size_t>(bytes, 1);
    {
      std::lock_guard<std::mutex> lock(memory_mu_);
      if (limit_ > 0 && used_ + bytes > limit_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cuda backend: ", bytes, " bytes do not fit: ", used_, " of its limit of ",
                         limit_, " bytes are in use"));
      }
      used_ += bytes;
    }
    void* p = nullptr;
    if (absl::Status st = CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc"); !st.ok()) {
      std::lock_guard<std::mutex> lock(memory_mu_);
      used_ -= bytes;
      return absl::ResourceExhaustedError(st.message());
    }
    std::lock_guard<std::mutex> lock(memory_mu_);
    allocations_[p] = bytes;
    return p;
  }
  // cudaFree waits for the device's queued work, whichever stream it is on (Released).
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(memory_mu_);
      auto it = allocations_.find(ptr);
      if (it == allocations_.end()) return;
      used_ -= it->second;
      allocations_.erase(it);
    }
    // While this thread records, the recorded ops may use the buffer: the graph is void.
    if (Lane* lane = LaneIfAny(); lane != nullptr && lane->capturing) {
      lane->capture_error.Update(absl::FailedPreconditionError(
          "cuda backend: Free while this thread records a graph (its ops may use the buffer)"));
    }
    Released().Release(ptr, /*pinned=*/false);
  }
  // A sticky error fails every call on the process's context, whichever backend object made it.
  absl::Status fault() const override {
    if (absl::Status st = cuda::StickyError(); !st.ok()) return st;
    return KernelBackend::fault();
  }
  absl::Status Synchronize() override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(RefuseWhileRecording(*lane, "Synchronize"));
    return lane->Sync();
  }

  // A step recorded by stream capture (relaxed: cudaMalloc may run while it records, for a
  // buffer that grows) and run as one graph; see KernelBackend::BeginGraph.
  bool SupportsGraphs() const override { return true; }
  absl::Status BeginGraph(int64_t key) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    if (lane->capturing) {
      return absl::FailedPreconditionError(
          "cuda backend: BeginGraph while this thread already records a graph");
    }
    // The arena is the last graph's until that has run.
    if (lane->graph_pending) {
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(lane->graph_done), "the previous graph"));
      lane->graph_pending = false;
    }
    for (Lane::Chunk& c : lane->arena) c.used = 0;
    lane->arena_at = 0;
    RETURN_IF_ERROR(lane->Cublas().status());  // the products it records find it made
    // Counted as recording first: a free on another thread either ended before or is held.
    Released().BeginRecording();
    if (absl::Status st =
            CudaStatus(cudaStreamBeginCapture(lane->compute, cudaStreamCaptureModeRelaxed),
                       "cudaStreamBeginCapture");
        !st.ok()) {
      Released().EndRecording();
      return st;
    }
    lane->capturing = true;
    lane->capture_key = key;
    const absl::Status ok;
    lane->capture_error = ok;
    return absl::OkStatus();
  }
  absl::Status EndGraph() override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    if (!lane->capturing) {
      return absl::FailedPreconditionError("cuda backend: EndGraph without BeginGraph");
    }
    lane->capturing = false;
    cudaGraph_t graph = nullptr;
    absl::Status st = CudaStatus(cudaStreamEndCapture(lane->compute, &graph), "a recorded graph");
    Released().EndRecording();
    st.Update(lane->capture_error);
    if (st.ok()) st.Update(LaunchRecorded(*lane, graph));
    if (graph) cudaGraphDestroy(graph);
    if (!lane->graph_pending) ++lane->epoch;  // nothing it recorded will run
    return st;
  }
  void AbortGraph() override {
    auto lane = MyLane();
    if (!lane.ok() || !(*lane)->capturing) return;
    (*lane)->capturing = false;
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture((*lane)->compute, &graph);
    Released().EndRecording();
    cudaGetLastError();  // an invalidated capture's error, reported by the op that caused it
    if (graph) cudaGraphDestroy(graph);
    ++(*lane)->epoch;
  }
  GraphCounts graph_counts() const override {
    return {graphs_made_.load(), graphs_updated_.load(), graphs_launched_.load()};
  }

  // Ops: on the calling thread's compute stream.
  absl::Status MatMul(const MatMulParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(ValidateMatMul(p));  // before sizing scratch from p
    const cuda::MatMulKernel kernel = p.w_dtype == DType::kBF16 && p.m <= bf16_gemv_rows_
                                          ? cuda::MatMulKernel::kGemv
                                          : cuda::MatMulKernel::kAuto;
    void* scratch = nullptr;
    if (const size_t bytes = cuda::MatMulScratchBytes(p, kernel); bytes > 0) {
      ASSIGN_OR_RETURN(scratch, lane->Grow(&lane->matmul_scratch, bytes, "cudaMalloc scratch"));
    }
    ASSIGN_OR_RETURN(cublasHandle_t cublas, lane->Cublas());
    return cuda::LaunchMatMul(p, cublas, scratch, lane->compute, kernel);
  }
  absl::Status EmbedRows(const EmbedRowsParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(ValidateEmbedRows(p));  // every id, before it indexes the table
    if (p.n == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(void* ids,
                     OpMemoryOf(*lane).table(cuda::kTableEmbedIds, p.ids, sizeof(int32_t) * p.n));
    return cuda::LaunchEmbedRows(p, static_cast<const int32_t*>(ids), lane->compute);
  }
  absl::Status AppendKv(const AppendKvParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(ValidateAppendKv(p));  // before sizing the table from p.batch
    // The sequences' page tables go up with them (a coded cache's values have their own).
    std::vector<KvAppend> seqs(p.seqs, p.seqs + p.batch);
    std::vector<KvLayout*> layouts;
    std::vector<int> lens;
    for (KvAppend& s : seqs) AddPageTables(&s.layout, &s.coding, s.t + 1, &layouts, &lens);
    RETURN_IF_ERROR(
        cuda::UploadPageTables(layouts, lens, OpMemoryOf(*lane), cuda::kTableAppendPages));
    ASSIGN_OR_RETURN(void* table,
                     TableOn(*lane, &lane->append_table, seqs.data(), sizeof(KvAppend) * p.batch));
    return cuda::LaunchAppendKv(p, static_cast<const KvAppend*>(table), lane->compute);
  }
  absl::Status RmsNorm(const RmsNormParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchRmsNorm(p, lane->compute);
  }
  absl::Status Rope(const RopeParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchRope(p, lane->compute);
  }
  absl::Status SwiGlu(const SwiGluParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchSwiGlu(p, lane->compute);
  }
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
#if KVWIRE_HAVE_FLASHINFER
    if (attention_kernel_ == AttentionKernel::kFlashInfer && cuda::FlashInferPrefillServes(p)) {
      RETURN_IF_ERROR(ValidatePrefillAttention(p));
      RETURN_IF_ERROR(
          cuda::LaunchFlashInferPrefill(p, OpMemoryOf(*lane), lane->compute, prefill_fa3_));
      // The window's scores, which FlashInfer does not return: a product per KV head.
      ASSIGN_OR_RETURN(cublasHandle_t cublas, lane->Cublas());
      return cuda::LaunchWindowScores(p, cublas, OpMemoryOf(*lane), lane->compute);
    }
#endif
    return cuda::LaunchPrefillAttention(p, lane->compute);
  }
  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(ValidateDecodeAttention(p));
    // Each sequence to the kernel that serves it (a decode batch mixes requests that chose
    // different KV formats, selections and probabilities): FlashInfer's, coded_decode.cu's, or
    // the plain kernel for the rest. The sequences go up as one table, each kernel's a run of it.
    const std::vector<DecodeRoute> routes = DecodeRoutes(p);
    std::vector<DecodeSequence> host;
    host.reserve(p.batch);
    std::vector<int> runs = {0, 0, 0};  // FlashInfer's, coded, plain
    for (int route = 0; route < 3; ++route) {
      for (int b = 0; b < p.batch; ++b) {
        if (static_cast<int>(routes[b]) != route) continue;
        host.push_back(p.seqs[b]);
        ++runs[route];
      }
    }
    std::vector<DecodeSequence> seqs = host;
    std::vector<KvLayout*> layouts;
    std::vector<int> lens;
    for (DecodeSequence& s : seqs) AddPageTables(&s.layout, &s.coding, s.len, &layouts, &lens);
    RETURN_IF_ERROR(
        cuda::UploadPageTables(layouts, lens, OpMemoryOf(*lane), cuda::kTableDecodePages));
    ASSIGN_OR_RETURN(void* table, TableOn(*lane, &lane->seqs_table, seqs.data(),
                                          sizeof(DecodeSequence) * p.batch));
    int first = 0;
    for (int route = 0; route < 3; ++route) {
      if (runs[route] == 0) continue;
      DecodeAttentionParams part = p;
      part.seqs = host.data() + first;
      part.batch = runs[route];
      const DecodeSequence* device = static_cast<const DecodeSequence*>(table) + first;
      first += runs[route];
      switch (static_cast<DecodeRoute>(route)) {
        case DecodeRoute::kFlashInfer:
#if KVWIRE_HAVE_FLASHINFER
          RETURN_IF_ERROR(
              cuda::LaunchFlashInferDecode(part, device, OpMemoryOf(*lane), lane->compute));
#endif
          break;
        case DecodeRoute::kCoded:
          RETURN_IF_ERROR(cuda::LaunchCodedDecode(part, device, OpMemoryOf(*lane), lane->compute));
          break;
        case DecodeRoute::kPlain:
          RETURN_IF_ERROR(
              cuda::LaunchDecodeAttention(part, device, OpMemoryOf(*lane), lane->compute));
          break;
      }
    }
    return absl::OkStatus();
  }
  enum class DecodeRoute { kFlashInfer = 0, kCoded = 1, kPlain = 2 };
  // The kernel a sequence of `p` goes to, alone.
  DecodeRoute DecodeRouteOf(const DecodeAttentionParams& p, const DecodeSequence& s) const {
    DecodeAttentionParams one = p;
    one.seqs = &s;
    one.batch = 1;
#if KVWIRE_HAVE_FLASHINFER
    if (attention_kernel_ == AttentionKernel::kFlashInfer && cuda::FlashInferDecodeServes(one)) {
      return DecodeRoute::kFlashInfer;
    }
#endif
    if (coded_decode_ && cuda::CodedDecodeServes(one)) return DecodeRoute::kCoded;
    return DecodeRoute::kPlain;
  }
  // Each sequence's kernel. FlashInfer takes one K and one V base for its whole call: where
  // the sequences it would serve do not share them, they go to the plain kernel.
  std::vector<DecodeRoute> DecodeRoutes(const DecodeAttentionParams& p) const {
    std::vector<DecodeRoute> routes(p.batch);
    std::vector<DecodeSequence> library;
    for (int b = 0; b < p.batch; ++b) {
      routes[b] = DecodeRouteOf(p, p.seqs[b]);
      if (routes[b] == DecodeRoute::kFlashInfer) library.push_back(p.seqs[b]);
    }
#if KVWIRE_HAVE_FLASHINFER
    DecodeAttentionParams together = p;
    together.seqs = library.data();
    together.batch = static_cast<int>(library.size());
    if (!library.empty() && !cuda::FlashInferDecodeServes(together)) {
      for (DecodeRoute& r : routes) {
        if (r == DecodeRoute::kFlashInfer) r = DecodeRoute::kPlain;  // (never coded)
      }
    }
#endif
    return routes;
  }
  // Host work between ops (sparse selection on the host) on the host's cores, idle while
  // the GPU computes.
  void HostParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) override {
    pool_.ParallelFor(n, 1, fn);
  }

  // Selection compute: one .cu file per op, borrowing the lane's scratch and tables.
  absl::Status WindowVotes(const WindowVotesParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchWindowVotes(p, lane->compute);
  }
  absl::Status Pool1d(const Pool1dParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchPool1d(p, lane->compute);
  }
  absl::Status RunMeans(const RunMeansParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchRunMeans(p, lane->compute);
  }
  absl::Status TopK(const TopKParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchTopK(p, OpMemoryOf(*lane), lane->compute, flashinfer_topk_);
  }
  absl::Status HbwSelect(const HbwSelectParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchHbwSelect(p, OpMemoryOf(*lane), lane->compute);
  }
  absl::Status GatherKv(const GatherKvParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchGatherKv(p, lane->compute);
  }
  absl::Status UpdateSummaries(const UpdateSummariesParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchUpdateSummaries(p, OpMemoryOf(*lane), lane->compute);
  }
  absl::Status PageScores(const PageScoresParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchPageScores(p, OpMemoryOf(*lane), lane->compute);
  }
  absl::Status Sample(const SampleParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchSample(p, OpMemoryOf(*lane), lane->compute, flashinfer_topk_);
  }
  // The sums into the lane's scratch, then to the caller's host array in stream order.
  absl::Status ChecksumSpans(const ChecksumSpansParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(RefuseWhileRecording(*lane, "ChecksumSpans"));
    RETURN_IF_ERROR(ValidateChecksumSpans(p));
    if (p.n == 0) return absl::OkStatus();
    const cuda::OpMemory mem = OpMemoryOf(*lane);
    const size_t bytes = sizeof(uint32_t) * static_cast<size_t>(p.n);
    ASSIGN_OR_RETURN(void* sums, mem.scratch(cuda::kScratchWork, bytes));
    ChecksumSpansParams q = p;
    q.out = static_cast<uint32_t*>(sums);
    RETURN_IF_ERROR(cuda::LaunchChecksumSpans(q, mem, lane->compute));
    return CopyToHost(p.out, sums, bytes);
  }
  absl::Status PackSpans(const PackSpansParams& p) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    return cuda::LaunchPackSpans(p, OpMemoryOf(*lane), lane->compute);
  }

  // NCCL (kernels/cuda/nccl_link.h), loaded when first used.
  absl::StatusOr<std::unique_ptr<PeerLink>> OpenLink(std::string* offer) override {
    return cuda::OpenNcclLink(offer);
  }
  absl::StatusOr<std::unique_ptr<PeerLink>> JoinLink(const std::string& offer) override {
    return cuda::JoinNcclLink(offer);
  }

  // CUDA IPC: the handle of a whole cudaMalloc allocation (the pool's slab), opened by another
  // process on this host with peer access enabled as needed.
  absl::StatusOr<std::string> ExportMemory(void* base, size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(memory_mu_);
      auto it = allocations_.find(base);
      if (it == allocations_.end() || bytes > it->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda backend: ExportMemory takes a buffer of this backend's (its start, at most its "
            "bytes); ",
            bytes, " bytes at this pointer are not one"));
      }
    }
    cudaIpcMemHandle_t h;
    RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle"));
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  // The size is the exporter's word (a peer authenticated on the control stream): the runtime
  // API cannot tell a mapping's extent.
  absl::StatusOr<void*> ImportMemory(const std::string& handle, size_t bytes) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t) || bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda backend: an IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, got ",
          handle.size(), ", for a buffer of ", bytes, " bytes (need > 0)"));
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                               "cudaIpcOpenMemHandle"));
    std::lock_guard<std::mutex> lock(memory_mu_);
    imported_.insert(p);
    return p;
  }
  void CloseImported(void* ptr) override {
    {
      std::lock_guard<std::mutex> lock(memory_mu_);
      if (imported_.erase(ptr) == 0) return;
    }
    cudaIpcCloseMemHandle(ptr);
  }

  absl::Status WaitCopy(CopyTicket ticket) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(RefuseWhileRecording(*lane, "WaitCopy"));
    auto it = lane->pending.find(ticket);
    if (it == lane->pending.end()) {
      return absl::FailedPreconditionError(
          "WaitCopy: no copy of this thread has that ticket (waited for already, or another "
          "thread's)");
    }
    Lane::Pending p = std::move(it->second);
    lane->pending.erase(it);
    absl::Status st =
        CudaStatus(cudaEventSynchronize(p.staging.done), "asynchronous copy to the host");
    p.staging.pending = false;
    if (st.ok() && p.bytes > 0) std::memcpy(p.dst, p.staging.host, p.bytes);
    lane->spare.push_back(p.staging);
    return st;
  }

 protected:
  // Through the lane's pinned staging, in chunks: returns as soon as the copies are queued.
  absl::Status DoCopyToDevice(void* dst, const void* src, size_t bytes) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    if (lane->capturing)
      return lane->RecordUpload(dst, src, bytes, "cudaMemcpy to device (recorded)");
    for (size_t off = 0; off < bytes; off += Lane::kUploadChunk) {
      const size_t n = std::min(Lane::kUploadChunk, bytes - off);
      Staging& slot = lane->uploads[lane->next_upload];
      lane->next_upload = (lane->next_upload + 1) % Lane::kUploadSlots;
      RETURN_IF_ERROR(slot.Ready(std::min(bytes, Lane::kUploadChunk)));
      std::memcpy(slot.host, static_cast<const uint8_t*>(src) + off, n);
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + off, slot.host, n,
                                                 cudaMemcpyHostToDevice, lane->compute),
                                 "cudaMemcpy to device"));
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(slot.done, lane->compute), "cudaEventRecord"));
      slot.pending = true;
    }
    return absl::OkStatus();
  }
  // In the compute stream's order, through pinned staging; returns with `dst` filled.
  absl::Status DoCopyToHost(void* dst, const void* src, size_t bytes) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(RefuseWhileRecording(*lane, "CopyToHost"));
    for (size_t off = 0; off < bytes; off += Lane::kUploadChunk) {
      const size_t n = std::min(Lane::kUploadChunk, bytes - off);
      RETURN_IF_ERROR(lane->download.Ready(std::min(bytes, Lane::kUploadChunk)));
      RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(lane->download.host, static_cast<const uint8_t*>(src) + off, n,
                                     cudaMemcpyDeviceToHost, lane->compute),
                     "cudaMemcpy to host"));
      RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(lane->download.done, lane->compute), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(lane->download.done), "kernel execution"));
      std::memcpy(static_cast<uint8_t*>(dst) + off, lane->download.host, n);
    }
    return absl::OkStatus();
  }
  // On the copy stream, after the compute stream's work so far: the compute stream goes on.
  absl::StatusOr<CopyTicket> DoCopyToHostAsync(void* dst, const void* src, size_t bytes) override {
    ASSIGN_OR_RETURN(Lane * lane, MyLane());
    RETURN_IF_ERROR(RefuseWhileRecording(*lane, "CopyToHostAsync"));
    Staging staging;
    if (!lane->spare.empty()) {
      staging = lane->spare.back();
      lane->spare.pop_back();
    }
    cudaEvent_t ready = nullptr;
    auto queue = [&]() -> absl::Status {
      RETURN_IF_ERROR(staging.Ready(bytes));
      RETURN_IF_ERROR(
          CudaStatus(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate"));
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(ready, lane->compute), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(lane->copy, ready, 0), "cudaStreamWaitEvent"));
      if (bytes > 0) {
        RETURN_IF_ERROR(CudaStatus(
            cudaMemcpyAsync(staging.host, src, bytes, cudaMemcpyDeviceToHost, lane->copy),
            "cudaMemcpy to host (asynchronous)"));
      }
      return CudaStatus(cudaEventRecord(staging.done, lane->copy), "cudaEventRecord");
    };
    const absl::Status st = queue();
    if (ready) cudaEventDestroy(ready);  // released once the copy stream has waited on it
    if (!st.ok()) {
      lane->spare.push_back(staging);
      return st;
    }
    staging.pending = true;
    const CopyTicket ticket = ++next_ticket_;
    lane->pending.emplace(ticket, Lane::Pending{dst, bytes, staging});
    return ticket;
  }

 private:
  // The calling thread's lane, made at its first use.
  absl::StatusOr<Lane*> MyLane() {
    std::lock_guard<std::mutex> lock(lanes_mu_);
    auto& lane = lanes_[std::this_thread::get_id()];
    if (lane != nullptr) return lane.get();
    auto fresh = std::make_unique<Lane>();
    RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&fresh->compute, cudaStreamNonBlocking),
                               "cudaStreamCreate"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&fresh->copy, cudaStreamNonBlocking),
                               "cudaStreamCreate"));
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&fresh->graph_done, cudaEventDisableTiming),
                               "cudaEventCreate"));
    lane = std::move(fresh);
    return lane.get();
  }
  // The calling thread's lane, or null before its first use.
  Lane* LaneIfAny() {
    std::lock_guard<std::mutex> lock(lanes_mu_);
    auto it = lanes_.find(std::this_thread::get_id());
    return it == lanes_.end() ? nullptr : it->second.get();
  }
  absl::Status RefuseWhileRecording(const Lane& lane, const char* call) {
    if (!lane.capturing) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cuda backend: ", call,
                     " while this thread records a graph: its work runs at EndGraph, and "
                     "nothing may wait for it or read its results before then"));
  }
  // The recorded `graph` as the key's executable graph (the kept one updated in place where
  // only parameters changed, else made anew), launched on the compute stream.
  absl::Status LaunchRecorded(Lane& lane, cudaGraph_t graph) {
    // A bound on the graphs kept (a batch size each): past it, all are made again as needed.
    constexpr size_t kMaxGraphs = 128;
    if (lane.graphs.size() >= kMaxGraphs && lane.graphs.count(lane.capture_key) == 0) {
      RETURN_IF_ERROR(lane.Sync());
      for (auto& [key, exec] : lane.graphs) cudaGraphExecDestroy(exec);
      lane.graphs.clear();
    }
    cudaGraphExec_t& exec = lane.graphs[lane.capture_key];
    bool updated = false;
    if (exec != nullptr) {
      cudaGraphExecUpdateResultInfo info;
      updated = cudaGraphExecUpdate(exec, graph, &info) == cudaSuccess;
      if (!updated) {
        cudaGetLastError();  // a changed shape: made anew below
        cudaGraphExecDestroy(exec);
        exec = nullptr;
      }
    }
    if (exec == nullptr) {
      if (absl::Status st =
              CudaStatus(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
          !st.ok()) {
        lane.graphs.erase(lane.capture_key);
        return st;
      }
      ++graphs_made_;
    }
    if (updated) ++graphs_updated_;
    RETURN_IF_ERROR(CudaStatus(cudaGraphLaunch(exec, lane.compute), "cudaGraphLaunch"));
    ++graphs_launched_;
    lane.graph_pending = true;  // (a rerun op by op would write the same rows again)
    return CudaStatus(cudaEventRecord(lane.graph_done, lane.compute), "cudaEventRecord");
  }
  absl::StatusOr<void*> TableOn(Lane& lane, DeviceBuffer* t, const void* host, size_t bytes) {
    size_t counted = 0;
    auto table = lane.Table(t, host, bytes, &counted);
    Count(/*to_device=*/true, counted);  // it crosses PCIe as any upload does
    return table;
  }
  cuda::OpMemory OpMemoryOf(Lane& lane) {
    return {[this, &lane](int slot, size_t bytes) {
              return lane.Grow(&lane.slots[slot], bytes, "cudaMalloc (op scratch)");
            },
            [this, &lane](int table, const void* host, size_t bytes) {
              return TableOn(lane, &lane.op_tables[table], host, bytes);
            },
            lane.id, lane.epoch,
            lane.capturing ? std::function<absl::StatusOr<void*>(size_t)>(
                                 [&lane](size_t bytes) { return lane.ArenaTake(bytes); })
                           : nullptr};
  }

  ThreadPool pool_;
  const size_t limit_;  // 0: none
  const AttentionKernel attention_kernel_;
  const bool prefill_fa3_;      // FlashInfer's prefill through FA3 (an sm_90 device), else FA2
  const bool coded_decode_;     // dense decode over coded caches through coded_decode.cu
  const int bf16_gemv_rows_;    // bf16 products of up to this many rows on kvwire's GEMV, 0: auto
  const bool flashinfer_topk_;  // TopK and Sample's top-k through FlashInfer's where it serves
  std::mutex memory_mu_;
  std::unordered_map<void*, size_t> allocations_;
  std::set<void*> imported_;  // other processes' memory mapped here (ImportMemory)
  size_t used_ = 0;
  std::mutex lanes_mu_;
  std::unordered_map<std::thread::id, std::unique_ptr<Lane>> lanes_;
  std::atomic<CopyTicket> next_ticket_{0};
  std::atomic<int64_t> graphs_made_{0}, graphs_updated_{0}, graphs_launched_{0};
};

}  // namespace

bool CudaDevicePresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<KernelBackendPtr> MakeCudaBackend(int threads, size_t memory_limit) {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess || count == 0) {
    // An old driver under this runtime, or no GPU: say which.
    return absl::UnavailableError(
        absl::StrCat("this build has CUDA but no GPU is visible (cudaGetDeviceCount: ",
                     err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")"));
  }
  const char* env = std::getenv("KVWIRE_CUDA_ATTENTION");
  const std::string choice = env == nullptr || *env == '\0' ? "" : env;
  AttentionKernel kernel =
      KVWIRE_HAVE_FLASHINFER ? AttentionKernel::kFlashInfer : AttentionKernel::kNative;
  if (choice == "native") {
    kernel = AttentionKernel::kNative;
  } else if (choice == "flashinfer" || choice == "flashinfer-fa2") {
    if (!KVWIRE_HAVE_FLASHINFER) {
      return absl::FailedPreconditionError(
          "KVWIRE_CUDA_ATTENTION=flashinfer, but this build has no FlashInfer (CMake did "
          "not find its headers: run scripts/install_deps.sh and configure again)");
    }
  } else if (!choice.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KVWIRE_CUDA_ATTENTION is '", choice, "'; expected flashinfer, flashinfer-fa2 or native"));
  }
#if KVWIRE_HAVE_FLASHINFER
  // FA3 where it was built for this device; flashinfer-fa2 keeps FA2, to compare the two.
  const bool fa3 = choice != "flashinfer-fa2" && cuda::FlashInferFa3Serves();
#else
  const bool fa3 = false;
#endif
  // kvwire's plain kernels only ("native"), or the coded caches' own decode kernel as well.
  const bool coded_decode = choice != "native";
  // Decode-sized bf16 products on kvwire's GEMV up to this many rows of x (1 to 16; 0, or
  // unset, the switch's own choice, which gives two rows and more to cuBLAS): for gpu_bench to
  // set the two side by side in whole decode steps, as its projection table does product by
  // product.
  int bf16_gemv_rows = 0;
  if (const char* rows = std::getenv("KVWIRE_CUDA_BF16_GEMV_ROWS"); rows && *rows) {
    const std::string text = rows;
    if (!absl::SimpleAtoi(text, &bf16_gemv_rows) || bf16_gemv_rows < 0 ||
        bf16_gemv_rows > cuda::kGemvMaxRows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KVWIRE_CUDA_BF16_GEMV_ROWS is '", text,
          "'; expected a number of rows from 0 (the switch's own choice) to ", cuda::kGemvMaxRows));
    }
  }
  // TopK's decode-step rankings and Sample's top-k candidates through FlashInfer's top-k where
  // it serves them ("flashinfer", or unset where it is built), or CUB's segmented sort for every
  // call ("cub"): for a benchmark to set the two side by side.
  const char* topk_env = std::getenv("KVWIRE_CUDA_TOPK");
  const std::string topk = topk_env == nullptr ? "" : topk_env;
  bool flashinfer_topk = KVWIRE_HAVE_FLASHINFER;
  if (topk == "cub") {
    flashinfer_topk = false;
  } else if (topk == "flashinfer") {
    if (!KVWIRE_HAVE_FLASHINFER) {
      return absl::FailedPreconditionError(
          "KVWIRE_CUDA_TOPK=flashinfer, but this build has no FlashInfer (CMake did not find its "
          "headers: run scripts/install_deps.sh and configure again)");
    }
  } else if (!topk.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KVWIRE_CUDA_TOPK is '", topk, "'; expected flashinfer or cub"));
  }
#if KVWIRE_HAVE_FLASHINFER
  // A device without the shared memory FlashInfer's top-k takes keeps CUB's.
  flashinfer_topk = flashinfer_topk && cuda::FlashInferTopKAvailable();
#endif
  return KernelBackendPtr(std::make_unique<CudaBackend>(
      threads, memory_limit, kernel, fa3, coded_decode, bf16_gemv_rows, flashinfer_topk));
}

}  // namespace kvwire::kernels
