// W3C trace context in gRPC metadata: the `traceparent` header a call carries from client
// to decode node to prefill node (the context itself is in common/telemetry).
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>

#include "common/telemetry/telemetry.h"

namespace kvwire {

// The context of an incoming call; invalid (a new trace) when the header is absent or
// malformed, as the spec asks.
TraceContext TraceFromMetadata(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata);

// Adds the traceparent header to an outgoing call (nothing for an invalid context).
void InjectTrace(const TraceContext& trace, grpc::ClientContext* ctx);

}  // namespace kvwire
