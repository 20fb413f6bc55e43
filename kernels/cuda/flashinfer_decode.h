// Decode attention through FlashInfer's batch decode (the CUDA-core decode kernel vLLM and
// SGLang run: split-KV over the sequence, GQA's query heads of a KV head in one block), for the
// caches it can read: paged, in bf16, head_dim 64 or 128, a query-head group FlashInfer
// dispatches, and no attention probabilities asked for. Every other call takes kvwire's own
// kernel (decode_attention.cu), which reads coded caches and writes probabilities.
//
// Each (sequence, cache head) is one FlashInfer request with one KV head and its group of query
// heads, over a page table of page size 1 whose entries are the rows the head attends (all its
// tokens, or a sparse mode's chosen ones): any of kvwire's layouts and selections maps onto that
// without copying a row, since every row starts at a multiple of head_dim elements from the
// pool's base. Queries are read in float32; outputs come back in f16 (FlashInfer's merge of
// split-KV partials needs a 16-bit output; f16 keeps 3 more bits than bf16) and are widened.
//
// Built only where CMake found FlashInfer's headers (KVWIRE_HAVE_FLASHINFER).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {

// Whether FlashInfer's kernel serves `p` (host-side checks only; p.seqs is the host array).
bool FlashInferDecodeServes(const DecodeAttentionParams& p);

// Runs `p` through FlashInfer. `seqs_device` is p.seqs on the device with its page tables
// uploaded (as LaunchDecodeAttention takes it). Errors name the failing call; a C++ exception
// FlashInfer throws is caught and returned.
absl::Status LaunchFlashInferDecode(const DecodeAttentionParams& p,
                                    const DecodeSequence* seqs_device, const OpMemory& mem,
                                    cudaStream_t stream);

// Calls that went through FlashInfer since the process started (tests check the path ran).
int64_t FlashInferDecodeLaunches();

}  // namespace kvwire::kernels::cuda
