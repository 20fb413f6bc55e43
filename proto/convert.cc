#include "proto/convert.h"

#include <algorithm>
#include <type_traits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace kvwire {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numbering (both follow the
  // canonical codes), so the cast is exact.
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message(status.message());
  const std::optional<std::string> field = FieldOf(status);
  if (!field) return grpc::Status(code, message);
  // The rich error model: google.rpc.Status with a BadRequest naming the field, sent as the
  // grpc-status-details-bin trailer that gRPC clients of every language decode.
  google::rpc::BadRequest bad;
  google::rpc::BadRequest::FieldViolation* v = bad.add_field_violations();
  v->set_field(*field);
  v->set_description(message);
  google::rpc::Status rich;
  rich.set_code(static_cast<int>(code));
  rich.set_message(message);
  rich.add_details()->PackFrom(bad);
  return grpc::Status(code, message, rich.SerializeAsString());
}

std::optional<std::string> FieldOfDetails(const std::string& error_details) {
  google::rpc::Status rich;
  if (error_details.empty() || !rich.ParseFromString(error_details)) return std::nullopt;
  for (const google::protobuf::Any& any : rich.details()) {
    google::rpc::BadRequest bad;
    if (any.UnpackTo(&bad) && bad.field_violations_size() > 0) {
      return bad.field_violations(0).field();
    }
  }
  return std::nullopt;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status st(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (auto field = FieldOfDetails(status.error_details())) st = AboutField(std::move(st), *field);
  return st;
}

namespace {

// The typed fields of CompressionParams by parameter name; `params` carries any other.
struct TypedField {
  const char* name;
  bool (v1::CompressionParams::*has)() const;
  std::string (*get)(const v1::CompressionParams&);
  void (*set)(const std::string&, v1::CompressionParams*);
};

#define KVWIRE_INT_FIELD(field)                                                        \
  TypedField {                                                                         \
#field, &v1::CompressionParams::has_##field,                                         \
        [](const v1::CompressionParams& p) { return absl::StrCat(p.field()); },          \
        [](const std::string& v, v1::CompressionParams* p) {                             \
          /* The values come from a valid config (CompressionValues): exact in the type. */ \
          std::remove_cv_t<decltype(p->field())> x{};                                    \
          KVWIRE_CHECK(absl::SimpleAtoi(v, &x));                                         \
          p->set_##field(x);                                                             \
        } \
  }

const std::vector<TypedField>& TypedFields() {
  static const auto* const kFields = new std::vector<TypedField>{
      KVWIRE_INT_FIELD(budget),       KVWIRE_INT_FIELD(window),
      KVWIRE_INT_FIELD(kernel),       KVWIRE_INT_FIELD(kernel_small),
      KVWIRE_INT_FIELD(kernel_large), KVWIRE_INT_FIELD(kernel_threshold),
      KVWIRE_INT_FIELD(chunk),        KVWIRE_INT_FIELD(reuse_layers),
      KVWIRE_INT_FIELD(block),        KVWIRE_INT_FIELD(sinks),
      KVWIRE_INT_FIELD(seed),         KVWIRE_INT_FIELD(skip_layers),
  };
  return *kFields;
}

#undef KVWIRE_INT_FIELD

}  // namespace

ParamValues CompressionValuesFromProto(const v1::CompressionParams& p) {
  ParamValues v;
  if (!p.policy().empty()) v["policy"] = p.policy();
  for (const TypedField& f : TypedFields()) {
    if ((p.*f.has)()) v[f.name] = f.get(p);
  }
  if (p.has_ratio()) v["ratio"] = ExactDecimal(p.ratio());
  if (!p.pool().empty()) v["pool"] = p.pool();
  if (!p.gqa().empty()) v["gqa"] = p.gqa();
  if (!p.kv_format().empty()) v["kv_format"] = p.kv_format();
  if (p.groups_size() > 0) v["groups"] = absl::StrJoin(p.groups(), ",");
  for (const auto& [name, value] : p.params()) v[name] = value;
  return v;
}

absl::Status ApplyCompressionParams(const v1::CompressionParams& p, CompressionConfig* c) {
  // `params` is for parameters without a field of their own; one named there as well would
  // silently override its field (the policy, too), so it is refused.
  for (const auto& [name, value] : p.params()) {
    const bool own_field = name == "policy" || name == "ratio" || name == "pool" || name == "gqa" ||
                           name == "groups" || name == "kv_format" ||
                           std::any_of(TypedFields().begin(), TypedFields().end(),
                                       [&](const TypedField& f) { return name == f.name; });
    if (own_field) {
      return AboutField(absl::InvalidArgumentError(absl::StrCat(
                            "compression.params: '", name, "' has a field of its own, compression.",
                            name, "; set that instead")),
                        "compression.params");
    }
  }
  // Parameters named as the request's fields ("compression.kernel_small must ...").
  return RenameParams(ApplyCompressionValues(CompressionValuesFromProto(p), c),
                      [](absl::string_view name) { return absl::StrCat("compression.", name); });
}

v1::CompressionParams ToProto(const CompressionConfig& c) {
  v1::CompressionParams p;
  for (const auto& [name, value] : CompressionValues(c)) {
    if (name == "policy") {
      p.set_policy(value);
    } else if (name == "ratio") {
      double r = 0;
      KVWIRE_CHECK(absl::SimpleAtod(value, &r));
      p.set_ratio(r);
    } else if (name == "pool") {
      p.set_pool(value);
    } else if (name == "gqa") {
      p.set_gqa(value);
    } else if (name == "kv_format") {
      p.set_kv_format(value);
    } else if (name == "groups") {
      for (absl::string_view g : absl::StrSplit(value, ',')) {
        int x = 0;
        KVWIRE_CHECK(absl::SimpleAtoi(g, &x));
        p.add_groups(x);
      }
    } else {
      bool typed = false;
      for (const TypedField& f : TypedFields()) {
        if (name == f.name) {
          f.set(value, &p);
          typed = true;
        }
      }
      if (!typed) (*p.mutable_params())[name] = value;
    }
  }
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

namespace {

v1::KvFormat ToProto(KvFormat f) {
  switch (f) {
    case KvFormat::kAuto:
      return v1::KV_FORMAT_AUTO;
    case KvFormat::kBF16:
      return v1::KV_FORMAT_BF16;
    case KvFormat::kFP8:
      return v1::KV_FORMAT_FP8_E4M3;
    case KvFormat::kInt8:
      return v1::KV_FORMAT_INT8;
    case KvFormat::kInt4:
      return v1::KV_FORMAT_INT4;
  }
  return v1::KV_FORMAT_AUTO;
}

absl::StatusOr<KvFormat> FromProto(v1::KvFormat f) {
  switch (f) {
    case v1::KV_FORMAT_AUTO:
      return KvFormat::kAuto;
    case v1::KV_FORMAT_BF16:
      return KvFormat::kBF16;
    case v1::KV_FORMAT_FP8_E4M3:
      return KvFormat::kFP8;
    case v1::KV_FORMAT_INT8:
      return KvFormat::kInt8;
    case v1::KV_FORMAT_INT4:
      return KvFormat::kInt4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("malformed KV stream: unknown KV format ", static_cast<int>(f)));
  }
}

}  // namespace

namespace {

v1::KvRegion ShapeToProto(const KvCacheShape& shape) {
  v1::KvRegion p;
  p.set_n_heads(shape.n_heads);
  p.set_head_dim(shape.head_dim);
  p.set_dtype(kvwire::ToProto(shape.dtype));
  for (int c : shape.capacity) p.add_capacity(c);
  p.set_kv_format(ToProto(shape.format));
  p.set_appended(shape.appended);
  return p;
}

absl::Status BadRegion(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("region: ", what));
}

absl::Status ShapeFromProto(const v1::KvRegion& p, KvCacheShape* shape) {
  // Bounds that keep the layout's arithmetic far from overflow; a real cache is far inside.
  constexpr uint32_t kMaxDim = 1 << 16, kMaxTokens = 1 << 24;
  if (p.n_heads() < 1 || p.n_heads() > kMaxDim || p.head_dim() < 1 || p.head_dim() > kMaxDim) {
    return BadRegion(absl::StrCat(p.n_heads(), " heads of ", p.head_dim(), " values"));
  }
  if (p.capacity_size() < 1 || p.capacity_size() > 4096) {
    return BadRegion(absl::StrCat(p.capacity_size(), " layers"));
  }
  shape->n_heads = static_cast<int>(p.n_heads());
  shape->head_dim = static_cast<int>(p.head_dim());
  ASSIGN_OR_RETURN(shape->dtype, kvwire::FromProto(p.dtype()));
  shape->capacity.clear();
  for (uint32_t c : p.capacity()) {
    if (c < 1 || c > kMaxTokens) return BadRegion(absl::StrCat("a layer of ", c, " tokens"));
    shape->capacity.push_back(static_cast<int>(c));
  }
  ASSIGN_OR_RETURN(shape->format, FromProto(p.kv_format()));
  if (shape->format == KvFormat::kBF16 ||
      (KvCoded(shape->format) && !CheckKvFormat(shape->format, shape->head_dim).ok())) {
    return BadRegion(absl::StrCat("a cache cannot keep rows in ", KvFormatName(shape->format),
                                  " at ", shape->head_dim, " values per head"));
  }
  if (p.appended() > kMaxTokens) return BadRegion(absl::StrCat(p.appended(), " appended tokens"));
  shape->appended = static_cast<int>(p.appended());
  return absl::OkStatus();
}

}  // namespace

v1::KvRegion ToProto(const std::string& name, size_t bytes, const KvCacheShape& shape) {
  v1::KvRegion p = ShapeToProto(shape);
  p.set_name(name);
  p.set_bytes(bytes);
  return p;
}

absl::Status FromProto(const v1::KvRegion& p, std::string* name, size_t* bytes,
                       KvCacheShape* shape) {
  RETURN_IF_ERROR(ShapeFromProto(p, shape));
  if (!p.ipc_handle().empty() || p.page_bytes() != 0 || p.page_tables_size() != 0 ||
      p.side_offset() != 0 || !p.link_peer().empty()) {
    return BadRegion(
        "ipc_handle, page_bytes, page_tables, side_offset and link_peer apply to the cuda_ipc "
        "and nccl transports; this request's is shm");
  }
  if (!IsSharedRegionName(p.name())) {
    return BadRegion(absl::StrCat("'", p.name(), "' is not a kvwire shared region's name"));
  }
  *name = p.name();
  *bytes = static_cast<size_t>(p.bytes());
  if (*bytes != KvCache::BytesFor(*shape)) {
    return BadRegion(
        absl::StrCat(*bytes, " bytes, but its shape lays out in ", KvCache::BytesFor(*shape)));
  }
  return absl::OkStatus();
}

v1::KvRegion ToProto(KvTransport transport, const std::string& peer, size_t slab_bytes,
                     const KvCacheShape& shape, const KvCache::PagedPlace& place) {
  v1::KvRegion p = ShapeToProto(shape);
  if (transport == KvTransport::kNccl) {
    p.set_link_peer(peer);
  } else {
    p.set_ipc_handle(peer);
  }
  p.set_bytes(slab_bytes);
  p.set_page_bytes(place.page_bytes);
  for (const auto& table : place.tables) {
    p.add_page_tables()->mutable_pages()->Assign(table.begin(), table.end());
  }
  if (place.side_offset >= 0) p.set_side_offset(static_cast<uint64_t>(place.side_offset));
  return p;
}

absl::Status FromProto(const v1::KvRegion& p, KvTransport transport, std::string* peer,
                       size_t* slab_bytes, KvCacheShape* shape, KvCache::PagedPlace* place) {
  RETURN_IF_ERROR(ShapeFromProto(p, shape));
  const absl::string_view name = KvTransportName(transport);
  if (!p.name().empty()) {
    return BadRegion(absl::StrCat("name applies to the shm transport; this request's is ", name));
  }
  if (transport == KvTransport::kNccl) {
    if (!p.ipc_handle().empty()) {
      return BadRegion("ipc_handle applies to the cuda_ipc transport; this request's is nccl");
    }
    if (!IsLinkPeerName(p.link_peer())) {
      return BadRegion(absl::StrCat("link_peer '", p.link_peer(),
                                    "': nccl needs the decode node's name for its links (1 to "
                                    "64 letters, digits, '-' or '_')"));
    }
    *peer = p.link_peer();
  } else {
    if (!p.link_peer().empty()) {
      return BadRegion("link_peer applies to the nccl transport; this request's is cuda_ipc");
    }
    // A CUDA IPC handle is 64 bytes; the guarded backend's emulation names its buffers in text.
    if (p.ipc_handle().empty() || p.ipc_handle().size() > 256) {
      return BadRegion(absl::StrCat("an IPC handle of ", p.ipc_handle().size(),
                                    " bytes (cuda_ipc needs the pool's, 1 to 256)"));
    }
    *peer = p.ipc_handle();
  }
  if (p.page_bytes() == 0 || p.bytes() < p.page_bytes() || p.bytes() > (uint64_t{1} << 48)) {
    return BadRegion(absl::StrCat("pages of ", p.page_bytes(), " bytes in a slab of ", p.bytes()));
  }
  if (p.page_tables_size() != p.capacity_size()) {
    return BadRegion(
        absl::StrCat(p.page_tables_size(), " page tables for ", p.capacity_size(), " layers"));
  }
  *slab_bytes = static_cast<size_t>(p.bytes());
  place->page_bytes = static_cast<size_t>(p.page_bytes());
  place->tables.clear();
  for (const v1::KvPageTable& t : p.page_tables()) {
    place->tables.emplace_back(t.pages().begin(), t.pages().end());
  }
  if (!KvCoded(shape->format) && p.side_offset() != 0) {
    return BadRegion("side_offset applies to a coded cache (fp8, int8, int4) only");
  }
  if (p.side_offset() > p.bytes()) {
    return BadRegion(
        absl::StrCat("side_offset ", p.side_offset(), " past the slab's ", p.bytes(), " bytes"));
  }
  place->side_offset = KvCoded(shape->format) ? static_cast<int64_t>(p.side_offset()) : -1;
  return absl::OkStatus();
}

v1::KvHeader ToProto(const WireHeader& h) {
  v1::KvHeader p;
  p.set_format_version(h.format_version);
  p.set_model_fingerprint(h.model_fingerprint);
  p.set_num_layers(h.num_layers);
  p.set_num_cache_heads(h.num_cache_heads);
  p.set_head_dim(h.head_dim);
  p.set_dtype(ToProto(h.dtype));
  p.set_kv_format(ToProto(h.kv_format));
  p.set_policy(h.policy);
  p.set_prompt_len(h.prompt_len);
  for (int k : h.kept_per_layer) p.add_kept_per_layer(k);
  p.set_link_name(h.link_name);
  p.set_link_offer(h.link_offer);
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
  ASSIGN_OR_RETURN(h.kv_format, FromProto(p.kv_format()));
  h.policy = p.policy();
  h.prompt_len = static_cast<int>(p.prompt_len());
  for (uint32_t k : p.kept_per_layer()) {
    if (k > kMax) return absl::InvalidArgumentError("malformed KV stream: kept count out of range");
    h.kept_per_layer.push_back(static_cast<int>(k));
  }
  h.link_name = p.link_name();
  h.link_offer = p.link_offer();
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
  p->set_placed(c.placed);
  p->set_placed_bytes(static_cast<uint64_t>(c.placed_bytes));
  p->set_link_seq(c.link_seq);
  p->set_link_bytes(static_cast<uint64_t>(c.link_bytes));
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
  c.placed = p->placed();
  // Beyond int64 it is negative, and the assembler refuses it.
  c.placed_bytes = static_cast<int64_t>(p->placed_bytes());
  c.link_seq = p->link_seq();
  c.link_bytes = static_cast<int64_t>(p->link_bytes());
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
  p.set_cached_tokens(static_cast<uint32_t>(t.cached_tokens));
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
  // Beyond int range it is negative, and the assembler refuses it.
  t.cached_tokens = static_cast<int>(p.cached_tokens());
  return t;
}

}  // namespace kvwire
