// The OpenAI request and response shapes, checked and translated to and from kvwire's
// Generate. Nothing here does I/O: server.cc feeds it parsed JSON and gRPC results.
//
// A field is either carried to the GenerateRequest or refused with a 400 that names it: a field
// the front does not implement (tools, logit_bias, n > 1, top log-probabilities ...) is never
// silently ignored. kvwire's own knobs are extra body fields, as vLLM's extra parameters are:
// kv_policy, kv_budget, kv_ratio, kv_window, kv_params (any other CompressionParams field by
// name), attention (DecodeAttentionParams: mode, token_budget, top_k, top_r, page_size), and
// vLLM's top_k, ignore_eos and stop_token_ids. docs/openai.md lists them.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kvwire/v1/generation.pb.h"

namespace kvwire::openai {

using Json = nlohmann::ordered_json;  // responses keep OpenAI's field order

inline constexpr int kMaxStopStrings = 16;

// An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::optional<std::string> param;
  std::string type = "invalid_request_error";
  std::optional<std::string> code;

  Json Body() const;
  // Invalid UTF-8 (a parse error quotes the bytes it stopped at) is replaced, never an error.
  std::string BodyText() const {
    return Body().dump(-1, ' ', false, Json::error_handler_t::replace);
  }
};

// A 400 naming the field: "param: what".
ApiError BadField(const std::string& param, const std::string& what);

// A checked request: the GenerateRequest (its prompt filled for completions; for chat the
// caller renders `messages` with the model's template) and how to answer.
struct ParsedRequest {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  // stream_options.continuous_usage_stats (vLLM's): usage on every chunk, counted so far.
  bool continuous_usage = false;
  bool logprobs = false;
  bool add_generation_prompt = true;
  // The body field of the generation length: chat has max_tokens and max_completion_tokens.
  std::string max_tokens_field = "max_tokens";
  Json messages;  // chat: [{role, content[, name]}], content flattened to text
  v1::GenerateRequest request;
};

// The body of POST /v1/completions or /v1/chat/completions, checked against `model_id` (the
// one model served). On success `error` is empty.
struct ParseResult {
  ParsedRequest parsed;
  std::optional<ApiError> error;
};
ParseResult ParseCompletion(const std::string& body, const std::string& model_id);
ParseResult ParseChat(const std::string& body, const std::string& model_id);

// A gRPC status from the decode tier (FromGrpcStatus) as an OpenAI error: INVALID_ARGUMENT is
// a 400 naming the body field its google.rpc.BadRequest names (FieldOf), RESOURCE_EXHAUSTED
// 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504 ... `max_tokens_field` is the body field a
// refusal about the generation length (sampling.max_tokens) names.
ApiError FromGrpc(const absl::Status& status, bool chat,
                  const std::string& max_tokens_field = "max_tokens");
// The body field a GenerateRequest field path ("sampling.top_p", "compression.kernel",
// "prompt_ids[2]") is, if the API has one.
std::optional<std::string> BodyParam(const std::string& field, bool chat);

// The usage object: prompt, completion and total tokens, and under "kvwire" the decode
// node's RequestStats plus the front's own time to first token.
Json Usage(const v1::Final& final, double front_ttft_ms);
const char* FinishReason(v1::FinishReason reason);

// Per-token strings for log-probabilities: the decode node's token_texts, else (a node that
// predates them) the message's text on its last token.
std::vector<std::string> TokenTexts(const v1::GenerateResponse& message);
// /v1/completions' logprobs object; `offset` is the text offset of the first token, advanced.
Json CompletionLogprobs(const std::vector<std::string>& tokens, const std::vector<float>& logprobs,
                        size_t* offset);
// /v1/chat/completions' logprobs object.
Json ChatLogprobs(const std::vector<std::string>& tokens, const std::vector<float>& logprobs);

// JSON text of a string (quotes included); invalid UTF-8 is replaced, never an error.
std::string QuoteJson(const std::string& text);

}  // namespace kvwire::openai
