#include "tools/replay.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/engine/prefill_engine.h"
#include "common/sparse/rocketkv.h"
#include "common/wire/kv_wire.h"

namespace kvwire::tools {

absl::Status CapturedPrefill::OnLayer(const PrefillLayer& l) {
  Layer c;
  c.len = l.len;
  c.window = l.window;
  // The layer's K and V rows on the host: each a stretch from the first token's row to the
  // last one's end (the rows between belong to the layer's other activations).
  const size_t span = static_cast<size_t>(l.len - 1) * l.kv_stride + kv_dim_;
  std::vector<float> k(span), v(span);
  RETURN_IF_ERROR(l.backend->CopyToHost(k.data(), l.k, span * sizeof(float)));
  RETURN_IF_ERROR(l.backend->CopyToHost(v.data(), l.v, span * sizeof(float)));
  // Only each token's kv_dim values.
  c.k.resize(l.len * kv_dim_);
  c.v.resize(l.len * kv_dim_);
  for (int t = 0; t < l.len; ++t) {
    std::copy_n(k.data() + t * l.kv_stride, kv_dim_, c.k.data() + t * kv_dim_);
    std::copy_n(v.data() + t * l.kv_stride, kv_dim_, c.v.data() + t * kv_dim_);
  }
  if (l.window_scores) {
    c.scores.resize(static_cast<size_t>(l.window) * l.len * n_heads_);
    RETURN_IF_ERROR(
        l.backend->CopyToHost(c.scores.data(), l.window_scores, c.scores.size() * sizeof(float)));
  }
  layers_.push_back(std::move(c));
  return absl::OkStatus();
}

absl::Status CapturedPrefill::Replay(PrefillObserver& observer) const {
  std::vector<float> rows;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& c = layers_[i];
    PrefillLayer l;
    l.layer = static_cast<int>(i);
    l.len = c.len;
    l.backend = host_.get();
    l.k = c.k.data();
    l.v = c.v.data();
    l.kv_stride = kv_dim_;
    const int want = std::min(observer.window(c.len), c.len);
    if (want > 0 && observer.NeedsScores(l.layer, c.len)) {
      if (c.scores.empty() || want > c.window) {
        return absl::InternalError(absl::StrCat("replay needs ", want,
                                                " rows of window scores; the prefill captured ",
                                                c.scores.empty() ? 0 : c.window));
      }
      l.window = want;
      l.window_scores = c.scores.data();
      if (want < c.window) {
        // [head, row, position]: each head's last `want` rows.
        const size_t len = c.len;
        rows.resize(static_cast<size_t>(n_heads_) * want * len);
        for (int h = 0; h < n_heads_; ++h) {
          const float* from =
              c.scores.data() + (static_cast<size_t>(h) * c.window + c.window - want) * len;
          std::copy(from, from + want * len, rows.begin() + static_cast<size_t>(h) * want * len);
        }
        l.window_scores = rows.data();
      }
    }
    RETURN_IF_ERROR(observer.OnLayer(l));
  }
  return absl::OkStatus();
}

int ScoreRows(const CompressionConfig& compression, int len) {
  return compression.NeedsScores() && compression.Compresses(len)
             ? std::min(compression.window, len)
             : 0;
}

absl::StatusOr<ResolvedMethod> Resolve(CompressionConfig compression,
                                       DecodeAttentionConfig attention, int len, int max_new,
                                       const ModelConfig& model) {
  if (compression.NeedsScores()) compression.window = std::min(compression.window, len);
  RETURN_IF_ERROR(compression.Validate());
  RETURN_IF_ERROR(ResolveTwoStage(&compression, &attention, len, max_new, model.head_dim));
  return ResolvedMethod{std::move(compression), std::move(attention)};
}

namespace {

// Sends each layer through the wire's own code, chunked and coded in the request's KV format
// and assembled into the cache by the receiver's checks, as the pair would.
class WireCacheSink final : public CompressedLayerSink {
 public:
  WireCacheSink(KvAssembler* assembler, KvFormat format) : assembler_(assembler), format_(format) {}
  absl::Status Accept(CompressedLayer layer) override {
    for (const WireChunk& chunk : ChunkLayer(layer, format_, kDefaultMaxChunkBytes)) {
      RETURN_IF_ERROR(assembler_->OnChunk(chunk));
    }
    return absl::OkStatus();
  }

 private:
  KvAssembler* assembler_;
  KvFormat format_;
};

}  // namespace

absl::StatusOr<ReplayedCache> ReplayInto(const LlamaModel& model, const CapturedPrefill& cap,
                                         const CompressionConfig& config, int extra) {
  const int len = cap.len();
  RETURN_IF_ERROR(CheckKvFormat(config.kv_format, model.config().head_dim));
  KvCacheShape shape = CompressedCacheShape(config, model.config(), model.kv_dtype(), len, extra);
  shape.format = DecodeCacheFormat(config.kv_format);
  ReplayedCache out;
  ASSIGN_OR_RETURN(out.cache, KvCache::Create(shape, HeapKvAllocator()));
  out.cache->set_prompt_len(len);
  KvAssembler assembler(StreamExpectation(model, config, len, kDefaultMaxChunkBytes),
                        out.cache.get());
  RETURN_IF_ERROR(assembler.OnHeader(StreamHeader(model, config, len)));
  WireCacheSink sink(&assembler, config.kv_format);
  Compressor compressor(config, model.config(), model.kv_dtype(), &sink);
  RETURN_IF_ERROR(cap.Replay(compressor));
  out.kv_payload_bytes = assembler.payload_bytes();
  out.full_cache_bytes = int64_t{len} * model.config().KvBytesPerToken(model.kv_dtype());
  out.full_bf16_bytes = int64_t{len} * model.config().KvBytesPerToken(DType::kBF16);
  return out;
}

}  // namespace kvwire::tools
