// The prefill node's prefix cache: the full K and V of prompt prefixes, kept where the compute
// is, so that a request whose prompt starts with tokens an earlier one had computes only the
// rest (vLLM's automatic prefix caching; SGLang's radix cache). Compression happens after, per
// request: the observation window is always among the tokens computed anew, so a warm request
// scores the whole context with its own question and keeps what a cold one would (the
// compressed cache of one question is the wrong cache for the next; KVzip and SCBench).
//
// Blocks of block_tokens tokens, keyed by a hash chained over the block's tokens and every
// token before it (vLLM's block hashes); a block also keeps its tokens and its parent's key,
// so a hash collision is a miss, never a wrong hit. A block holds every layer's rows as the
// model computes them (K after RoPE, then V; floats) in the backend's memory. Blocks are
// evicted least recently used within a byte bound, never while a request reads them, and a
// block becomes visible only once the prefill that filled it finished.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/types/span.h"
#include "common/model/llama_model.h"
#include "kernels/backend.h"

namespace kvwire {

class PrefixCache {
 public:
  // `max_bytes` must hold at least one block. `model` (its fingerprint) seeds every key, so
  // caches of two models never share a block.
  PrefixCache(std::shared_ptr<kernels::KernelBackend> backend, int layers, int kv_dim,
              int block_tokens, size_t max_bytes, const std::string& model = "");
  ~PrefixCache();

  struct Block;
  // One prefill's use of the cache: the cached blocks it reads (held: not evicted under it, as
  // `prefix` names them), and the blocks it fills, after them, in order from token fill_from.
  struct Plan {
    PrefillPrefix prefix;
    std::vector<std::shared_ptr<Block>> held;
    std::vector<std::shared_ptr<Block>> fill;
    int fill_from = 0;
    int hit_tokens() const { return prefix.tokens(); }
  };
  // The longest chain of cached blocks that starts `ids` and ends by token `max_reuse`, and
  // new blocks for the prompt's whole blocks after it (as many as the byte bound leaves room
  // for, evicting what no request holds).
  Plan Lookup(absl::Span<const int32_t> ids, int max_reuse);
  // How many of `ids`' first tokens a Lookup would find, without using or filling anything.
  int CachedTokens(absl::Span<const int32_t> ids) const;
  // After a layer of the prefill: plan.fill's rows of `layer`, token t's K at k + t·stride
  // (kv_dim floats) and V at v + t·stride, into the blocks.
  absl::Status Capture(const Plan& plan, int layer, const float* k, const float* v, int64_t stride);
  // After the prefill: plan.fill becomes visible to later lookups when it ran `whole`, else it
  // is dropped. Every plan ends here (PrefillEngine does it on every path).
  void Finish(Plan& plan, bool whole);

  // A block's bytes for a model of `layers` layers of `kv_dim` K (and V) values per token.
  static size_t BlockBytes(int layers, int kv_dim, int block_tokens) {
    return static_cast<size_t>(layers) * block_tokens * 2 * kv_dim * sizeof(float);
  }
  int block_tokens() const { return block_tokens_; }
  size_t block_bytes() const { return block_bytes_; }
  struct Counters {
    int64_t bytes = 0;  // blocks allocated, visible or being filled
    int64_t blocks = 0;
    int64_t evictions = 0;
  };
  Counters counters() const;

 private:
  std::shared_ptr<Block> NewBlockLocked();
  // The visible block that continues the chain at `key` with `tokens`, or null.
  const std::shared_ptr<Block>* FindLocked(uint64_t key, absl::Span<const int32_t> tokens,
                                           uint64_t* next) const;
  void TouchLocked(std::list<std::shared_ptr<Block>>::iterator it);

  const std::shared_ptr<kernels::KernelBackend> backend_;
  const int layers_, kv_dim_, block_tokens_;
  const size_t block_bytes_, max_bytes_;
  const uint64_t root_;  // the key a prompt's first block chains from
  mutable std::mutex mu_;
  // The visible blocks, oldest use first, each held only here unless a request reads it;
  // and where each key's is in that list.
  std::list<std::shared_ptr<Block>> lru_;
  std::unordered_map<uint64_t, std::list<std::shared_ptr<Block>>::iterator> blocks_;
  Counters counters_;
};

}  // namespace kvwire
