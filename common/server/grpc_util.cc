#include "common/server/grpc_util.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/base/status.h"

namespace kvwire {

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  ASSIGN_OR_RETURN(std::string token, ReadTextFile(path));
  token = std::string(absl::StripTrailingAsciiWhitespace(token));
  if (token.size() < 16 || token.size() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("the token in ", path, " has ", token.size(),
                                                   " characters; expected 16 to 4096"));
  }
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the token in ", path, " may hold only visible ASCII characters (no spaces)"));
    }
  }
  return token;
}

bool IsLoopbackAddress(const std::string& listen) {
  absl::string_view host(listen);
  if (absl::ConsumePrefix(&host, "[")) {  // [v6]:port
    return host.substr(0, host.find(']')) == "::1";
  }
  host = host.substr(0, host.rfind(':'));
  return host == "localhost" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTls& tls) {
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "a client CA needs the server's own --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  grpc::SslServerCredentialsOptions opts(
      tls.client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadTextFile(tls.cert_file));
  ASSIGN_OR_RETURN(pair.private_key, ReadTextFile(tls.key_file));
  opts.pem_key_cert_pairs.push_back(pair);
  if (!tls.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(opts.pem_root_certs, ReadTextFile(tls.client_ca_file));
  }
  return grpc::SslServerCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTls& tls) {
  if (tls.ca_file.empty()) {
    if (!tls.cert_file.empty()) {
      return absl::InvalidArgumentError("a client certificate needs the CA to trust (--*-tls-ca)");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions opts;
  ASSIGN_OR_RETURN(opts.pem_root_certs, ReadTextFile(tls.ca_file));
  if (!tls.cert_file.empty() || !tls.key_file.empty()) {
    if (tls.cert_file.empty() || tls.key_file.empty()) {
      return absl::InvalidArgumentError("mutual TLS needs both the client certificate and key");
    }
    ASSIGN_OR_RETURN(opts.pem_cert_chain, ReadTextFile(tls.cert_file));
    ASSIGN_OR_RETURN(opts.pem_private_key, ReadTextFile(tls.key_file));
  }
  return grpc::SslCredentials(opts);
}

}  // namespace kvwire
