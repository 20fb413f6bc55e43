// Translation between the kvwire/v1 protobuf messages and kvwire's domain types, and the
// one place where absl::Status becomes grpc::Status (the codes map one to one).
#pragma once

#include <grpcpp/grpcpp.h>

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/wire/kv_wire.h"
#include "kvwire/v1/generation.pb.h"
#include "kvwire/v1/kv.pb.h"
#include "kvwire/v1/prefill.pb.h"

namespace kvwire {

// A status about a request field (FieldOf) carries a google.rpc.BadRequest naming it in the
// rich error details; FromGrpcStatus reads it back.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);
// The first field a google.rpc.Status (grpc::Status::error_details) names in a BadRequest.
std::optional<std::string> FieldOfDetails(const std::string& error_details);

// The fields set in `params` by parameter name (ApplyCompressionValues's names).
ParamValues CompressionValuesFromProto(const v1::CompressionParams& params);
// Overlays the fields set in `params` on `config` (the server's defaults): a policy other
// than the config's starts from its own defaults, and a field that does not apply to the
// resulting policy is InvalidArgument naming it ("compression.kernel does not apply to
// snapkv_pp ..."), and so is a name in `params` that has a field of its own. The result is
// validated.
absl::Status ApplyCompressionParams(const v1::CompressionParams& params, CompressionConfig* config);
// What the decode node sends the prefill node: the policy and every parameter it takes
// (and only those), so that the receiving node rebuilds exactly `config`.
v1::CompressionParams ToProto(const CompressionConfig& config);

v1::KvDType ToProto(DType dtype);
absl::StatusOr<DType> FromProto(v1::KvDType dtype);

v1::KvHeader ToProto(const WireHeader& header);
absl::StatusOr<WireHeader> FromProto(const v1::KvHeader& header);
// Moves the payload bytes.
void ToProto(WireChunk chunk, v1::KvChunk* out);
// A decode cache in a shared region (the shm transport): its name, size and shape, and back,
// every field checked (the shape must be one KvCache::Create lays out in exactly `bytes`).
v1::KvRegion ToProto(const std::string& name, size_t bytes, const KvCacheShape& shape);
absl::Status FromProto(const v1::KvRegion& region, std::string* name, size_t* bytes,
                       KvCacheShape* shape);
// A decode cache in pages of a device pool (the cuda_ipc and nccl transports): on cuda_ipc the
// slab's IPC handle, on nccl the decode node's link name (`peer`), the slab's bytes, the shape,
// and where the cache lies, and back; the counts and bounds are checked here, the layout
// against the shape by KvCache::CreatePagedView.
v1::KvRegion ToProto(KvTransport transport, const std::string& peer, size_t slab_bytes,
                     const KvCacheShape& shape, const KvCache::PagedPlace& place);
absl::Status FromProto(const v1::KvRegion& region, KvTransport transport, std::string* peer,
                       size_t* slab_bytes, KvCacheShape* shape, KvCache::PagedPlace* place);
WireChunk FromProto(v1::KvChunk* chunk);
v1::KvTrailer ToProto(const WireTrailer& trailer);
WireTrailer FromProto(const v1::KvTrailer& trailer);

}  // namespace kvwire
