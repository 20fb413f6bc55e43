// Dense decode attention over caches kept in the wire's codes (fp8, int8, int4), in a kernel
// built for the bytes they save: one block per (sequence, cache head, run of key groups), the
// group's query heads together, each key group's parameters folded into the queries once
// (q·a + (q∘b)·codes), a token per thread for the scores and the value rows read by all the
// block's threads at once, split-KV partials merged as decode_attention.cu merges its own. The
// plain kernel (decode_attention.cu) keeps the calls this one does not serve: sparse selections,
// probabilities, caches in the dtype, other head dims or groups.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {

// Whether this kernel serves `p` (host-side checks only; p.seqs is the host array): every
// sequence coded, attending all its tokens, no probabilities; head_dim 64, 128 or 256; 1, 2, 4
// or 8 query heads per cache head; key code rows on 16-byte boundaries, value rows on 4 (fp8)
// or 2.
bool CodedDecodeServes(const DecodeAttentionParams& p);

// Runs `p`; `seqs_device` is p.seqs on the device with its page tables uploaded.
absl::Status LaunchCodedDecode(const DecodeAttentionParams& p, const DecodeSequence* seqs_device,
                               const OpMemory& mem, cudaStream_t stream);

// Calls this kernel ran since the process started (tests check the path ran).
int64_t CodedDecodeLaunches();

}  // namespace kvwire::kernels::cuda
