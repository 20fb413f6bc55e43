// gRPC plumbing shared by the nodes: TLS credentials from PEM files (mutual TLS when a CA
// for the peer is given) and the address helpers.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/server/tls_options.h"

namespace kvwire {

// Decode nodes ping their prefill nodes this often (HTTP/2 keepalive) and give up on a
// connection whose ping goes unanswered for kKeepaliveTimeoutMs: how a hung (stopped,
// partitioned) node is found while its TCP connection still looks open.
inline constexpr int kKeepaliveMs = 10000;
inline constexpr int kKeepaliveTimeoutMs = 5000;

// True when `listen` (HOST:PORT) is a loopback address: 127.x.x.x, [::1], localhost.
bool IsLoopbackAddress(const std::string& listen);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTls& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls);

// The services' methods are raw (ByteBuffer in and out): the request is parsed here, so that
// bytes that are not a message get INVALID_ARGUMENT saying so where gRPC's own parsing
// answers UNIMPLEMENTED with no message, and each response is serialized as it is queued.
template <typename Msg>
absl::Status ParseRequest(const grpc::ByteBuffer& raw, Msg* msg) {
  grpc::ByteBuffer bytes(raw);  // shares the slices; Deserialize consumes its argument
  if (!grpc::SerializationTraits<Msg>::Deserialize(&bytes, msg).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the request (", raw.Length(),
                                                   " bytes) could not be parsed as ",
                                                   Msg::descriptor()->full_name()));
  }
  return absl::OkStatus();
}

template <typename Msg>
grpc::ByteBuffer SerializeMessage(const Msg& msg) {
  grpc::ByteBuffer out;
  bool own_buffer = false;
  // Fails only beyond protobuf's 2 GiB message limit, which no response comes near.
  KVWIRE_CHECK(grpc::SerializationTraits<Msg>::Serialize(msg, &out, &own_buffer).ok());
  return out;
}

// Reads a whole file; NotFound naming it when it cannot be read.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// A shared bearer token from a file (a Kubernetes Secret, say): its content less trailing
// whitespace, which must be 16 to 4096 visible ASCII characters.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

}  // namespace kvwire
