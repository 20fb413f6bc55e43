// gRPC plumbing shared by the nodes: TLS credentials from PEM files (mutual TLS when a CA
// for the peer is given) and the address helpers.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvwire {

struct ServerTls {
  std::string cert_file, key_file;  // the node's certificate chain and key (PEM); empty: plaintext
  std::string client_ca_file;       // set: clients must present a certificate this CA signed
};

struct ClientTls {
  std::string ca_file;              // set: TLS, trusting this CA; empty: plaintext
  std::string cert_file, key_file;  // the client certificate for mutual TLS
  std::string server_name;          // overrides the name checked against the certificate
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTls& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls);

// Reads a whole file; NotFound naming it when it cannot be read.
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

}  // namespace kvwire
