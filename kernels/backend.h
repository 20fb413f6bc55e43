// The compute interface of kvwire: one KernelBackend, three implementations.
//
//   reference  naive loops, fp32 accumulation, no threads: the specification.
//   cpu        the production CPU path (OpenBLAS, AVX2 GEMV, threads), tested against reference.
//   cuda       the GPU path (nvcc), tested against reference when a GPU is present.
//   guarded    cpu's kernels on memory the host cannot touch between ops (guarded_backend.h):
//              runs the engine's device path without a GPU, for tests.
//
// Ops take plain parameter structs of pointers, sizes and strides (FlashInfer style) so
// the same struct describes host and device memory. Pointers refer to memory that the
// backend's Allocate returned (host memory for the CPU backends). Kernels know nothing
// of gRPC, protobuf or the model; they return a Status for unsupported shapes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/dtype.h"
#include "common/base/status.h"
#include "kernels/selection.h"

namespace kvwire::kernels {

enum class BackendKind { kReference, kCpu, kCuda, kGuarded };

absl::string_view BackendName(BackendKind kind);
absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name);

// y[m, n] = x[m, k] · Wᵀ (+ bias), W stored row-major [n, k] (the Hugging Face Linear
// layout: one row per output feature) in float32, bfloat16 or float16. With bfloat16 W,
// x is rounded to bfloat16 (to nearest even) first, as a bf16 model computes on tensor cores
// and in llama.cpp: each product is then exact in float32, and sums are float32.
struct MatMulParams {
  const float* x = nullptr;
  int64_t x_stride = 0;  // floats between rows of x; 0 means k
  const void* w = nullptr;
  DType w_dtype = DType::kF32;
  const float* bias = nullptr;  // [n] or null
  float* y = nullptr;
  int64_t y_stride = 0;  // floats between rows of y; 0 means n
  int m = 0, n = 0, k = 0;
};

// y = x / sqrt(mean(x²) + eps) · weight, row by row. x and y may alias.
// With `residual` set, the residual add before a block's norm in the same pass (FlashInfer's
// FusedAddRMSNorm): residual += x, then y = the norm of that sum. residual is [rows, dim] and
// overlaps neither x nor y.
struct RmsNormParams {
  const float* x = nullptr;
  const float* weight = nullptr;
  float* y = nullptr;
  int rows = 0, dim = 0;
  float eps = 1e-5f;
  float* residual = nullptr;
};

// Rotary position embedding in the "rotate_half" convention of Hugging Face Llama:
// for i < d/2, (x_i, x_{i+d/2}) is rotated by angle pos · inv_freq[i]. In place on
// `heads` heads of `head_dim` in each of `rows` rows (row stride in floats).
struct RopeParams {
  float* x = nullptr;
  int64_t row_stride = 0;
  const int32_t* positions = nullptr;  // [rows]
  const float* inv_freq = nullptr;     // [head_dim / 2], llama3 scaling already applied
  int rows = 0, heads = 0, head_dim = 0;
};

// out[r, i] = silu(gate_up[r, i]) · gate_up[r, ffn + i]: the gate and up projections are
// computed by one fused MatMul into [rows, 2·ffn].
struct SwiGluParams {
  const float* gate_up = nullptr;
  float* out = nullptr;
  int rows = 0, ffn = 0;
};

// Causal grouped-query attention over a whole prompt, tiled with an online softmax so
// that memory is O(L·d), never O(L²). Query row i attends keys 0..i.
//
// With window > 0 it also returns SnapKV's observation-window scores: for each query
// head h and each of the last `window` queries i, softmax over all keys of q_i·k_j·scale
// (zero above the diagonal), written to window_scores[h, i - (len - window), j].
struct PrefillAttentionParams {
  const float* q = nullptr;  // row r, head h at q + r·q_stride + h·head_dim
  const float* k = nullptr;  // row r, kv head g at k + r·kv_stride + g·head_dim
  const float* v = nullptr;
  float* out = nullptr;  // row r, head h at out + r·out_stride + h·head_dim
  int64_t q_stride = 0, kv_stride = 0, out_stride = 0;
  int len = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.f;
  int window = 0;
  float* window_scores = nullptr;  // [n_heads, window, len]
  // Query rows [q_begin, len) only (rows are still indexed from 0 in q and out; the rows
  // before are keys whose queries were computed in an earlier pass: a cached prompt prefix).
  // The window's rows must be among them: window <= len - q_begin.
  int q_begin = 0;
  // The precision the products may run in: f32, or bf16 for a model whose weights are bf16 (the
  // CUDA backend then runs FlashInfer's prefill on tensor cores over q, k and v rounded to
  // bf16, as vLLM and SGLang run such a model; the window's scores stay in f32). The host
  // backends compute in f32 whatever it says.
  DType precision = DType::kF32;
};

// One sequence in a batched decode step. Its cache for this layer holds `len` tokens per
// cache head, K and V in kv_dtype with token t of cache head c at layout.Row(c, t) elements
// from k and v (one region per layer, or pages: KvLayout). Query head h reads cache head
// h / (n_heads / n_cache_heads): n_cache_heads is the KV head count, or the query head
// count for a cache compressed per query head. A coded cache (coding.coded()) is read through
// its coding, and dequantised in the kernel.
struct DecodeSequence {
  const float* q = nullptr;  // [n_heads, head_dim]
  float* out = nullptr;      // [n_heads, head_dim]
  const void* k = nullptr;
  const void* v = nullptr;
  KvLayout layout;
  KvCoding coding;
  int len = 0;
  // Sparse attention: attend only to indices[c, 0..num_indices) of cache head c
  // (num_indices ≤ len, any order). Null means all len tokens.
  const int32_t* indices = nullptr;
  int num_indices = 0;
  // Optional: attention probabilities of each query head over the len tokens,
  // [n_heads, len] (zero where not attended), for fidelity measurements.
  float* probs = nullptr;
};

// out[i, :] = table[ids[i], :] widened to float32, for i < n: the embedding lookup where the
// activations are, so a device backend takes 4 bytes a token from the host rather than a row of
// hidden floats. `ids` is a host array (as the other ops' tables are), each checked < vocab.
struct EmbedRowsParams {
  const void* table = nullptr;  // [vocab, hidden] in dtype
  DType dtype = DType::kF32;
  int vocab = 0, hidden = 0;
  const int32_t* ids = nullptr;  // host [n]
  int n = 0;
  float* out = nullptr;  // [n, hidden]
};

// One sequence's new token for AppendKv: its K (after RoPE) and V rows in float32, one per
// KV head, to be stored in the cache's dtype as token t of every cache head (a cache kept per
// query head stores its KV head's row once per query head), laid out as DecodeSequence's.
// A coded cache takes the row into its residual, and codes the residual into its rows when
// the token completes a group (KvCoding).
struct KvAppend {
  const float* k = nullptr;  // [n_kv_heads, head_dim]
  const float* v = nullptr;
  void* k_cache = nullptr;  // cache head c, token t at layout.Row(c, t) elements
  void* v_cache = nullptr;
  KvLayout layout;
  KvCoding coding;
  int t = 0;
};

struct AppendKvParams {
  const KvAppend* seqs = nullptr;
  int batch = 0;
  int n_kv_heads = 0, n_cache_heads = 0, head_dim = 0;
  DType kv_dtype = DType::kF32;
};

struct DecodeAttentionParams {
  const DecodeSequence* seqs = nullptr;
  int batch = 0;
  int n_heads = 0, n_cache_heads = 0, head_dim = 0;
  DType kv_dtype = DType::kF32;
  float scale = 0.f;
};

// A span of a backend's memory.
struct ByteSpan {
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
};

// out[i] = CRC-32C of spans[i] (common/base/crc32c.h), computed where the bytes are: what a
// transport that writes a cache in place checks the rows by (kv_wire's PlacedChecksum). The op
// returns with `out` filled, as CopyToHost does (after the work queued before it): its callers
// need the sums at once, and a host array spares them a device buffer per stream.
struct ChecksumSpansParams {
  const ByteSpan* spans = nullptr;  // host array [n]; each span in backend memory
  int n = 0;
  uint32_t* out = nullptr;  // host array [n]
};

// Copies between scattered spans of backend memory and one packed buffer, in span order:
// `packed` holds span 0's bytes, then span 1's, and so on (or, `unpack`, fills the spans from
// it). The nccl KV transport moves a chunk's rows, which lie in many pages, as one message.
// Spans must not overlap one another or `packed`; unpacking writes through spans[i].data.
struct PackSpansParams {
  const ByteSpan* spans = nullptr;  // host array [n]; each span in backend memory
  int n = 0;
  uint8_t* packed = nullptr;  // backend memory, the spans' bytes summed
  bool unpack = false;
};

// One end of a point-to-point link that moves bytes between the memory of two backends,
// usually in two processes on two hosts (the nccl KV transport: NCCL between GPUs; on the
// guarded backend, an emulation over a loopback socket). Sends and receives pair up in order:
// the n-th Send on one end fills the n-th Recv on the other, which must ask for the same bytes
// (the caller's protocol makes sure of it; NCCL cannot tell). Each returns once its bytes
// moved, after the work queued before it on the calling thread; one that has not within
// `timeout` aborts the link (nothing more moves on it, and a receive that was pending writes
// nothing) and fails DEADLINE_EXCEEDED. One operation at a time; Abort from any thread.
class PeerLink {
 public:
  virtual ~PeerLink() = default;
  virtual absl::Status Send(const void* data, size_t bytes, std::chrono::milliseconds timeout) = 0;
  virtual absl::Status Recv(void* data, size_t bytes, std::chrono::milliseconds timeout) = 0;
  virtual void Abort() = 0;
};

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;

  // Every backend runs every op in every dtype; a shape one cannot run (the CUDA attention
  // kernels' head_dim above 256) is an InvalidArgument from the op saying so, as FlashInfer's
  // dispatch does, rather than a capability query nobody would keep true.
  virtual BackendKind kind() const = 0;
  // Whether the host may read and write the memory Allocate returns (the CPU backends), or
  // must go through CopyToDevice / CopyToHost (a GPU; the guarded backend).
  virtual bool host_addressable() const { return true; }

  // Memory the ops operate on: host memory for the CPU backends, device memory for CUDA.
  // Free may wait for queued work that could still use the memory.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // `src` may change or go once CopyToDevice returns; CopyToHost returns with `dst` filled.
  // Both are counted (copy_counts).
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
    Count(/*to_device=*/true, bytes);
    return DoCopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
    Count(/*to_device=*/false, bytes);
    return DoCopyToHost(dst, src, bytes);
  }

  // A copy to the host that completes in the order of the backend's work, without waiting for
  // it: `dst` holds the data once WaitCopy(ticket) returns, and must stay valid until then;
  // `src` must not be written by later work before that. Lets the host overlap a transfer
  // with the work queued after it (one layer's kept rows while the next layer computes).
  using CopyTicket = uint64_t;
  absl::StatusOr<CopyTicket> CopyToHostAsync(void* dst, const void* src, size_t bytes) {
    Count(/*to_device=*/false, bytes);
    return DoCopyToHostAsync(dst, src, bytes);
  }
  virtual absl::Status WaitCopy(CopyTicket ticket) { return absl::OkStatus(); }

  // The copy ledger: what crossed between host and backend memory since the backend was made
  // (CopyToDevice, CopyToHost, and a backend's own uploads, such as the CUDA backend's op
  // tables). On a GPU, what crossed PCIe.
  struct CopyCounts {
    int64_t to_device_bytes = 0, to_device_calls = 0;
    int64_t to_host_bytes = 0, to_host_calls = 0;
  };
  CopyCounts copy_counts() const {
    return {to_device_bytes_.load(), to_device_calls_.load(), to_host_bytes_.load(),
            to_host_calls_.load()};
  }
  // Waits for the work the calling thread queued (a device backend queues ops and copies, as
  // a stream does; each host thread has its own queue on a GPU).
  virtual absl::Status Synchronize() = 0;

  // A fault that leaves the device unusable until the process restarts, or OK: CUDA's sticky
  // errors (an illegal address, a failed launch, an uncorrectable ECC error), after which every
  // call on the context fails. A node takes itself out of service on one (health NOT_SERVING,
  // common/server/fault_watch.h) rather than failing every later request on the device.
  virtual absl::Status fault() const {
    std::lock_guard<std::mutex> lock(fault_mu_);
    return fault_;
  }
  // Records such a fault; the first one stays. The CUDA backend records its sticky errors; a
  // test injects one into the guarded backend, whose work then fails as a faulted device's.
  void MarkFaulted(const absl::Status& fault) {
    std::lock_guard<std::mutex> lock(fault_mu_);
    if (fault_.ok() && !fault.ok()) fault_ = fault;
  }

  virtual absl::Status MatMul(const MatMulParams& p) = 0;
  virtual absl::Status RmsNorm(const RmsNormParams& p) = 0;
  virtual absl::Status Rope(const RopeParams& p) = 0;
  virtual absl::Status SwiGlu(const SwiGluParams& p) = 0;
  virtual absl::Status PrefillAttention(const PrefillAttentionParams& p) = 0;
  virtual absl::Status DecodeAttention(const DecodeAttentionParams& p) = 0;
  virtual absl::Status EmbedRows(const EmbedRowsParams& p) = 0;
  virtual absl::Status AppendKv(const AppendKvParams& p) = 0;

  // Selection compute and sampling (kernels/selection.h): what compression and sparse decode
  // compute between the model's ops, in the backend's memory.
  virtual absl::Status WindowVotes(const WindowVotesParams& p) = 0;
  virtual absl::Status Pool1d(const Pool1dParams& p) = 0;
  virtual absl::Status RunMeans(const RunMeansParams& p) = 0;
  virtual absl::Status TopK(const TopKParams& p) = 0;
  virtual absl::Status HbwSelect(const HbwSelectParams& p) = 0;
  virtual absl::Status GatherKv(const GatherKvParams& p) = 0;
  virtual absl::Status UpdateSummaries(const UpdateSummariesParams& p) = 0;
  virtual absl::Status PageScores(const PageScoresParams& p) = 0;
  virtual absl::Status Sample(const SampleParams& p) = 0;
  virtual absl::Status ChecksumSpans(const ChecksumSpansParams& p) = 0;
  virtual absl::Status PackSpans(const PackSpansParams& p) = 0;

  // Memory another process on this host maps (the cuda_ipc KV transport: a decode node's pool
  // slab, written by a prefill node on the same GPU or one peered with it). ExportMemory names
  // `base`, a buffer of `bytes` from Allocate; ImportMemory maps such a name, exported by
  // another process (CUDA IPC refuses the exporter itself), into this backend's memory;
  // CloseImported unmaps it. The host backends' memory is the process's own: Unimplemented.
  virtual absl::StatusOr<std::string> ExportMemory(void* base, size_t bytes);
  virtual absl::StatusOr<void*> ImportMemory(const std::string& handle, size_t bytes);
  virtual void CloseImported(void* ptr) {}

  // Links to a backend in another process (PeerLink). OpenLink makes this end and an offer, a
  // string the other end passes to JoinLink (over a channel of the caller's: the Prefill
  // stream); the link is up once both have, and the first Send or Recv waits for that within
  // its timeout. The host backends' memory needs none: Unimplemented.
  virtual absl::StatusOr<std::unique_ptr<PeerLink>> OpenLink(std::string* offer);
  virtual absl::StatusOr<std::unique_ptr<PeerLink>> JoinLink(const std::string& offer);

  // A decode step as one graph (CUDA graphs): between BeginGraph and EndGraph the calling
  // thread's ops and uploads are recorded, not run, each table and host array copied at its call
  // as ever; EndGraph queues the recording as one graph, in the order of the thread's work. On
  // CUDA the executable graph kept for `key` (a batch size) is updated in place where only
  // parameters changed, and made anew where the work's shape did (llama.cpp's scheme), so a
  // step's launches cost one. While recording, nothing may wait for the work or read what it
  // wrote (Synchronize, CopyToHost, CopyToHostAsync, WaitCopy, ChecksumSpans, Free): each is
  // refused, or fails the recording. AbortGraph drops a recording unrun (nothing it recorded
  // has run). A backend without graphs says Unimplemented; SupportsGraphs tells.
  virtual bool SupportsGraphs() const { return false; }
  virtual absl::Status BeginGraph(int64_t key);
  virtual absl::Status EndGraph();
  virtual void AbortGraph() {}
  // Graphs made (instantiated), updated in place, and run, since the backend was made.
  struct GraphCounts {
    int64_t made = 0, updated = 0, launched = 0;
  };
  virtual GraphCounts graph_counts() const { return {}; }

  // Host work between ops that splits into independent tasks (sparse decode selection, per
  // sequence and KV head): calls fn(begin, end) over disjoint ranges covering [0, n), on the
  // CPU backend's threads; the other backends run it on the calling thread, as the reference
  // does everything. fn must not call back into the backend.
  virtual void HostParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (n > 0) fn(0, n);
  }

 protected:
  virtual absl::Status DoCopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status DoCopyToHost(void* dst, const void* src, size_t bytes) = 0;
  // Default: at once (the host backends' memory is the host's).
  virtual absl::StatusOr<CopyTicket> DoCopyToHostAsync(void* dst, const void* src, size_t bytes) {
    RETURN_IF_ERROR(DoCopyToHost(dst, src, bytes));
    return CopyTicket{0};
  }
  // Adds one copy to the ledger (a backend counts its own uploads with it).
  void Count(bool to_device, size_t bytes) {
    (to_device ? to_device_bytes_ : to_host_bytes_) += static_cast<int64_t>(bytes);
    ++(to_device ? to_device_calls_ : to_host_calls_);
  }

 private:
  mutable std::mutex fault_mu_;
  absl::Status fault_;
  std::atomic<int64_t> to_device_bytes_{0}, to_device_calls_{0};
  std::atomic<int64_t> to_host_bytes_{0}, to_host_calls_{0};
};

using KernelBackendPtr = std::unique_ptr<KernelBackend>;

// The difference of two readings of the ledger.
inline KernelBackend::CopyCounts operator-(const KernelBackend::CopyCounts& a,
                                           const KernelBackend::CopyCounts& b) {
  return {a.to_device_bytes - b.to_device_bytes, a.to_device_calls - b.to_device_calls,
          a.to_host_bytes - b.to_host_bytes, a.to_host_calls - b.to_host_calls};
}

// The CPU backend uses `threads` worker threads (0: all hardware threads). Asking for
// CUDA in a build without it, or on a machine without a GPU, is an error that says so.
// `memory_limit` (bytes, 0: none) caps what a device backend (cuda, guarded) allocates, so that
// a smaller device can be emulated and its out-of-memory paths tested; a host backend refuses
// one.
absl::StatusOr<KernelBackendPtr> MakeBackend(BackendKind kind, int threads = 0,
                                             size_t memory_limit = 0);

// True when this build has the CUDA backend and a device is visible.
bool CudaAvailable();

}  // namespace kvwire::kernels
