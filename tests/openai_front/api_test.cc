// The OpenAI shapes of the front (openai_front/api.cc): what a body becomes in the
// GenerateRequest, every refusal naming its field, the gRPC status mapping, the response
// figures. The front in a running cluster, driven by the real openai package, is
// tests/openai/openai_e2e_test.py.
#include "openai_front/api.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "common/base/status.h"

namespace kvwire::openai {
namespace {

constexpr char kModel[] = "stories260K-hf";

std::string With(const std::string& fields) {
  return std::string(R"({"model": "stories260K-hf", "prompt": "Once upon a time")") +
         (fields.empty() ? "" : ", " + fields) + "}";
}

TEST(ParseCompletionTest, CarriesEveryFieldToTheRequest) {
  const ParseResult r = ParseCompletion(
      With(R"("max_tokens": 12, "temperature": 0.5, "top_p": 0.9, "seed": 18446744073709551615,
              "stop": ["\n\n", "The end"], "stream": true, "stream_options": {"include_usage": true},
              "top_k": -1, "ignore_eos": true, "stop_token_ids": [2, 7], "logprobs": 0,
              "kv_policy": "snapkv", "kv_budget": 64, "kv_window": 8, "kv_format": "int4",
              "kv_params": {"kernel": 7, "pool": "max", "groups": [1, 2], "novel": 0.25,
                            "seed": 3},
              "attention": {"mode": "hybrid", "budget": 128, "page_size": 16},
              "frequency_penalty": 0, "n": 1, "echo": false, "best_of": 1)"),
      kModel);
  ASSERT_FALSE(r.error) << r.error->message;
  const ParsedRequest& p = r.parsed;
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
  EXPECT_TRUE(p.logprobs);
  EXPECT_FALSE(p.chat);
  const v1::GenerateRequest& q = p.request;
  EXPECT_EQ(q.prompt(), "Once upon a time");
  EXPECT_TRUE(q.return_logprobs());
  EXPECT_EQ(q.sampling().max_tokens(), 12);
  EXPECT_FLOAT_EQ(q.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(q.sampling().top_p(), 0.9f);
  EXPECT_EQ(q.sampling().seed(), 18446744073709551615ull);
  ASSERT_EQ(q.sampling().stop_size(), 2);
  EXPECT_EQ(q.sampling().stop(1), "The end");
  EXPECT_TRUE(q.sampling().has_top_k());
  EXPECT_EQ(q.sampling().top_k(), 0);  // vLLM's -1 is kvwire's 0: no limit
  EXPECT_TRUE(q.sampling().ignore_eos());
  EXPECT_EQ(q.sampling().stop_token_ids_size(), 2);
  EXPECT_EQ(q.compression().policy(), "snapkv");
  EXPECT_EQ(q.compression().budget(), 64);
  EXPECT_FALSE(q.compression().has_ratio());
  EXPECT_EQ(q.compression().window(), 8);
  EXPECT_EQ(q.compression().kv_format(), "int4");
  EXPECT_EQ(q.compression().kernel(), 7);
  EXPECT_EQ(q.compression().pool(), "max");
  EXPECT_EQ(q.compression().groups_size(), 2);
  EXPECT_EQ(q.compression().seed(), 3u);
  ASSERT_EQ(q.compression().params().count("novel"), 1u);  // a policy's own parameter, as text
  EXPECT_EQ(q.compression().params().at("novel"), "0.25");
  EXPECT_EQ(q.attention().mode(), "hybrid");
  EXPECT_EQ(q.attention().token_budget(), 128);
  EXPECT_EQ(q.attention().page_size(), 16);
  EXPECT_FALSE(q.attention().has_top_k());
}

TEST(ParseCompletionTest, LeavesUnsetFieldsUnsetForTheNodesDefaults) {
  const ParseResult r = ParseCompletion(With(""), kModel);
  ASSERT_FALSE(r.error);
  const v1::GenerateRequest& q = r.parsed.request;
  EXPECT_FALSE(q.sampling().has_max_tokens());
  EXPECT_FALSE(q.sampling().has_temperature());
  EXPECT_FALSE(q.compression().has_budget());
  EXPECT_EQ(q.compression().policy(), "");
  EXPECT_FALSE(r.parsed.stream);
  EXPECT_FALSE(q.return_logprobs());
}

TEST(ParseCompletionTest, TakesTokenIdsAndOnePromptInAList) {
  ParseResult r =
      ParseCompletion(R"({"model": "stories260K-hf", "prompt": [1, 400, 401]})", kModel);
  ASSERT_FALSE(r.error);
  EXPECT_EQ(r.parsed.request.prompt_ids().ids_size(), 3);
  r = ParseCompletion(R"({"model": "stories260K-hf", "prompt": ["one"]})", kModel);
  ASSERT_FALSE(r.error);
  EXPECT_EQ(r.parsed.request.prompt(), "one");
  r = ParseCompletion(R"({"model": "stories260K-hf", "prompt": [[5, 6]]})", kModel);
  ASSERT_FALSE(r.error);
  EXPECT_EQ(r.parsed.request.prompt_ids().ids(1), 6);
  r = ParseCompletion(R"({"model": "stories260K-hf", "prompt": "x", "attention": "quest"})",
                      kModel);
  ASSERT_FALSE(r.error);
  EXPECT_EQ(r.parsed.request.attention().mode(), "quest");
}

TEST(ParseCompletionTest, RefusesEachBadFieldNamingIt) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("n": 2)", "n"},
      {R"("best_of": 3)", "best_of"},
      {R"("echo": true)", "echo"},
      {R"("logprobs": 2)", "logprobs"},
      {R"("logprobs": "yes")", "logprobs"},
      {R"("frequency_penalty": 0.5)", "frequency_penalty"},
      {R"("presence_penalty": 1)", "presence_penalty"},
      {R"("logit_bias": {"5": 1})", "logit_bias"},
      {R"("suffix": "x")", "suffix"},
      {R"("user": "me")", "user"},
      {R"("temperature": 3)", "temperature"},
      {R"("temperature": "hot")", "temperature"},
      {R"("top_p": 0)", "top_p"},
      {R"("max_tokens": 0)", "max_tokens"},
      {R"("max_tokens": 1.5)", "max_tokens"},
      {R"("max_tokens": 99999999999)", "max_tokens"},
      {R"("seed": -1)", "seed"},
      {R"("seed": 1.5)", "seed"},
      {R"("stop": [""])", "stop"},
      {R"("stop": [1])", "stop"},
      {R"("stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"])", "stop"},
      {R"("stream_options": {"include_usage": true})", "stream_options"},
      {R"("stream": true, "stream_options": {"other": 1})", "stream_options.other"},
      {R"("stream": true, "stream_options": {"continuous_usage_stats": "yes"})",
       "stream_options.continuous_usage_stats"},
      {R"("stream": "yes")", "stream"},
      {R"("kv_budget": 0)", "kv_budget"},
      {R"("kv_budget": 8, "kv_ratio": 0.5)", "kv_ratio"},
      {R"("kv_ratio": 1.5)", "kv_ratio"},
      {R"("kv_policy": 3)", "kv_policy"},
      {R"("kv_params": [1])", "kv_params"},
      {R"("kv_params": {"budget": 8})", "kv_params.budget"},
      {R"("kv_params": {"params": {}})", "kv_params.params"},
      {R"("kv_params": {"kv_format": "fp8"})", "kv_params.kv_format"},
      {R"("kv_format": 8)", "kv_format"},
      {R"("kv_params": {"kernel": "seven"})", "kv_params.kernel"},
      {R"("kv_params": {"kernel": 7.5})", "kv_params.kernel"},
      {R"("kv_params": {"groups": [1.5]})", "kv_params.groups"},
      {R"("attention": {"top_q": 3})", "attention.top_q"},
      {R"("attention": {"mode": 3})", "attention.mode"},
      {R"("attention": {"top_k": "all"})", "attention.top_k"},
      {R"("attention": 5)", "attention"},
      {R"("top_k": -5)", "top_k"},
      {R"("ignore_eos": "yes")", "ignore_eos"},
      {R"("stop_token_ids": [-1])", "stop_token_ids"},
      {R"("no_such_field": 1)", "no_such_field"},
  };
  for (const auto& [fields, param] : cases) {
    const ParseResult r = ParseCompletion(With(fields), kModel);
    ASSERT_TRUE(r.error) << fields;
    EXPECT_EQ(r.error->status, 400) << fields;
    EXPECT_EQ(r.error->param.value_or("(none)"), param) << fields << ": " << r.error->message;
    EXPECT_EQ(r.error->message.rfind(param + ": ", 0), 0u) << r.error->message;
    EXPECT_EQ(r.error->type, "invalid_request_error");
  }
}

TEST(ParseCompletionTest, RefusesBadPromptsModelsAndBodies) {
  const std::vector<std::pair<std::string, std::string>> prompts = {
      {R"({"model": "stories260K-hf"})", "prompt"},
      {R"({"model": "stories260K-hf", "prompt": ""})", "prompt"},
      {R"({"model": "stories260K-hf", "prompt": []})", "prompt"},
      {R"({"model": "stories260K-hf", "prompt": ["a", "b"]})", "prompt"},
      {R"({"model": "stories260K-hf", "prompt": [[]]})", "prompt"},
      {R"({"model": "stories260K-hf", "prompt": [-3]})", "prompt"},
      {R"({"model": "stories260K-hf", "prompt": 7})", "prompt"},
      {R"({"prompt": "x"})", "model"},
      {R"({"model": 5, "prompt": "x"})", "model"},
  };
  for (const auto& [body, param] : prompts) {
    const ParseResult r = ParseCompletion(body, kModel);
    ASSERT_TRUE(r.error) << body;
    EXPECT_EQ(r.error->param.value_or("(none)"), param) << body;
  }
  ParseResult r = ParseCompletion(R"({"model": "gpt-4", "prompt": "x"})", kModel);
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->status, 404);
  EXPECT_EQ(r.error->code.value_or(""), "model_not_found");
  EXPECT_NE(r.error->message.find("stories260K-hf"), std::string::npos) << r.error->message;
  for (const char* body : {"{not json", "[1, 2]", "\"text\"", "{\"model\": \"\xff\"}",
                           "{\"att\xb4\": 1}", "{\"max_tokens\": 1e400}"}) {
    r = ParseCompletion(body, kModel);
    ASSERT_TRUE(r.error) << body;
    EXPECT_EQ(r.error->status, 400);
    EXPECT_FALSE(r.error->param) << body;
    EXPECT_FALSE(r.error->BodyText().empty());  // quoted invalid UTF-8 is replaced
  }
}

TEST(ParseCompletionTest, RefusesDeepNestingBeforeParsing) {
  const std::string deep =
      With(R"("stop": )" + std::string(100000, '[') + std::string(100000, ']'));
  ParseResult r = ParseCompletion(deep, kModel);
  ASSERT_TRUE(r.error);
  EXPECT_EQ(r.error->status, 400);
  EXPECT_NE(r.error->message.find("deeper than"), std::string::npos) << r.error->message;
  // Brackets inside strings are text.
  r = ParseCompletion(With(R"("stop": ")" + std::string(100, '[') + R"(\"[")"), kModel);
  ASSERT_FALSE(r.error) << r.error->message;
  EXPECT_EQ(r.parsed.request.sampling().stop(0), std::string(100, '[') + "\"[");
}

TEST(ParseChatTest, FlattensTextPartsAndKeepsNames) {
  const ParseResult r = ParseChat(
      R"({"model": "stories260K-hf", "max_completion_tokens": 5, "logprobs": true,
          "messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "name": "ann",
                        "content": [{"type": "text", "text": "Hello "},
                                    {"type": "text", "text": "there"}]}],
          "add_generation_prompt": false, "response_format": {"type": "text"}, "tools": [],
          "tool_choice": "none", "parallel_tool_calls": true, "top_logprobs": 0})",
      kModel);
  ASSERT_FALSE(r.error) << r.error->message;
  EXPECT_TRUE(r.parsed.chat);
  EXPECT_FALSE(r.parsed.add_generation_prompt);
  EXPECT_TRUE(r.parsed.request.return_logprobs());
  EXPECT_EQ(r.parsed.request.sampling().max_tokens(), 5);
  ASSERT_EQ(r.parsed.messages.size(), 2u);
  EXPECT_EQ(r.parsed.messages[1]["content"], "Hello there");
  EXPECT_EQ(r.parsed.messages[1]["name"], "ann");
  EXPECT_EQ(
      r.parsed.messages.dump(),
      R"([{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there","name":"ann"}])");
}

TEST(ParseChatTest, RefusesEachBadFieldNamingIt) {
  const std::string base = R"("model": "stories260K-hf")";
  const std::string hi = R"("messages": [{"role": "user", "content": "hi"}])";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {hi + R"(, "tools": [{"type": "function"}])", "tools"},
      {hi + R"(, "tool_choice": "auto")", "tool_choice"},
      {hi + R"(, "functions": [])", "functions"},
      {hi + R"(, "response_format": {"type": "json_object"})", "response_format"},
      {hi + R"(, "top_logprobs": 3, "logprobs": true)", "top_logprobs"},
      {hi + R"(, "top_logprobs": 0)", "top_logprobs"},
      {hi + R"(, "n": 3)", "n"},
      {hi + R"(, "max_tokens": 5, "max_completion_tokens": 6)", "max_tokens"},
      {hi + R"(, "prompt": "x")", "prompt"},
      {R"("messages": [{"role": "robot", "content": "x"}])", "messages[0].role"},
      {R"("messages": [{"content": "x"}])", "messages[0].role"},
      {R"("messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])",
       "messages[0].content[0]"},
      {R"("messages": [{"role": "user", "content": 5}])", "messages[0].content"},
      {R"("messages": [{"role": "user", "content": "x", "tool_calls": []}])",
       "messages[0].tool_calls"},
      {R"("messages": ["hi"])", "messages[0]"},
      {R"("messages": [])", "messages"},
      {R"("messages": {})", "messages"},
  };
  for (const auto& [fields, param] : cases) {
    const ParseResult r = ParseChat("{" + base + ", " + fields + "}", kModel);
    ASSERT_TRUE(r.error) << fields;
    EXPECT_EQ(r.error->status, 400) << fields;
    EXPECT_EQ(r.error->param.value_or("(none)"), param) << fields << ": " << r.error->message;
  }
}

TEST(FromGrpcTest, MapsStatusesAndNamesTheFieldOfANodesRefusal) {
  struct Case {
    absl::StatusCode code;
    const char* message;
    const char* field;  // the BadRequest field the node named; "" for none
    bool chat;
    int status;
    const char* param;  // "" for none
    const char* max_tokens_field = "max_tokens";
  };
  using C = absl::StatusCode;
  const Case cases[] = {
      {C::kInvalidArgument, "sampling.max_tokens: 9999 exceeds --max-tokens-limit 4096",
       "sampling.max_tokens", false, 400, "max_tokens"},
      {C::kInvalidArgument, "prompt (40 tokens) + max_tokens (600) exceeds the context of 512",
       "sampling.max_tokens", true, 400, "max_completion_tokens", "max_completion_tokens"},
      {C::kInvalidArgument, "prompt (40 tokens) + max_tokens (600) exceeds the context of 512",
       "sampling.max_tokens", true, 400, "max_tokens", "max_tokens"},
      {C::kInvalidArgument, "sampling.top_p: must be in (0, 1]", "sampling.top_p", false, 400,
       "top_p"},
      {C::kInvalidArgument, "compression.policy must be one of full, snapkv, ...",
       "compression.policy", false, 400, "kv_policy"},
      {C::kInvalidArgument, "compression.kernel (8) must be odd", "compression.kernel", false, 400,
       "kv_params.kernel"},
      {C::kInvalidArgument, "compression.params: 'budget' has a field of its own",
       "compression.params", false, 400, "kv_params"},
      {C::kInvalidArgument, "compression.kv_format: must be one of auto, bf16, fp8, int8, int4",
       "compression.kv_format", false, 400, "kv_format"},
      {C::kInvalidArgument, "attention.mode: unknown 'x'", "attention.mode", false, 400,
       "attention.mode"},
      {C::kInvalidArgument, "attention: rocketkv sets its own", "attention", false, 400,
       "attention"},
      {C::kInvalidArgument, "prompt: encodes to no tokens", "prompt", true, 400, "messages"},
      {C::kInvalidArgument, "prompt_ids[3] = -1 is outside", "prompt_ids[3]", false, 400, "prompt"},
      // The message alone names nothing: only the structured field does.
      {C::kInvalidArgument, "sampling.top_k: must be >= 0", "", false, 400, ""},
      {C::kInvalidArgument, "request_id: longer than 256 bytes", "request_id", false, 400, ""},
      {C::kResourceExhausted, "the KV pool is full", "", false, 429, ""},
      {C::kUnavailable, "no decode node", "", false, 503, ""},
      {C::kDeadlineExceeded, "Deadline Exceeded", "", false, 504, ""},
      {C::kInternal, "bug", "", false, 500, ""},
  };
  for (const Case& c : cases) {
    absl::Status st(c.code, c.message);
    if (*c.field) st = AboutField(st, c.field);
    const ApiError e = FromGrpc(st, c.chat, c.max_tokens_field);
    EXPECT_EQ(e.status, c.status) << c.message;
    EXPECT_EQ(e.param.value_or(""), c.param) << c.message;
    EXPECT_NE(e.message.find(c.message), std::string::npos) << e.message;
    EXPECT_NE(e.message.find(absl::StatusCodeToString(c.code)), std::string::npos) << e.message;
  }
  EXPECT_EQ(FromGrpc(absl::DeadlineExceededError("x"), false).type, "timeout_error");
  EXPECT_EQ(FromGrpc(absl::ResourceExhaustedError("x"), false).code.value_or(""),
            "resource_exhausted");
}

TEST(ResponseTest, UsageCarriesTheNodesFiguresAndTheRatio) {
  v1::Final f;
  f.set_finish_reason(v1::FINISH_REASON_STOP);
  f.mutable_usage()->set_prompt_tokens(100);
  f.mutable_usage()->set_completion_tokens(7);
  f.mutable_stats()->set_full_cache_bytes(8000);
  f.mutable_stats()->set_wire_bytes(1000);
  f.mutable_stats()->set_policy("snapkv(budget=32)");
  const Json u = Usage(f, 12.5);
  EXPECT_EQ(u["total_tokens"], 107);
  EXPECT_EQ(u["kvwire"]["compression_ratio"], 8.0);
  EXPECT_EQ(u["kvwire"]["front_ttft_ms"], 12.5);
  EXPECT_EQ(u["kvwire"]["policy"], "snapkv(budget=32)");
  EXPECT_EQ(std::string(FinishReason(f.finish_reason())), "stop");
  f.mutable_stats()->set_wire_bytes(0);
  EXPECT_TRUE(Usage(f, 1)["kvwire"]["compression_ratio"].is_null());
}

TEST(ResponseTest, TextOffsetsCountCharactersAcrossChunks) {
  size_t offset = 0;
  const Json a = CompletionLogprobs({"caf", "\xc3\xa9", " au"}, {-0.5f, -1.f, -2.f}, &offset);
  EXPECT_EQ(a["text_offset"], Json::array({0, 3, 4}));
  EXPECT_EQ(offset, 7u);
  const Json b = CompletionLogprobs({" lait"}, {-0.25f}, &offset);
  EXPECT_EQ(b["text_offset"], Json::array({7}));
  const Json c = ChatLogprobs({"\xc3\xa9"}, {-1.f});
  EXPECT_EQ(c["content"][0]["bytes"], Json::array({195, 169}));
  EXPECT_TRUE(c["refusal"].is_null());
}

TEST(ResponseTest, TokenTextsFallBackToTheMessagesText) {
  v1::GenerateResponse m;
  m.add_token_ids(5);
  m.add_token_ids(6);
  m.set_text("ab");
  EXPECT_EQ(TokenTexts(m), (std::vector<std::string>{"", "ab"}));
  m.add_token_texts("a");
  m.add_token_texts("b");
  EXPECT_EQ(TokenTexts(m), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(QuoteJson("a\"b\n\xff"), "\"a\\\"b\\n\xef\xbf\xbd\"");
}

}  // namespace
}  // namespace kvwire::openai
