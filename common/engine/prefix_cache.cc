#include "common/engine/prefix_cache.h"

#include "absl/strings/str_cat.h"
#include "common/base/splitmix.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

// A 64-bit hash of a block's tokens chained to its parent's (SplitMix64 over each token):
// stable within the process, which is all the cache needs (the tokens are compared too).
uint64_t ChainHash(uint64_t parent, absl::Span<const int32_t> tokens) {
  uint64_t h = SplitMix64(parent);
  for (int32_t t : tokens) h = SplitMix64(h ^ static_cast<uint32_t>(t));
  return h;
}

}  // namespace

struct PrefixCache::Block {
  Block(kernels::KernelBackend* backend, void* data) : backend(backend), data(data) {}
  ~Block() { backend->Free(data); }
  kernels::KernelBackend* const backend;
  void* const data;  // [layers][block_tokens][2 · kv_dim] floats
  uint64_t key = 0, parent = 0;
  std::vector<int32_t> tokens;
  const float* layer(int l, size_t layer_floats) const {
    return static_cast<const float*>(data) + l * layer_floats;
  }
};

PrefixCache::PrefixCache(std::shared_ptr<kernels::KernelBackend> backend, int layers, int kv_dim,
                         int block_tokens, size_t max_bytes, const std::string& model)
    : backend_(std::move(backend)),
      layers_(layers),
      kv_dim_(kv_dim),
      block_tokens_(block_tokens),
      block_bytes_(BlockBytes(layers, kv_dim, block_tokens)),
      max_bytes_(max_bytes),
      root_(ChainHash(0, std::vector<int32_t>(model.begin(), model.end()))) {}

PrefixCache::~PrefixCache() = default;

PrefixCache::Counters PrefixCache::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void PrefixCache::TouchLocked(std::list<std::shared_ptr<Block>>::iterator it) {
  lru_.splice(lru_.end(), lru_, it);
}

// A block's memory, evicting the least recently used blocks no request holds until it fits;
// null when it cannot.
std::shared_ptr<PrefixCache::Block> PrefixCache::NewBlockLocked() {
  for (auto it = lru_.begin();
       static_cast<size_t>(counters_.bytes) + block_bytes_ > max_bytes_ && it != lru_.end();) {
    if (it->use_count() > 1) {  // a request reads it (or is filling it: not listed yet)
      ++it;
      continue;
    }
    blocks_.erase((*it)->key);
    it = lru_.erase(it);  // frees it: nothing else holds it
    counters_.bytes -= static_cast<int64_t>(block_bytes_);
    --counters_.blocks;
    ++counters_.evictions;
  }
  if (static_cast<size_t>(counters_.bytes) + block_bytes_ > max_bytes_) return nullptr;
  auto data = backend_->Allocate(block_bytes_);
  if (!data.ok()) return nullptr;
  counters_.bytes += static_cast<int64_t>(block_bytes_);
  ++counters_.blocks;
  return std::make_shared<Block>(backend_.get(), *data);
}

const std::shared_ptr<PrefixCache::Block>* PrefixCache::FindLocked(uint64_t key,
                                                                   absl::Span<const int32_t> tokens,
                                                                   uint64_t* next) const {
  *next = ChainHash(key, tokens);
  auto it = blocks_.find(*next);
  if (it == blocks_.end()) return nullptr;
  const std::shared_ptr<Block>& block = *it->second;
  if (block->parent != key ||
      !std::equal(tokens.begin(), tokens.end(), block->tokens.begin(), block->tokens.end())) {
    return nullptr;  // a hash collision
  }
  return &block;
}

int PrefixCache::CachedTokens(absl::Span<const int32_t> ids) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t key = root_, next = 0;
  int b = 0;
  for (; (b + 1) * block_tokens_ <= static_cast<int>(ids.size()); ++b) {
    if (FindLocked(key, ids.subspan(b * block_tokens_, block_tokens_), &next) == nullptr) break;
    key = next;
  }
  return b * block_tokens_;
}

PrefixCache::Plan PrefixCache::Lookup(absl::Span<const int32_t> ids, int max_reuse) {
  Plan plan;
  plan.prefix.block_tokens = block_tokens_;
  const int whole = static_cast<int>(ids.size()) / block_tokens_;
  const size_t layer_floats = static_cast<size_t>(block_tokens_) * 2 * kv_dim_;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t key = root_;
  int b = 0;
  for (; b < whole && (b + 1) * block_tokens_ <= max_reuse; ++b) {
    uint64_t next = 0;
    const std::shared_ptr<Block>* found =
        FindLocked(key, ids.subspan(b * block_tokens_, block_tokens_), &next);
    if (found == nullptr) break;
    const std::shared_ptr<Block>& block = *found;
    plan.held.push_back(block);
    std::vector<const float*> layers(layers_);
    for (int l = 0; l < layers_; ++l) layers[l] = block->layer(l, layer_floats);
    plan.prefix.blocks.push_back(std::move(layers));
    key = next;
  }
  // The first block most recent: eviction takes a chain from its end.
  for (auto h = plan.held.rbegin(); h != plan.held.rend(); ++h) {
    TouchLocked(blocks_.at((*h)->key));
  }
  plan.fill_from = b * block_tokens_;
  for (; b < whole; ++b) {
    const absl::Span<const int32_t> tokens = ids.subspan(b * block_tokens_, block_tokens_);
    const uint64_t next = ChainHash(key, tokens);
    if (blocks_.count(next) > 0) break;  // another request filled it meanwhile: stop here
    std::shared_ptr<Block> block = NewBlockLocked();
    if (block == nullptr) break;
    block->key = next;
    block->parent = key;
    block->tokens.assign(tokens.begin(), tokens.end());
    plan.fill.push_back(std::move(block));
    key = next;
  }
  return plan;
}

absl::Status PrefixCache::Capture(const Plan& plan, int layer, const float* k, const float* v,
                                  int64_t stride) {
  std::vector<kernels::ByteSpan> spans(2 * static_cast<size_t>(block_tokens_));
  const auto row = static_cast<int64_t>(kv_dim_ * sizeof(float));
  const size_t layer_floats = static_cast<size_t>(block_tokens_) * 2 * kv_dim_;
  for (size_t b = 0; b < plan.fill.size(); ++b) {
    const int64_t first = plan.fill_from + static_cast<int64_t>(b) * block_tokens_;
    for (int t = 0; t < block_tokens_; ++t) {
      spans[2 * t] = {reinterpret_cast<const uint8_t*>(k + (first + t) * stride), row};
      spans[2 * t + 1] = {reinterpret_cast<const uint8_t*>(v + (first + t) * stride), row};
    }
    auto* dst = const_cast<float*>(plan.fill[b]->layer(layer, layer_floats));
    RETURN_IF_ERROR(backend_->PackSpans({spans.data(), static_cast<int>(spans.size()),
                                         reinterpret_cast<uint8_t*>(dst), /*unpack=*/false}));
  }
  return absl::OkStatus();
}

void PrefixCache::Finish(Plan& plan, bool whole) {
  std::lock_guard<std::mutex> lock(mu_);
  plan.held.clear();
  plan.prefix.blocks.clear();
  if (!whole) {
    counters_.bytes -= static_cast<int64_t>(plan.fill.size() * block_bytes_);
    counters_.blocks -= static_cast<int64_t>(plan.fill.size());
    plan.fill.clear();
    return;
  }
  for (auto it = plan.fill.rbegin(); it != plan.fill.rend(); ++it) {
    std::shared_ptr<Block>& block = *it;
    if (blocks_.count(block->key) > 0) {
      // Filled twice at once: the first stays, and this one goes with the plan.
      counters_.bytes -= static_cast<int64_t>(block_bytes_);
      --counters_.blocks;
      continue;
    }
    blocks_[block->key] = lru_.insert(lru_.end(), block);
  }
  plan.fill.clear();
}

}  // namespace kvwire
