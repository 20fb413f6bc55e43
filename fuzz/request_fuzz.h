// What the request-translation targets (generate_request_fuzz, prefill_request_fuzz) share:
// the model they translate against, a failure report that names the broken promise, and a
// prefill of an accepted job run end to end, as the node would run it.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/compression/compression.h"
#include "common/engine/prefill_engine.h"
#include "common/model/kv_cache.h"
#include "common/model/llama_model.h"
#include "common/wire/kv_stream.h"

namespace kvwire::fuzz {

// The synthetic tiny model: 2 layers, 4 heads and 2 KV heads of 16 dimensions, the byte
// tokenizer with a 320-token vocabulary, a 4096-token context. Loaded once, on one thread:
// the model's thread pool would cost more than its tiny prefills and make coverage depend on
// the machine's cores.
inline LlamaModel& TinyModel() {
  static LlamaModel* const model = [] {
    LoadOptions options;
    options.threads = 1;
    auto m = LlamaModel::Load("synthetic:tiny", options);
    KVWIRE_CHECK(m.ok());
    return m->release();
  }();
  return *model;
}

// The prefill node's engine on that model; no workers: Run on the caller's thread.
inline PrefillEngine& TinyPrefillEngine() {
  static PrefillEngine* const engine = [] {
    PrefillEngineOptions options;
    options.node_name = "fuzz";
    options.workers = 0;
    return new PrefillEngine(&TinyModel(), options);
  }();
  return *engine;
}

// KVWIRE_FUZZ_VERBOSE=1: what became of each input (to check seeds).
template <typename... Args>
void Note(const Args&... what) {
  static const bool verbose = std::getenv("KVWIRE_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s\n", absl::StrCat(what...).c_str());
}

// An accepted request broke a promise: say which, then abort (libFuzzer keeps the input).
template <typename... Args>
[[noreturn]] void Fail(const Args&... what) {
  const std::string message = absl::StrCat(what...);
  std::fprintf(stderr, "request fuzz: %s\n", message.c_str());
  std::abort();
}

// Prompts up to this long are prefilled for real (a few milliseconds under the sanitizers).
inline constexpr int kPrefillTokens = 48;

// Runs a prefill the engine's Check accepted, with room for `extra_tokens` more, into a cache
// through the receiving side's checks (CacheStreamSink), as the decode node receives it: the
// cache and the stream's expectation from `expected`, the compression the receiver asked for.
// An accepted job must run: the stream complete, each layer holding what the compression
// promised, the first token inside the vocabulary.
inline void RunAcceptedPrefill(const PrefillJob& job, const CompressionConfig& expected,
                               int extra_tokens) {
  const int len = static_cast<int>(job.prompt_ids.size());
  if (len > kPrefillTokens) return;
  LlamaModel& model = TinyModel();
  const ModelConfig& mc = model.config();
  auto cache = KvCache::Create(
      CompressedCacheShape(expected, mc, model.kv_dtype(), len, extra_tokens), HeapKvAllocator());
  if (!cache.ok()) Fail("no cache for an accepted prefill: ", cache.status().ToString());
  (*cache)->set_prompt_len(len);
  CacheStreamSink sink(StreamExpectation(model, expected, len, job.max_chunk_bytes), cache->get(),
                       mc.vocab_size);
  auto out = TinyPrefillEngine().Run(job, sink);
  if (!out.ok()) {
    Fail("an accepted prefill (", job.compression.Describe(), ", ", len,
         " tokens) failed: ", out.status().ToString());
  }
  for (int l = 0; l < mc.num_layers; ++l) {
    const int kept = (*cache)->layer(l).len;
    if (kept != expected.KeptTokens(l, len)) {
      Fail("layer ", l, " holds ", kept, " tokens, ", expected.Describe(), " promised ",
           expected.KeptTokens(l, len), " of ", len);
    }
  }
  Note("prefilled ", len, " tokens: ", job.compression.Describe());
  if (out->trailer.first_token < 0 || out->trailer.first_token >= mc.vocab_size) {
    Fail("first token ", out->trailer.first_token, " is outside the vocabulary");
  }
}

}  // namespace kvwire::fuzz
