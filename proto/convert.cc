#include "proto/convert.h"

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numbering (both follow the
  // canonical codes), so the cast is exact.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status ApplyCompressionParams(const v1::CompressionParams& p, CompressionConfig* c) {
  auto field = [](const char* name, const absl::Status& st) {
    return absl::InvalidArgumentError(absl::StrCat("compression.", name, ": ", st.message()));
  };
  if (!p.policy().empty()) {
    auto policy = ParsePolicy(p.policy());
    if (!policy.ok()) return field("policy", policy.status());
    if (*policy != c->policy) {
      // A different policy than the server default: its budget does not carry over.
      c->budget = 0;
      c->ratio = 0;
    }
    c->policy = *policy;
  }
  if (p.has_budget()) c->budget = p.budget();
  if (p.has_ratio()) {
    c->ratio = p.ratio();
    if (!p.has_budget()) c->budget = 0;
  }
  if (p.has_window()) c->window = p.window();
  if (!p.pool().empty()) {
    auto pool = ParsePool(p.pool());
    if (!pool.ok()) return field("pool", pool.status());
    c->pool = *pool;
  }
  if (p.has_kernel()) c->kernel = p.kernel();
  if (!p.gqa().empty()) {
    auto gqa = ParseGqa(p.gqa());
    if (!gqa.ok()) return field("gqa", gqa.status());
    c->gqa = *gqa;
  }
  if (p.has_kernel_small()) c->kernel_small = p.kernel_small();
  if (p.has_kernel_large()) c->kernel_large = p.kernel_large();
  if (p.has_kernel_threshold()) c->kernel_threshold = p.kernel_threshold();
  if (p.has_chunk()) c->chunk = p.chunk();
  if (p.has_reuse_layers()) c->reuse_layers = p.reuse_layers();
  if (p.has_block()) c->block = p.block();
  if (p.groups_size() > 0) c->groups.assign(p.groups().begin(), p.groups().end());
  if (p.has_sinks()) c->sinks = p.sinks();
  if (p.has_seed()) c->seed = p.seed();
  if (p.has_skip_layers()) c->skip_layers = p.skip_layers();
  return c->Validate();
}

v1::CompressionParams ToProto(const CompressionConfig& c) {
  v1::CompressionParams p;
  p.set_policy(std::string(PolicyName(c.policy)));
  p.set_budget(c.budget);
  p.set_ratio(c.ratio);
  p.set_window(c.window);
  p.set_pool(std::string(PoolName(c.pool)));
  p.set_kernel(c.kernel);
  p.set_gqa(std::string(GqaName(c.gqa)));
  p.set_kernel_small(c.kernel_small);
  p.set_kernel_large(c.kernel_large);
  p.set_kernel_threshold(c.kernel_threshold);
  p.set_chunk(c.chunk);
  p.set_reuse_layers(c.reuse_layers);
  p.set_block(c.block);
  for (int g : c.groups) p.add_groups(g);
  p.set_sinks(c.sinks);
  p.set_seed(c.seed);
  p.set_skip_layers(c.skip_layers);
  return p;
}

v1::KvDType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::KV_DTYPE_F32;
    case DType::kBF16:
      return v1::KV_DTYPE_BF16;
    case DType::kF16:
      return v1::KV_DTYPE_F16;
  }
  return v1::KV_DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::KvDType dtype) {
  switch (dtype) {
    case v1::KV_DTYPE_F32:
      return DType::kF32;
    case v1::KV_DTYPE_BF16:
      return DType::kBF16;
    case v1::KV_DTYPE_F16:
      return DType::kF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("malformed KV stream: unknown KV dtype ", static_cast<int>(dtype)));
  }
}

v1::KvHeader ToProto(const WireHeader& h) {
  v1::KvHeader p;
  p.set_format_version(h.format_version);
  p.set_model_fingerprint(h.model_fingerprint);
  p.set_num_layers(h.num_layers);
  p.set_num_cache_heads(h.num_cache_heads);
  p.set_head_dim(h.head_dim);
  p.set_dtype(ToProto(h.dtype));
  p.set_policy(h.policy);
  p.set_prompt_len(h.prompt_len);
  for (int k : h.kept_per_layer) p.add_kept_per_layer(k);
  return p;
}

absl::StatusOr<WireHeader> FromProto(const v1::KvHeader& p) {
  // Counts arrive as uint32; anything beyond int range is nonsense, not a big model.
  constexpr uint32_t kMax = 1u << 30;
  if (p.num_layers() > kMax || p.num_cache_heads() > kMax || p.head_dim() > kMax ||
      p.prompt_len() > kMax) {
    return absl::InvalidArgumentError("malformed KV stream: header counts out of range");
  }
  WireHeader h;
  h.format_version = p.format_version();
  h.model_fingerprint = p.model_fingerprint();
  h.num_layers = static_cast<int>(p.num_layers());
  h.num_cache_heads = static_cast<int>(p.num_cache_heads());
  h.head_dim = static_cast<int>(p.head_dim());
  ASSIGN_OR_RETURN(h.dtype, FromProto(p.dtype()));
  h.policy = p.policy();
  h.prompt_len = static_cast<int>(p.prompt_len());
  for (uint32_t k : p.kept_per_layer()) {
    if (k > kMax) return absl::InvalidArgumentError("malformed KV stream: kept count out of range");
    h.kept_per_layer.push_back(static_cast<int>(k));
  }
  return h;
}

void ToProto(WireChunk c, v1::KvChunk* p) {
  p->set_layer(c.layer);
  p->set_head_begin(c.head_begin);
  p->set_head_count(c.head_count);
  p->set_token_begin(c.token_begin);
  p->set_token_count(c.token_count);
  p->set_positions(std::move(c.positions));
  p->set_k(std::move(c.k));
  p->set_v(std::move(c.v));
  p->set_crc32c(c.crc32c);
}

WireChunk FromProto(v1::KvChunk* p) {
  // uint32 fields beyond int range become negative and fail the assembler's checks.
  WireChunk c;
  c.layer = static_cast<int>(p->layer());
  c.head_begin = static_cast<int>(p->head_begin());
  c.head_count = static_cast<int>(p->head_count());
  c.token_begin = static_cast<int>(p->token_begin());
  c.token_count = static_cast<int>(p->token_count());
  c.positions = std::move(*p->mutable_positions());
  c.k = std::move(*p->mutable_k());
  c.v = std::move(*p->mutable_v());
  c.crc32c = p->crc32c();
  return c;
}

v1::KvTrailer ToProto(const WireTrailer& t) {
  v1::KvTrailer p;
  p.set_first_token(t.first_token);
  p.set_first_logprob(t.first_logprob);
  p.set_forward_ms(t.forward_ms);
  p.set_compress_ms(t.compress_ms);
  p.set_full_cache_bytes(t.full_cache_bytes);
  p.set_kv_payload_bytes(t.kv_payload_bytes);
  p.set_chunks(t.chunks);
  p.set_node(t.node);
  return p;
}

WireTrailer FromProto(const v1::KvTrailer& p) {
  WireTrailer t;
  t.first_token = p.first_token();
  t.first_logprob = p.first_logprob();
  t.forward_ms = p.forward_ms();
  t.compress_ms = p.compress_ms();
  t.full_cache_bytes = p.full_cache_bytes();
  t.kv_payload_bytes = p.kv_payload_bytes();
  t.chunks = static_cast<int>(p.chunks());
  t.node = p.node();
  return t;
}

}  // namespace kvwire
