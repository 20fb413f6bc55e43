// Where a node's TLS material is: plain settings, apart from the gRPC credentials made from
// them (grpc_util.h), so that option structs holding them need no gRPC header.
#pragma once

#include <string>

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

}  // namespace kvwire
