// Entry points of the CUDA kernels, one per .cu file; cuda_backend.cu calls them. Each checks
// its parameters (kernels/validate.h) except MatMul, AppendKv and DecodeAttention, whose
// parameters the backend checks first because it sizes scratch or op tables from them.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvwire::kernels::cuda {

absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);
absl::Status LaunchRope(const RopeParams& p, cudaStream_t stream);
absl::Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream);
// `scratch` is a device buffer of at least MatMulScratchBytes(p, kernel) bytes; `cublas` is bound
// to `stream` already (cublasSetStream would put back the workspace a graph's capture needs).
// MatMulKernel::kAuto: kvwire's GEMV for decode-sized m (m ≤ 16; against bf16 W, m = 1), cuBLAS
// otherwise; the others force one (the GEMV for m ≤ 16 only), for the benchmark that sets them
// side by side.
enum class MatMulKernel { kAuto, kGemv, kCublas };
inline constexpr int kGemvMaxRows = 16;  // the most rows of x the GEMV takes (matmul.cuh's)
size_t MatMulScratchBytes(const MatMulParams& p, MatMulKernel kernel = MatMulKernel::kAuto);
absl::Status LaunchMatMul(const MatMulParams& p, cublasHandle_t cublas, void* scratch,
                          cudaStream_t stream, MatMulKernel kernel = MatMulKernel::kAuto);
// `ids_device` is p.ids copied to device memory (p validated).
absl::Status LaunchEmbedRows(const EmbedRowsParams& p, const int32_t* ids_device,
                             cudaStream_t stream);
// `seqs_device` is p.seqs copied to device memory.
absl::Status LaunchAppendKv(const AppendKvParams& p, const KvAppend* seqs_device,
                            cudaStream_t stream);
absl::Status LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream);

// Device memory the selection ops borrow for one launch, from the backend: scratch(slot, bytes)
// is a buffer of at least `bytes` (one per slot, reused in stream order); table(id, host, bytes)
// copies a host array into device table `id` (queued on the stream, so the host array may go
// at once). Ops that call another op use different slots and tables from it.
enum ScratchSlot : int {
  kScratchSort = 0,
  kScratchWork,
  // FlashInfer's batch decode (flashinfer_decode.h): its workspaces, page tables, gathered
  // queries and 16-bit outputs.
  kScratchFlashInferFloat,
  kScratchFlashInferInt,
  kScratchFlashInferRows,
  kScratchFlashInferQ,
  kScratchFlashInferK,
  kScratchFlashInferV,
  kScratchFlashInferOut,
  kScratchSlots
};
enum TableId : int {
  kTableTopK = 0,
  kTableTopKOffsets,
  kTableTopKLengths,
  kTableHbw,
  kTableSummaries,
  kTableSummaryPages,
  kTablePageScores,
  kTablePageScorePages,
  kTableSample,
  kTableSampleOffsets,
  kTableDecodePages,
  kTableAppendPages,
  kTableChecksumSpans,
  kTablePackSpans,
  kTableEmbedIds,
  kTableFlashInferIndptr,
  kTableFlashInferLastPage,
  kTables
};
struct OpMemory {
  std::function<absl::StatusOr<void*>(int slot, size_t bytes)> scratch;
  std::function<absl::StatusOr<void*>(int table, const void* host, size_t bytes)> table;
  // The lane's number, unique in the process (never reused): what an op may key state it keeps
  // between its calls on one lane by (FlashInfer's decode plan).
  uint64_t lane = 0;
  // Changes whenever work the lane recorded was dropped unrun (a graph aborted, or failed before
  // its launch): what an op keeps about what its earlier calls left in device memory holds
  // within one epoch only.
  uint64_t epoch = 0;
  // While the lane records a graph (KernelBackend::BeginGraph): host memory that a copy queued
  // now may read when the graph runs (pinned, and kept as it is until then). Null otherwise,
  // where a copy from pageable memory is staged before it returns.
  std::function<absl::StatusOr<void*>(size_t bytes)> recorded_host;
};

// Merges a decode's split-KV partials into each sequence's out: for item (sequence b, query
// head h) = b · n_heads + h and chunk k, part_m and part_l at item · chunks + k and part_acc at
// (item · chunks + k) · head_dim, unnormalised (decode_attention.cu and coded_decode.cu write
// them). A chunk with part_l 0 adds nothing.
absl::Status LaunchMergeDecodeChunks(const DecodeAttentionParams& p,
                                     const DecodeSequence* seqs_device, int chunks,
                                     const float* part_m, const float* part_l,
                                     const float* part_acc, cudaStream_t stream);

// `seqs_device` is p.seqs copied to device memory (p.seqs, the host's, sizes the split).
absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p,
                                   const DecodeSequence* seqs_device, const OpMemory& mem,
                                   cudaStream_t stream);

// The observation window's scores alone (p.window rows' softmax over every key, into
// p.window_scores), as one cuBLAS product per KV head and a causal softmax: for a prefill whose
// attention ran elsewhere (FlashInfer returns no probabilities). `cublas` is bound to `stream`.
absl::Status LaunchWindowScores(const PrefillAttentionParams& p, cublasHandle_t cublas,
                                const OpMemory& mem, cudaStream_t stream);
int64_t WindowScoreLaunches();  // calls so far

// The page tables of paged layouts (KvLayout::pages, host arrays; each layout's first
// TableEntries(len) entries) copied into device table `table`, once per table however many
// layouts share it, and each layout pointed at its copy. Layouts in one region are left as
// they are.
absl::Status UploadPageTables(const std::vector<KvLayout*>& layouts, const std::vector<int>& lens,
                              const OpMemory& mem, int table);

// The selection ops (kernels/selection.h), one .cu file each; every launcher validates.
absl::Status LaunchWindowVotes(const WindowVotesParams& p, cudaStream_t stream);
absl::Status LaunchPool1d(const Pool1dParams& p, cudaStream_t stream);
absl::Status LaunchRunMeans(const RunMeansParams& p, cudaStream_t stream);
// `flashinfer`: FlashInfer's top-k where it serves the call (top_k.cu), CUB's sort otherwise;
// only where FlashInfer is built and FlashInferTopKAvailable().
absl::Status LaunchTopK(const TopKParams& p, const OpMemory& mem, cudaStream_t stream,
                        bool flashinfer = false);
absl::Status LaunchHbwSelect(const HbwSelectParams& p, const OpMemory& mem, cudaStream_t stream);
absl::Status LaunchGatherKv(const GatherKvParams& p, cudaStream_t stream);
absl::Status LaunchUpdateSummaries(const UpdateSummariesParams& p, const OpMemory& mem,
                                   cudaStream_t stream);
absl::Status LaunchPageScores(const PageScoresParams& p, const OpMemory& mem, cudaStream_t stream);
// `flashinfer`: the candidates a top-k keeps through FlashInfer's top-k where every sampling row
// has one of at most 2048 (sample.cu), CUB's sort of the vocabulary otherwise.
absl::Status LaunchSample(const SampleParams& p, const OpMemory& mem, cudaStream_t stream,
                          bool flashinfer = false);
absl::Status LaunchChecksumSpans(const ChecksumSpansParams& p, const OpMemory& mem,
                                 cudaStream_t stream);
absl::Status LaunchPackSpans(const PackSpansParams& p, const OpMemory& mem, cudaStream_t stream);

}  // namespace kvwire::kernels::cuda
