// TLS for clients and mutual TLS between the nodes, with certificates made by the
// openssl command for each run: the pair works with the right certificates and refuses a
// decode node that presents none.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "common/server/grpc_util.h"
#include "decode_service/decode_server.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "prefill_service/prefill_server.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

// A CA and, signed by it, a server certificate for localhost/127.0.0.1 and a client one.
bool MakeCertificates(const std::string& dir) {
  const std::string ext = dir + "/san.ext";
  testing::WriteFile(ext, "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
  const std::string script =
      "set -e; cd '" + dir +
      "';"
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
      "  -subj /CN=kvwire-test-ca 2>/dev/null;"
      "for n in server client; do "
      "  openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr -subj /CN=localhost "
      "2>/dev/null;"
      "  openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $n.pem "
      "    -days 2 -extfile san.ext 2>/dev/null;"
      "done";
  testing::WriteFile(dir + "/make.sh", script);
  return std::system(("bash '" + dir + "/make.sh'").c_str()) == 0 &&
         !testing::ReadFile(dir + "/client.pem").empty();
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("command -v openssl >/dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl";
    dir_ = testing::MakeTempDir("tls");
    ASSERT_TRUE(MakeCertificates(dir_));
    LoadOptions o;
    o.threads = 1;
    auto m = LlamaModel::Load("synthetic:tiny", o);
    ASSERT_TRUE(m.ok());
    model_ = std::move(*m);
  }
  std::string F(const std::string& name) { return dir_ + "/" + name; }

  absl::StatusOr<std::unique_ptr<DecodeServer>> StartDecode(int prefill_port, bool client_cert) {
    DecodeServerOptions o;
    o.listen = "127.0.0.1:0";
    o.prefill_target = "127.0.0.1:" + std::to_string(prefill_port);
    o.prefill_tls = {F("ca.pem"), client_cert ? F("client.pem") : "",
                     client_cert ? F("client.key") : "", ""};
    o.tls = {F("server.pem"), F("server.key"), ""};
    o.engine.prefill_attempts = 1;
    o.engine.prefill_wait_ms = 1000;  // how long a node that refuses the handshake is retried
    return DecodeServer::Start(model_.get(), o);
  }

  grpc::Status Generate(int port, int* tokens) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = testing::ReadFile(F("ca.pem"));
    auto stub = v1::Generation::NewStub(
        grpc::CreateChannel("localhost:" + std::to_string(port), grpc::SslCredentials(ssl)));
    v1::GenerateRequest req;
    req.set_prompt("hello there");
    req.mutable_sampling()->set_max_tokens(5);
    req.mutable_sampling()->set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse r;
    *tokens = 0;
    while (reader->Read(&r)) *tokens += r.token_ids_size();
    return reader->Finish();
  }

  std::string dir_;
  std::unique_ptr<LlamaModel> model_;
};

TEST_F(TlsTest, MutualTlsBetweenNodesAndTlsForClients) {
  PrefillServerOptions p;
  p.listen = "127.0.0.1:0";
  p.tls = {F("server.pem"), F("server.key"), F("ca.pem")};  // clients must present a cert
  PrefillEngine engine(model_.get(), {});
  auto prefill = PrefillServer::Start(&engine, p);
  ASSERT_TRUE(prefill.ok()) << prefill.status();

  auto decode = StartDecode((*prefill)->port(), /*client_cert=*/true);
  ASSERT_TRUE(decode.ok()) << decode.status();
  int tokens = 0;
  const grpc::Status ok = Generate((*decode)->port(), &tokens);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(tokens, 5);

  // Without a client certificate the prefill node refuses the handshake.
  auto anonymous = StartDecode((*prefill)->port(), /*client_cert=*/false);
  ASSERT_TRUE(anonymous.ok());
  const grpc::Status refused = Generate((*anonymous)->port(), &tokens);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_NE(refused.error_message().find("no prefill node could be reached for 1000 ms"),
            std::string::npos)
      << refused.error_message();
  // Pages come back when the engine notices the failure, just after the client hears of it.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((*anonymous)->pool().used() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ((*anonymous)->pool().used(), 0u);
}

TEST_F(TlsTest, MissingOrHalfConfiguredCertificatesAreErrors) {
  EXPECT_EQ(MakeServerCredentials({F("server.pem"), "", ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeServerCredentials({F("nope.pem"), F("server.key"), ""}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(MakeChannelCredentials({"", F("client.pem"), F("client.key"), ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto st = MakeChannelCredentials({F("missing-ca.pem"), "", "", ""}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(st.message()).find("missing-ca.pem"), std::string::npos);
}

}  // namespace
}  // namespace kvwire
