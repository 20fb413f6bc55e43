#include "openai_front/front.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <grpcpp/generic/generic_stub.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/server/grpc_util.h"
#include "proto/convert.h"

namespace kvwire::openai {

using Clock = std::chrono::steady_clock;

struct Front::Call {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  int socket = -1;  // the client's connection (-1: not found, not watched)
  std::string path;
  std::atomic<bool> client_left{false};
  std::atomic<bool> ended{false};  // EndCall ran
  Clock::time_point start;
};

namespace {

constexpr char kDone[] = "data: [DONE]\n\n";

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string RequestId(bool chat) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%s%016x%016x", chat ? "chatcmpl-" : "cmpl-", rng(), rng());
}

std::string Sse(const Json& event) {
  return "data: " + event.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

void ReplyJson(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, Json::error_handler_t::replace), "application/json");
}

void ReplyError(httplib::Response& res, const ApiError& e) { ReplyJson(res, e.status, e.Body()); }

// "RESOURCE_EXHAUSTED" ...: gRPC's codes are Abseil's.
std::string GrpcCodeName(const grpc::Status& st) {
  return absl::StatusCodeToString(FromGrpcStatus(st).code());
}

// The socket of the connection `req` came on. Debian's cpp-httplib (0.11) hands handlers no
// socket and has no Request::is_connection_closed (0.20 and later), so it is found by its
// addresses: the one socket whose peer and local ports are the request's. A worker thread
// serves one connection at a time, so the last one found is tried first.
int ConnectionSocket(const httplib::Request& req) {
  auto port_of = [](const sockaddr_storage& a) -> int {
    if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
    if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
    return -1;
  };
  auto matches = [&](int fd) {
    sockaddr_storage peer{}, local{};
    socklen_t n = sizeof(peer), m = sizeof(local);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &n) != 0 ||
        port_of(peer) != req.remote_port ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &m) != 0 ||
        port_of(local) != req.local_port) {
      return false;
    }
    // Two clients may use the same port: the peer's address decides (httplib writes it with
    // getnameinfo too).
    char host[NI_MAXHOST];
    return getnameinfo(reinterpret_cast<sockaddr*>(&peer), n, host, sizeof(host), nullptr, 0,
                       NI_NUMERICHOST) == 0 &&
           req.remote_addr == host;
  };
  thread_local int last = -1;
  if (last >= 0 && matches(last)) return last;
  // The open descriptors, not every number up to RLIMIT_NOFILE (a million in many containers).
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0' && fd != dirfd(dir) && matches(static_cast<int>(fd))) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return last = found;
}

// Linux's TCP_CORK: while set, writes wait in the kernel to leave together (the headers with
// the first event, the last events with the end of the body).
void Cork(int fd, bool on) {
  if (fd < 0) return;
  const int v = on ? 1 : 0;
  setsockopt(fd, IPPROTO_TCP, TCP_CORK, &v, sizeof(v));
}

}  // namespace

Front::Front(const FrontOptions& options) : options_(options), created_(UnixNow()) {}

absl::StatusOr<std::unique_ptr<Front>> Front::Start(const FrontOptions& options,
                                                    std::unique_ptr<ChatTemplate> chat_template) {
  std::unique_ptr<Front> f(new Front(options));
  f->chat_template_ = std::move(chat_template);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                   MakeChannelCredentials(ClientTls{options.tls_ca, "", "", ""}));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  f->channel_ = grpc::CreateCustomChannel(options.target, creds, args);
  f->stub_ = v1::Generation::NewStub(f->channel_);

  auto http = std::make_unique<httplib::Server>();
  const int threads = options.threads > 0 ? options.threads : options.max_inflight + 32;
  http->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http->set_payload_max_length(options.max_body_bytes);
  http->set_tcp_nodelay(true);
  http->set_keep_alive_max_count(100000);
  // Each read of a request may wait 30 s (a client that sends nothing for that long is
  // dropped); idle keep-alive connections close after 5 s. A client that trickles bytes holds
  // its worker longer: deployments put the front behind a proxy or a Service whose load
  // balancer bounds whole requests.
  http->set_read_timeout(std::chrono::seconds(30));
  http->set_write_timeout(options.send_timeout);
  Front* self = f.get();
  http->set_pre_routing_handler([](const httplib::Request& req, httplib::Response&) {
    // No response is compressed: events are written as they come and must leave at once
    // (a compressor holds them back), and the bodies are small. The handlers get the request
    // as const; httplib owns it as a plain object.
    const_cast<httplib::Request&>(req).headers.erase("Accept-Encoding");
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http->Get("/v1/models",
            [self](const httplib::Request& q, httplib::Response& r) { self->Models(q, r); });
  http->Get(R"(/v1/models/(.+))",
            [self](const httplib::Request& q, httplib::Response& r) { self->Models(q, r); });
  http->Post("/v1/completions", [self](const httplib::Request& q, httplib::Response& r) {
    self->Generate(q, r, /*chat=*/false);
  });
  http->Post("/v1/chat/completions", [self](const httplib::Request& q, httplib::Response& r) {
    self->Generate(q, r, /*chat=*/true);
  });
  http->Get("/health", [self](const httplib::Request&, httplib::Response& r) { self->Health(r); });
  http->Get("/health/live", [](const httplib::Request&, httplib::Response& r) {
    ReplyJson(r, 200, Json{{"status", "ok"}});
  });
  // httplib's own refusals (no such route, a body over --max-body-bytes, a malformed request)
  // in OpenAI's error shape too.
  http->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string what = res.status == 404   ? "no route " + req.method + " " + req.path
                       : res.status == 413 ? "the request body is larger than --max-body-bytes"
                                           : "the request could not be served";
    ApiError e{res.status, what, std::nullopt,
               res.status == 404 ? "not_found_error" : "invalid_request_error"};
    ReplyError(res, e);
  });
  if (options.access_log) {
    http->set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "kvwire-openai %s:%d \"%s %s\" %d\n", req.remote_addr.c_str(),
                   req.remote_port, req.method.c_str(), req.path.c_str(), res.status);
    });
  }
  if (options.port == 0) {
    f->port_ = http->bind_to_any_port(options.host);
  } else {
    f->port_ = http->bind_to_port(options.host, options.port) ? options.port : -1;
  }
  if (f->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.host, ":", options.port, " (in use?)"));
  }
  f->http_ = std::move(http);
  auto returned = std::make_shared<std::atomic<bool>>(false);
  f->listener_ = std::thread([self, returned] {
    self->http_->listen_after_bind();
    *returned = true;
  });
  // httplib's stop() does nothing before the listener's loop has started (0.11 has no
  // wait_until_ready), so a Shutdown right after Start would wait for it forever.
  while (!f->http_->is_running() && !*returned) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (*returned) {
    f->listener_.join();
    return absl::InternalError("the HTTP listener stopped as it started");
  }
  f->watcher_ = std::thread([self] { self->WatchLoop(); });
  return f;
}

Front::~Front() { Shutdown(std::chrono::milliseconds(0)); }

void Front::Shutdown(std::chrono::milliseconds grace) {
  if (!listener_.joinable()) return;
  // Drain first: new requests get 503 while those in flight have `grace` to finish; then the
  // calls left are cancelled (a stream ends with an error event and [DONE], a whole answer
  // with its 503), and only then does the listener stop. Stopping httplib first would end
  // responses whose body has not begun (a stream still waiting for its first token) with no
  // body at all.
  {
    std::unique_lock<std::mutex> lock(mu_);
    draining_ = true;
    if (!drained_.wait_for(lock, grace, [this] { return inflight_ == 0; })) {
      cancel_all_ = true;
      for (Call* c : watched_) c->context.TryCancel();
      drained_.wait_for(lock, std::chrono::seconds(10), [this] { return inflight_ == 0; });
    }
  }
  http_->stop();  // closes the listener; the workers end with their connections
  listener_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  watch_wake_.notify_all();
  watcher_.join();
}

std::optional<ApiError> Front::Watch(Call* call) {
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_) {
    return ApiError{503, "the front is shutting down (SIGTERM): retry on another replica",
                    std::nullopt, "service_unavailable_error", "shutting_down"};
  }
  if (inflight_ >= options_.max_inflight) {
    return ApiError{429,
                    absl::StrCat("the front has ", options_.max_inflight,
                                 " requests in flight (--max-inflight)"),
                    std::nullopt, "rate_limit_error", "rate_limit_exceeded"};
  }
  ++inflight_;
  watched_.insert(call);
  return std::nullopt;
}

void Front::Unwatch(Call* call) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    watched_.erase(call);
    --inflight_;
  }
  drained_.notify_all();
}

void Front::WatchLoop() {
  std::vector<pollfd> fds;
  std::vector<Call*> calls;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    watch_wake_.wait_for(lock, options_.disconnect_poll, [this] { return stopping_; });
    fds.clear();
    calls.clear();
    for (Call* c : watched_) {
      if (c->socket < 0 || c->client_left) continue;
      fds.push_back({c->socket, POLLRDHUP, 0});
      calls.push_back(c);
    }
    if (fds.empty() || poll(fds.data(), fds.size(), 0) <= 0) continue;
    // The calls stay registered (and alive) while mu_ is held.
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
        calls[i]->client_left = true;
        calls[i]->context.TryCancel();
        std::fprintf(stderr, "kvwire-openai: client of %s left: cancelling its Generate call\n",
                     calls[i]->path.c_str());
      }
    }
  }
}

void Front::Models(const httplib::Request& req, httplib::Response& res) {
  const Json model = {{"id", options_.model_id},
                      {"object", "model"},
                      {"created", created_},
                      {"owned_by", "kvwire"}};
  if (req.matches.size() > 1) {
    const std::string name = req.matches[1];
    if (name != options_.model_id) {
      return ReplyError(res, {404, absl::StrCat("model '", name, "' is not served here"), "model",
                              "not_found_error", "model_not_found"});
    }
    return ReplyJson(res, 200, model);
  }
  ReplyJson(res, 200, Json{{"object", "list"}, {"data", Json::array({model})}});
}

void Front::Health(httplib::Response& res) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) {  // not ready: the Service stops sending here
      return ReplyJson(res, 503, Json{{"status", "draining"}, {"target", options_.target}});
    }
  }
  // Ready while the gRPC target answers grpc.health.v1.Health/Check with SERVING.
  grpc::GenericStub stub(channel_);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.health_timeout);
  grpc::Slice empty;  // an empty HealthCheckRequest: the whole server
  grpc::ByteBuffer request(&empty, 1), reply;
  // The completion-queue API, not the callback one: a callback call would start gRPC's
  // callback thread, which then polls every connection and hands each Generate message to
  // its worker thread, a thread switch per message.
  grpc::CompletionQueue cq;
  grpc::Status st;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  call->Finish(&reply, &st, &cq);
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);  // bounded by the deadline
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (st.ok() && reply.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices)
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (!st.ok()) {
    return ReplyJson(
        res, 503,
        Json{{"status", "unavailable"}, {"target", options_.target}, {"reason", GrpcCodeName(st)}});
  }
  if (bytes != std::string("\x08\x01", 2)) {  // HealthCheckResponse{status: SERVING}
    return ReplyJson(res, 503, Json{{"status", "not serving"}, {"target", options_.target}});
  }
  ReplyJson(res, 200,
            Json{{"status", "ok"}, {"target", options_.target}, {"model", options_.model_id}});
}

Json Front::Envelope(bool chat, bool chunk, const std::string& id, int64_t created) const {
  return Json{
      {"id", id},
      {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
      {"created", created},
      {"model", options_.model_id}};
}

void Front::Generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  const Clock::time_point start = Clock::now();
  ParseResult p =
      chat ? ParseChat(req.body, options_.model_id) : ParseCompletion(req.body, options_.model_id);
  if (p.error) return ReplyError(res, *p.error);
  ParsedRequest& parsed = p.parsed;
  if (chat) {
    absl::StatusOr<std::string> prompt =
        chat_template_->Render(parsed.messages.dump(-1, ' ', false, Json::error_handler_t::replace),
                               parsed.add_generation_prompt);
    if (!prompt.ok()) {
      return ReplyError(res, BadField("messages", absl::StrCat("the chat template refused them: ",
                                                               prompt.status().message())));
    }
    parsed.request.set_prompt(*std::move(prompt));
  }
  auto call = std::make_unique<Call>();
  call->start = start;
  call->path = req.path;
  call->socket = ConnectionSocket(req);
  call->context.set_deadline(std::chrono::system_clock::now() + options_.timeout);
  parsed.request.set_request_id(RequestId(chat));
  if (std::optional<ApiError> refused = Watch(call.get())) {
    if (refused->status == 503) res.set_header("Connection", "close");
    return ReplyError(res, *refused);
  }
  call->reader = stub_->Generate(&call->context, parsed.request);
  if (parsed.stream) {
    AnswerStream(std::move(call), parsed, res);
  } else {
    AnswerWhole(std::move(call), parsed, res);
  }
}

void Front::AnswerWhole(std::unique_ptr<Call> call, const ParsedRequest& parsed,
                        httplib::Response& res) {
  std::string text;
  std::vector<std::string> tokens;
  std::vector<float> logprobs;
  std::optional<v1::Final> final;
  std::optional<Clock::time_point> first;
  v1::GenerateResponse msg;
  while (call->reader->Read(&msg)) {
    if (msg.token_ids_size() > 0 && !first) first = Clock::now();
    text += msg.text();
    if (parsed.logprobs) {
      for (std::string& t : TokenTexts(msg)) tokens.push_back(std::move(t));
      logprobs.insert(logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    }
    if (msg.has_final()) final = msg.final();
  }
  const grpc::Status st = EndCall(*call, /*cancel=*/false);
  if (!st.ok()) {
    return ReplyError(res, FromGrpc(FromGrpcStatus(st), parsed.chat, parsed.max_tokens_field));
  }
  if (!final) {
    return ReplyError(res, {502, "the decode tier ended the stream without its final message",
                            std::nullopt, "server_error"});
  }
  const double ttft =
      std::chrono::duration<double, std::milli>(first.value_or(Clock::now()) - call->start).count();
  const std::string& id = parsed.request.request_id();
  Json body = Envelope(parsed.chat, /*chunk=*/false, id, UnixNow());
  Json choice;
  choice["index"] = 0;
  size_t offset = 0;
  if (parsed.chat) {
    choice["message"] = Json{{"role", "assistant"}, {"content", text}};
    choice["logprobs"] = parsed.logprobs ? ChatLogprobs(tokens, logprobs) : Json();
  } else {
    choice["text"] = text;
    choice["logprobs"] = parsed.logprobs ? CompletionLogprobs(tokens, logprobs, &offset) : Json();
  }
  choice["finish_reason"] = FinishReason(final->finish_reason());
  body["choices"] = Json::array({std::move(choice)});
  body["usage"] = Usage(*final, ttft);
  ReplyJson(res, 200, body);
}

void Front::AnswerStream(std::unique_ptr<Call> call, const ParsedRequest& parsed,
                         httplib::Response& res) {
  // The first message is awaited before the response starts, so that a request the decode
  // tier refuses gets its HTTP status (400, 429, 503 ...) rather than an error event.
  auto first = std::make_shared<v1::GenerateResponse>();
  if (!call->reader->Read(first.get())) {
    const grpc::Status st = EndCall(*call, /*cancel=*/false);
    if (!st.ok()) {
      return ReplyError(res, FromGrpc(FromGrpcStatus(st), parsed.chat, parsed.max_tokens_field));
    }
    return ReplyError(res, {502, "the decode tier ended the stream without any message",
                            std::nullopt, "server_error"});
  }
  const double ttft = MsSince(call->start);
  const int64_t created = UnixNow();
  const std::string id = parsed.request.request_id();
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Request-Id", id);
  const bool chat = parsed.chat, want_logprobs = parsed.logprobs,
             include_usage = parsed.include_usage, continuous = parsed.continuous_usage;
  const int64_t prompt_tokens = first->prompt_tokens();

  // A token's event without logprobs, the hot path, is bytes around its text: the JSON of
  // the event with a placeholder, split once per request.
  auto event = [this, chat, id, created](Json fields, const char* finish, Json logprobs) {
    Json e = Envelope(chat, /*chunk=*/true, id, created);
    Json choice;
    choice["index"] = 0;
    for (auto& [k, v] : fields.items()) choice[k] = v;
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = finish ? Json(finish) : Json();
    e["choices"] = Json::array({std::move(choice)});
    return e;
  };
  const std::string mark = "\x01text\x01";
  const std::string templ = Sse(
      event(chat ? Json{{"delta", {{"content", mark}}}} : Json{{"text", mark}}, nullptr, Json()));
  const std::string quoted_mark = QuoteJson(mark);
  const size_t at = templ.find(quoted_mark);
  const std::string before = templ.substr(0, at), after = templ.substr(at + quoted_mark.size());

  Cork(call->socket, true);  // the headers leave with the first event
  std::shared_ptr<Call> shared(std::move(call));
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, shared, first, event, before, after, id, created, chat, want_logprobs, include_usage,
       continuous, prompt_tokens, ttft,
       max_tokens_field = parsed.max_tokens_field](size_t, httplib::DataSink& sink) {
        Call& c = *shared;
        size_t offset = 0;
        int64_t completion_tokens = 0;
        // continuous_usage_stats: the counts so far, on every chunk (as vLLM sends them).
        auto counted = [&](Json e) {
          if (continuous) {
            e["usage"] = Json{{"prompt_tokens", prompt_tokens},
                              {"completion_tokens", completion_tokens},
                              {"total_tokens", prompt_tokens + completion_tokens}};
          }
          return Sse(e);
        };
        bool role_sent = false, corked = true;
        auto send = [&](const std::string& data) {
          const bool ok = sink.write(data.data(), data.size());
          if (corked) {
            Cork(c.socket, false);
            corked = false;
          }
          return ok;
        };
        auto finish = [&](const std::string& data) {
          Cork(c.socket, true);  // the last events, [DONE] and the end of the body together
          const std::string all = data + kDone;
          const bool ok = sink.write(all.data(), all.size());
          if (ok) sink.done();
          Cork(c.socket, false);
          return ok;
        };
        v1::GenerateResponse& msg = *first;
        for (bool have = true; have; have = c.reader->Read(&msg)) {
          completion_tokens += msg.token_ids_size();
          if (msg.token_ids_size() > 0 || !msg.text().empty()) {
            Json lp;
            if (want_logprobs) {
              const std::vector<std::string> toks = TokenTexts(msg);
              const std::vector<float> lps(msg.logprobs().begin(), msg.logprobs().end());
              lp = chat ? ChatLogprobs(toks, lps) : CompletionLogprobs(toks, lps, &offset);
            }
            std::string data;
            if (chat && !role_sent) {
              role_sent = true;
              data =
                  counted(event(Json{{"delta", {{"role", "assistant"}, {"content", msg.text()}}}},
                                nullptr, std::move(lp)));
            } else if (lp.is_null() && !continuous) {
              data = before + QuoteJson(msg.text()) + after;
            } else if (chat) {
              data = counted(
                  event(Json{{"delta", {{"content", msg.text()}}}}, nullptr, std::move(lp)));
            } else {
              data = counted(event(Json{{"text", msg.text()}}, nullptr, std::move(lp)));
            }
            if (!send(data)) return EndCall(c, /*cancel=*/true), false;
          }
          if (msg.has_final()) {
            const v1::Final& f = msg.final();
            Json fields =
                chat ? Json{{"delta", role_sent ? Json::object()
                                                : Json{{"role", "assistant"}, {"content", ""}}}}
                     : Json{{"text", ""}};
            Json last = event(std::move(fields), FinishReason(f.finish_reason()), Json());
            std::string ending;
            if (include_usage) {
              last["usage"] = nullptr;
              Json tail = Envelope(chat, /*chunk=*/true, id, created);
              tail["choices"] = Json::array();
              tail["usage"] = Usage(f, ttft);
              ending = counted(std::move(last)) + Sse(tail);
            } else {
              last["usage"] = Usage(f, ttft);  // kvwire's figures ride on the last chunk
              ending = Sse(last);
            }
            const bool ok = finish(ending);
            EndCall(c, /*cancel=*/!ok);
            return ok;
          }
        }
        const grpc::Status st = EndCall(c, /*cancel=*/false);
        const ApiError e = st.ok() ? ApiError{500, "the stream ended without its final message",
                                              std::nullopt, "server_error", "internal"}
                                   : FromGrpc(FromGrpcStatus(st), chat, max_tokens_field);
        return finish(Sse(e.Body()));
      },
      // Normally the provider ends the call; this ends one whose response was abandoned
      // before the provider ran (the client gone before the headers were written).
      [this, shared](bool) { EndCall(*shared, /*cancel=*/true); });
}

grpc::Status Front::EndCall(Call& call, bool cancel) {
  if (call.ended.exchange(true)) return grpc::Status::OK;
  if (cancel) call.context.TryCancel();
  v1::GenerateResponse rest;
  while (call.reader->Read(&rest)) {
  }
  const grpc::Status st = call.reader->Finish();
  Unwatch(&call);  // and frees its slot
  return st;
}

}  // namespace kvwire::openai
