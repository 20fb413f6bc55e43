// kvwire's OpenAI-compatible HTTP front: GET /v1/models, POST /v1/completions,
// POST /v1/chat/completions (stream true or false: server-sent events ending with
// `data: [DONE]`), GET /health (ready: the gRPC target answers its health check) and
// GET /health/live. Each request becomes one kvwire.v1.Generation/Generate call to the target
// (the router, or a decode node), so every limit and check of the decode tier applies; its
// gRPC status becomes OpenAI's error JSON with the matching HTTP code. docs/openai.md has the
// fields, the mapping, why it is C++ and the figures.
//
// cpp-httplib serves HTTP/1.1 with a thread per connection; each request's Generate call is a
// blocking gRPC stream read on that thread, so a token costs one read and one write. A
// watcher thread polls the sockets of the requests in flight: a client that hangs up (even
// one waiting for its first token, when no write could fail) cancels its call, and the decode
// node frees its KV pages.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "openai_front/api.h"
#include "openai_front/chat_template_python.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kvwire::openai {

struct FrontOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                                // 0: a free port, port() says which
  std::string target;                             // gRPC target of Generate
  std::string tls_ca;                             // CA certificate of the target (enables TLS)
  std::string model_id;                           // the model id clients name
  std::chrono::milliseconds timeout{300000};      // deadline of each Generate call
  std::chrono::milliseconds send_timeout{30000};  // longest wait for a client to take a write
  std::chrono::milliseconds health_timeout{2000};
  std::chrono::milliseconds disconnect_poll{200};  // how often hang-ups are looked for
  int max_inflight = 256;  // requests in flight beyond which the front answers 429
  int threads = 0;         // HTTP worker threads (0: max_inflight + 32)
  size_t max_body_bytes = 4 << 20;
  bool access_log = false;
};

class Front {
 public:
  // Binds the listener and starts serving; `chat_template` renders chat requests.
  static absl::StatusOr<std::unique_ptr<Front>> Start(const FrontOptions& options,
                                                      std::unique_ptr<ChatTemplate> chat_template);
  ~Front();
  int port() const { return port_; }
  // Stops accepting; requests in flight get `grace` to finish, then their calls are cancelled.
  void Shutdown(std::chrono::milliseconds grace);

  struct Call;  // one Generate call in flight (front.cc)

 private:
  explicit Front(const FrontOptions& options);
  void Models(const httplib::Request& req, httplib::Response& res);
  void Health(httplib::Response& res);
  void Generate(const httplib::Request& req, httplib::Response& res, bool chat);
  void AnswerWhole(std::unique_ptr<Call> call, const ParsedRequest& parsed, httplib::Response& res);
  void AnswerStream(std::unique_ptr<Call> call, const ParsedRequest& parsed,
                    httplib::Response& res);
  Json Envelope(bool chat, bool chunk, const std::string& id, int64_t created) const;
  // Ends a call once (later calls return OK): cancels it when asked, reads what is left,
  // takes its status, unregisters it and frees its slot.
  grpc::Status EndCall(Call& call, bool cancel);

  // The registry of calls in flight, which the disconnect watcher and Shutdown read. Watch
  // takes a slot (429 beyond --max-inflight, 503 while draining); Unwatch frees it.
  std::optional<ApiError> Watch(Call* call);
  void Unwatch(Call* call);
  void WatchLoop();

  FrontOptions options_;
  std::unique_ptr<ChatTemplate> chat_template_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  int64_t created_ = 0;
  std::thread listener_;

  std::mutex mu_;
  std::condition_variable watch_wake_;  // the watcher: stop
  std::condition_variable drained_;     // Shutdown: a call ended
  std::set<Call*> watched_;
  int inflight_ = 0;
  bool draining_ = false;
  bool cancel_all_ = false;
  bool stopping_ = false;
  std::thread watcher_;
};

}  // namespace kvwire::openai
