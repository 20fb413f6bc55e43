// What a prefill is asked to do, in domain terms: the request of the prefill engine and of
// every KvSource (whatever carries it: in process, the Prefill RPC, a GPU transport).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/base/clock.h"
#include "common/compression/compression.h"
#include "common/telemetry/telemetry.h"
#include "common/wire/kv_wire.h"
#include "kernels/sampling.h"

namespace kvwire {

// One prefill, in domain terms.
struct PrefillJob {
  std::string request_id;
  std::vector<int32_t> prompt_ids;
  CompressionConfig compression;     // resolved: no two-stage policy left
  kernels::SamplingParams sampling;  // of the first token, sampled here
  uint64_t seed = 0;                 // the first token takes the first draw of this seed
  size_t max_chunk_bytes = kDefaultMaxChunkBytes;
  std::optional<std::string> model_fingerprint;  // checked when set (another node's request)
  Clock::TimePoint deadline = Clock::TimePoint::max();
  TraceContext trace;
  int attempt = 0;  // the request's attempts before this one (a router tries another node)
  // How the K/V rows travel, and where a transport that writes the decode node's cache writes
  // (a cache of `region_shape`): shm into the shared region `region_name` of `region_bytes`;
  // cuda_ipc into the pages `region_place` of the device pool whose slab, of `region_bytes`,
  // the IPC handle `region_handle` maps; nccl sends to the decode node `link_peer`, whose pages
  // `region_place` of a slab of `region_bytes` receive.
  KvTransport transport = KvTransport::kGrpc;
  std::string region_name;
  std::string region_handle;
  std::string link_peer;
  size_t region_bytes = 0;
  KvCacheShape region_shape;
  KvCache::PagedPlace region_place;
};

}  // namespace kvwire
