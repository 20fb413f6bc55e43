// kvwire-openai's server (openai_front/front.cc) over a scripted Generation service on a real
// gRPC port: answers whole and streamed, the decode tier's refusals as HTTP statuses, a failure
// mid-stream as an error event, the deadline, --max-inflight, clients that hang up before their
// first token (the call is cancelled), httplib's own refusals in OpenAI's shape, no compressed
// events, and a shutdown that cancels what outlives its grace. The front against real nodes is
// tests/openai/openai_e2e_test.py.
#include "openai_front/front.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "proto/convert.h"

namespace kvwire::openai {
namespace {

using namespace std::chrono_literals;

// Answers by prompt: "ok" three tokens and a final message; "slow" nothing until cancelled
// (counted) or 10 s; "refuse" INVALID_ARGUMENT about max_tokens; "full" RESOURCE_EXHAUSTED;
// "break" one token, then UNAVAILABLE.
class ScriptedGeneration final : public v1::Generation::Service {
 public:
  std::atomic<int> cancelled{0};
  std::atomic<int> started{0};

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* out) override {
    ++started;
    const std::string& p = req->prompt();
    if (p == "refuse") {
      // As a decode node refuses: the field in the status's google.rpc.BadRequest.
      return ToGrpcStatus(
          AboutField(absl::InvalidArgumentError("sampling.max_tokens: 9999 exceeds 4096"),
                     "sampling.max_tokens"));
    }
    if (p == "full") return {grpc::StatusCode::RESOURCE_EXHAUSTED, "the KV pool is full"};
    if (p == "slow") {
      for (int i = 0; i < 1000 && !ctx->IsCancelled(); ++i) std::this_thread::sleep_for(10ms);
      if (ctx->IsCancelled()) ++cancelled;
      return grpc::Status::CANCELLED;
    }
    const std::vector<std::string> texts = {"Once", " upon", " a"};
    for (size_t i = 0; i < texts.size(); ++i) {
      v1::GenerateResponse m;
      m.set_request_id(req->request_id());
      m.add_token_ids(static_cast<int>(10 + i));
      m.set_text(texts[i]);
      if (i == 0) m.set_prompt_tokens(4);  // as a decode node counts it, on the first message
      if (req->return_logprobs()) {
        m.add_logprobs(-0.5f * (i + 1));
        m.add_token_texts(texts[i]);
      }
      if (p == "break" && i == 1) return {grpc::StatusCode::UNAVAILABLE, "decode node lost"};
      if (i + 1 == texts.size()) {
        v1::Final* f = m.mutable_final();
        f->set_finish_reason(v1::FINISH_REASON_LENGTH);
        f->mutable_usage()->set_prompt_tokens(4);
        f->mutable_usage()->set_completion_tokens(3);
        f->mutable_stats()->set_full_cache_bytes(4096);
        f->mutable_stats()->set_wire_bytes(512);
        f->mutable_stats()->set_ttft_ms(1.5);
      }
      out->Write(m);
    }
    return grpc::Status::OK;
  }
};

class FrontTest : public ::testing::Test {
 protected:
  void SetUp() override { StartFront(FrontOptions{}); }

  void StartFront(FrontOptions o, const std::string& chat_template_file = "") {
    if (!grpc_) {
      grpc::EnableDefaultHealthCheckService(true);
      grpc::ServerBuilder b;
      b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &grpc_port_);
      b.RegisterService(&service_);
      grpc_ = b.BuildAndStart();
      ASSERT_TRUE(grpc_);
    }
    front_.reset();
    o.port = 0;
    o.target = "127.0.0.1:" + std::to_string(grpc_port_);
    o.model_id = "m";
    auto t = ChatTemplate::Load(KVWIRE_SOURCE_DIR "/openai_front", "", chat_template_file);
    ASSERT_TRUE(t.ok()) << t.status();
    auto f = Front::Start(o, *std::move(t));
    ASSERT_TRUE(f.ok()) << f.status();
    front_ = *std::move(f);
  }

  void TearDown() override {
    front_.reset();
    if (grpc_) grpc_->Shutdown(std::chrono::system_clock::now() + 1s);
  }

  httplib::Result Post(const std::string& path, const std::string& body,
                       const httplib::Headers& headers = {}) {
    httplib::Client c("127.0.0.1", front_->port());
    c.set_read_timeout(20, 0);
    return c.Post(path.c_str(), headers, body, "application/json");
  }

  // A streamed body's events, up to [DONE].
  static std::vector<Json> Events(const std::string& body) {
    std::vector<Json> events;
    size_t at = 0;
    while ((at = body.find("data: ", at)) != std::string::npos) {
      const size_t end = body.find("\n\n", at);
      const std::string data = body.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") break;
      events.push_back(Json::parse(data));
    }
    return events;
  }
  static std::string Body(const std::string& prompt, const std::string& extra = "") {
    return R"({"model": "m", "prompt": ")" + prompt + "\"" + extra + "}";
  }

  // Sends a request on a raw socket and closes it before any answer: a client that hangs up.
  void HangUpAfterSending(const std::string& body) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(front_->port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    const std::string req =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        "application/json\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    ASSERT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
    std::this_thread::sleep_for(300ms);  // the call has started
    close(fd);
  }

  bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (!done()) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(20ms);
    }
    return true;
  }

  ScriptedGeneration service_;
  std::unique_ptr<grpc::Server> grpc_;
  int grpc_port_ = 0;
  std::unique_ptr<Front> front_;
};

TEST_F(FrontTest, AnswersWholeWithFigures) {
  auto r = Post("/v1/completions", Body("ok", R"(, "logprobs": 0)"));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const Json j = Json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "m");
  EXPECT_EQ(j["choices"][0]["text"], "Once upon a");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"], Json::array({0, 4, 9}));
  EXPECT_EQ(j["usage"]["total_tokens"], 7);
  EXPECT_EQ(j["usage"]["kvwire"]["compression_ratio"], 8.0);
  EXPECT_GT(j["usage"]["kvwire"]["front_ttft_ms"].get<double>(), 0.0);
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
}

TEST_F(FrontTest, StreamsEventsEndingWithDone) {
  auto r = Post("/v1/chat/completions",
                R"({"model": "m", "messages": [{"role": "user", "content": "ok"}], "stream": true,
                    "stream_options": {"include_usage": true}})",
                {{"Accept-Encoding", "gzip, deflate, br"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  EXPECT_EQ(r->get_header_value("Content-Encoding"), "");  // events are never held back
  const std::vector<Json> events = Events(r->body);
  EXPECT_EQ(r->body.substr(r->body.size() - 14), "data: [DONE]\n\n");
  // The plain fallback template makes the prompt "user: ok\nassistant:", which the service
  // answers with its three tokens.
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(events[0]["object"], "chat.completion.chunk");
  std::string text;
  for (const Json& e : events) {
    if (!e["choices"].empty()) text += e["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(text, "Once upon a");
  const Json& last_choice = events[events.size() - 2];
  EXPECT_EQ(last_choice["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(last_choice["usage"].is_null());
  EXPECT_TRUE(events.back()["choices"].empty());
  EXPECT_EQ(events.back()["usage"]["completion_tokens"], 3);
}

// vLLM's continuous_usage_stats (guidellm sends it with every streamed request): the counts so
// far on every chunk, the prompt's from the decode node's first message; with include_usage the
// whole usage still follows on a chunk of its own.
TEST_F(FrontTest, ContinuousUsageCountsOnEveryChunk) {
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    for (bool include : {false, true}) {
      SCOPED_TRACE(std::string(path) + (include ? " with include_usage" : ""));
      const std::string options = absl::StrCat(R"("stream": true, "stop": null, "ignore_eos": true,
          "stream_options": {"continuous_usage_stats": true, "include_usage": )",
                                               include ? "true" : "false", "}");
      const std::string body =
          std::string(path) == "/v1/completions"
              ? Body("hello", ", " + options)
              : absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "ok"}], )",
                             options, "}");
      auto r = Post(path, body);
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
      const std::vector<Json> events = Events(r->body);
      // A chunk per token, the one that ends the choice, and with include_usage the usage's.
      ASSERT_EQ(events.size(), include ? 5u : 4u);
      for (int i = 0; i < 4; ++i) {
        const Json& u = events[i]["usage"];
        EXPECT_EQ(u["prompt_tokens"], 4) << events[i];
        EXPECT_EQ(u["completion_tokens"], std::min(i + 1, 3)) << events[i];
        EXPECT_EQ(u["total_tokens"], 4 + std::min(i + 1, 3)) << events[i];
      }
      EXPECT_EQ(events[3]["choices"][0]["finish_reason"], "length");
      if (include) {
        EXPECT_TRUE(events[4]["choices"].empty());
        EXPECT_EQ(events[4]["usage"]["completion_tokens"], 3);
        EXPECT_EQ(events[4]["usage"]["kvwire"]["full_cache_bytes"], 4096);
      }
    }
  }
  auto r =
      Post("/v1/completions",
           Body("hello", R"(, "stream": true, "stream_options": {"continuous_usage_stats": 1})"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(Json::parse(r->body)["error"]["param"], "stream_options.continuous_usage_stats");
}

TEST_F(FrontTest, RefusalsOfTheDecodeTierAreHttpStatuses) {
  auto r = Post("/v1/completions", Body("refuse", R"(, "stream": true)"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(Json::parse(r->body)["error"]["param"], "max_tokens");
  r = Post("/v1/completions", Body("full"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 429);
  EXPECT_EQ(Json::parse(r->body)["error"]["type"], "rate_limit_error");
  // A failure after the first event is an error event, then [DONE].
  r = Post("/v1/completions", Body("break", R"(, "stream": true)"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find(R"("type":"service_unavailable_error")"), std::string::npos) << r->body;
  EXPECT_EQ(r->body.substr(r->body.size() - 14), "data: [DONE]\n\n");
  r = Post("/v1/completions", Body("break"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  r = Post("/v1/completions", Body("ok", R"(, "n": 2)"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(Json::parse(r->body)["error"]["param"], "n");
}

TEST_F(FrontTest, ChatGoesThroughTheTemplateWhichMayRefuse) {
  const std::string path = ::testing::TempDir() + "/front_test_template.jinja";
  {
    std::ofstream f(path);
    f << "{% for m in messages %}{% if m['role'] == 'system' %}"
         "{{ raise_exception('System messages are not supported') }}{% endif %}"
         "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}";
  }
  StartFront(FrontOptions{}, path);
  auto r = Post("/v1/chat/completions",
                R"({"model": "m", "messages": [{"role": "system", "content": "x"}]})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  const Json e = Json::parse(r->body)["error"];
  EXPECT_EQ(e["param"], "messages");
  EXPECT_NE(e["message"].get<std::string>().find("System messages are not supported"),
            std::string::npos)
      << e;
  r = Post("/v1/chat/completions",
           R"({"model": "m", "messages": [{"role": "user", "content": "ok"}]})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  std::remove(path.c_str());
}

TEST_F(FrontTest, DeadlineIsA504) {
  FrontOptions o;
  o.timeout = 300ms;
  StartFront(o);
  auto r = Post("/v1/completions", Body("slow"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 504) << r->body;
  EXPECT_EQ(Json::parse(r->body)["error"]["type"], "timeout_error");
}

TEST_F(FrontTest, ClientsThatHangUpBeforeTheirFirstTokenAreCancelled) {
  FrontOptions o;
  o.disconnect_poll = 50ms;
  StartFront(o);
  HangUpAfterSending(Body("slow", R"(, "stream": true)"));
  EXPECT_TRUE(WaitFor([&] { return service_.cancelled >= 1; }, 3s))
      << "a streaming request whose client left was not cancelled";
  HangUpAfterSending(Body("slow"));
  EXPECT_TRUE(WaitFor([&] { return service_.cancelled >= 2; }, 3s))
      << "a whole-answer request whose client left was not cancelled";
  // The slots are free again.
  auto r = Post("/v1/completions", Body("ok"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST_F(FrontTest, MaxInflightAnswers429) {
  FrontOptions o;
  o.max_inflight = 1;
  o.timeout = 2s;
  StartFront(o);
  std::thread slow([&] { Post("/v1/completions", Body("slow")); });
  ASSERT_TRUE(WaitFor([&] { return service_.started >= 1; }, 3s));
  auto r = Post("/v1/completions", Body("ok"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 429);
  EXPECT_EQ(Json::parse(r->body)["error"]["code"], "rate_limit_exceeded");
  slow.join();
  r = Post("/v1/completions", Body("ok"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST_F(FrontTest, HttpRefusalsAreOpenAIErrors) {
  FrontOptions o;
  o.max_body_bytes = 2048;
  StartFront(o);
  auto r = Post("/v1/nothing", "{}");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(Json::parse(r->body)["error"]["type"], "not_found_error");
  r = Post("/v1/completions", Body(std::string(4096, 'x')));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(Json::parse(r->body).contains("error"));
  httplib::Client c("127.0.0.1", front_->port());
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(Json::parse(models->body)["data"][0]["id"], "m");
  auto one = c.Get("/v1/models/other");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 404);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200) << health->body;
}

TEST_F(FrontTest, ShutdownDrainsThenCancelsWhatOutlivesItsGrace) {
  // A stream still waiting for its first token when the grace runs out gets a whole answer
  // (503), not headers with no body; requests that come while the front drains get 503 and
  // /health says it is not ready.
  std::thread slow([&] {
    auto r = Post("/v1/completions", Body("slow", R"(, "stream": true)"));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503) << r->body;  // CANCELLED from the tier
    EXPECT_TRUE(Json::parse(r->body).contains("error")) << r->body;
  });
  ASSERT_TRUE(WaitFor([&] { return service_.started >= 1; }, 3s));
  const auto t0 = std::chrono::steady_clock::now();
  std::thread stopper([&] { front_->Shutdown(1500ms); });
  std::this_thread::sleep_for(300ms);
  auto r = Post("/v1/completions", Body("ok"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(Json::parse(r->body)["error"]["code"], "shutting_down");
  httplib::Client c("127.0.0.1", front_->port());
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  stopper.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);  // grace, cancel, idle connections
  EXPECT_TRUE(WaitFor([&] { return service_.cancelled >= 1; }, 3s));
  slow.join();
}

}  // namespace
}  // namespace kvwire::openai
