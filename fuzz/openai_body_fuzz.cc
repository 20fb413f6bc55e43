// Fuzzes the OpenAI front's reading of a request body (openai_front/api.cc): the input's first
// byte picks /v1/completions or /v1/chat/completions, the rest is the body. A refusal must be
// a 400 (or the 404 of another model) with a message, naming its field first when it names
// one. An accepted request must keep the promises the front makes to the decode tier: the
// served model, one non-empty prompt (text, or ids in [0, 2^31)) or at least one message with
// a known role and text content, max_tokens >= 1, temperature in [0, 2], top_p in (0, 1], at
// most 16 non-empty stop strings, stop ids >= 0, budget or ratio but not both, logprobs only
// as asked, and stream options only with a stream.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "openai_front/api.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "openai_body_fuzz: broken promise: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvwire::openai;
  if (size == 0) return 0;
  const bool chat = data[0] & 1;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const ParseResult r = chat ? ParseChat(body, "m") : ParseCompletion(body, "m");
  if (r.error) {
    const ApiError& e = *r.error;
    Check(e.status == 400 || e.status == 404, "a refusal is a 400 or a 404");
    Check(!e.message.empty(), "a refusal has a message");
    if (e.param) Check(e.message.rfind(*e.param + ": ", 0) == 0, "the message starts with param");
    Check(!e.BodyText().empty(), "the error serializes");
    return 0;
  }
  const ParsedRequest& p = r.parsed;
  const kvwire::v1::GenerateRequest& q = p.request;
  Check(p.chat == chat, "the endpoint's kind");
  if (chat) {
    Check(p.messages.is_array() && !p.messages.empty(), "at least one message");
    for (const Json& m : p.messages) {
      Check(m["role"].is_string() && m["content"].is_string(), "a message has role and text");
    }
    Check(!p.messages.dump(-1, ' ', false, Json::error_handler_t::replace).empty(),
          "the messages serialize for the template");
  } else if (q.has_prompt_ids()) {
    Check(q.prompt_ids().ids_size() > 0, "token ids are not empty");
    for (int id : q.prompt_ids().ids()) Check(id >= 0, "token ids are >= 0");
  } else {
    Check(!q.prompt().empty(), "a text prompt is not empty");
  }
  const auto& s = q.sampling();
  if (s.has_max_tokens()) Check(s.max_tokens() >= 1, "max_tokens >= 1");
  if (s.has_temperature()) {
    Check(std::isfinite(s.temperature()) && s.temperature() >= 0 && s.temperature() <= 2,
          "temperature in [0, 2]");
  }
  if (s.has_top_p()) Check(s.top_p() > 0 && s.top_p() <= 1, "top_p in (0, 1]");
  if (s.has_top_k()) Check(s.top_k() >= 0, "top_k >= 0");
  Check(s.stop_size() <= kMaxStopStrings, "at most 16 stop strings");
  for (const std::string& stop : s.stop()) Check(!stop.empty(), "stop strings are not empty");
  for (int id : s.stop_token_ids()) Check(id >= 0, "stop ids >= 0");
  const auto& c = q.compression();
  Check(!(c.has_budget() && c.has_ratio()), "budget or ratio, not both");
  if (c.has_budget()) Check(c.budget() >= 1, "budget >= 1");
  if (c.has_ratio()) Check(c.ratio() > 0 && c.ratio() <= 1, "ratio in (0, 1]");
  Check(q.return_logprobs() == p.logprobs, "logprobs as asked");
  Check(p.stream || !p.include_usage, "include_usage only with stream");
  return 0;
}
