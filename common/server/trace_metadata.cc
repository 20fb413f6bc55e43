#include "common/server/trace_metadata.h"

namespace kvwire {

TraceContext TraceFromMetadata(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  auto it = metadata.find("traceparent");
  if (it == metadata.end()) return TraceContext();
  return TraceContext::Parse(absl::string_view(it->second.data(), it->second.size()));
}

void InjectTrace(const TraceContext& trace, grpc::ClientContext* ctx) {
  if (trace.valid()) ctx->AddMetadata("traceparent", trace.ToTraceparent());
}

}  // namespace kvwire
