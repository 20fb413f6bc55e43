#include "prefill_service/translate.h"

#include <algorithm>

#include "common/base/status.h"
#include "proto/convert.h"

namespace kvwire {

namespace {

// How the rows travel, and where a transport that writes the decode node's cache writes.
absl::Status TranslateTransport(const v1::PrefillRequest& req, PrefillJob* job) {
  switch (req.kv_transport()) {
    case v1::KV_TRANSPORT_GRPC:
      if (req.has_region()) {
        return absl::InvalidArgumentError(
            "region: applies to the shm, cuda_ipc and nccl KV transports; this request's is grpc");
      }
      return absl::OkStatus();
    case v1::KV_TRANSPORT_SHM:
      if (!req.has_region()) {
        return absl::InvalidArgumentError("region: the shm KV transport needs the decode cache's");
      }
      job->transport = KvTransport::kShm;
      return FromProto(req.region(), &job->region_name, &job->region_bytes, &job->region_shape);
    case v1::KV_TRANSPORT_CUDA_IPC:
      if (!req.has_region()) {
        return absl::InvalidArgumentError(
            "region: the cuda_ipc KV transport needs the decode pool's slab and the cache's pages");
      }
      job->transport = KvTransport::kCudaIpc;
      return FromProto(req.region(), job->transport, &job->region_handle, &job->region_bytes,
                       &job->region_shape, &job->region_place);
    case v1::KV_TRANSPORT_NCCL:
      if (!req.has_region()) {
        return absl::InvalidArgumentError(
            "region: the nccl KV transport needs the decode node's name and the cache's pages");
      }
      job->transport = KvTransport::kNccl;
      return FromProto(req.region(), job->transport, &job->link_peer, &job->region_bytes,
                       &job->region_shape, &job->region_place);
    default:
      return AboutField(
          absl::InvalidArgumentError(absl::StrCat("kv_transport: unknown transport ",
                                                  static_cast<int>(req.kv_transport()))),
          "kv_transport");
  }
}

}  // namespace

absl::StatusOr<PrefillJob> TranslatePrefillRequest(const v1::PrefillRequest& req) {
  PrefillJob job;
  job.request_id = req.request_id();
  job.prompt_ids.assign(req.prompt_ids().begin(), req.prompt_ids().end());
  RETURN_IF_ERROR(ApplyCompressionParams(req.compression(), &job.compression));
  job.model_fingerprint = req.model_fingerprint();
  job.max_chunk_bytes = req.max_chunk_bytes() == 0
                            ? kDefaultMaxChunkBytes
                            : std::min<size_t>(req.max_chunk_bytes(), kMaxChunkBytesLimit);
  job.sampling.temperature = req.temperature();
  job.sampling.top_p = req.top_p() == 0 ? 1.f : req.top_p();  // 0: unset
  job.sampling.top_k = req.top_k();
  job.seed = req.seed();
  if (absl::Status st = TranslateTransport(req, &job); !st.ok()) {
    return FieldOf(st) ? st : AboutField(std::move(st), "region");
  }
  return job;
}

}  // namespace kvwire
