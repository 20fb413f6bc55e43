#include "openai_front/api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"

namespace kvwire::openai {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
// Request bodies: objects are std::maps (ordered_json's linear key lookup would make parsing
// quadratic in the number of keys). Responses are Json, in OpenAI's field order.
using In = nlohmann::json;
constexpr int kMaxNesting = 32;

// Inside this file a check that fails throws its ApiError, which the public entry points
// catch and return: the parsing reads like the list of rules it is.
struct Refusal {
  ApiError error;
};
[[noreturn]] void Refuse(ApiError e) { throw Refusal{std::move(e)}; }
[[noreturn]] void RefuseField(const std::string& param, const std::string& what) {
  Refuse(BadField(param, what));
}

template <typename J>
std::string Show(const J& v) {
  return v.dump(-1, ' ', false, J::error_handler_t::replace);
}

// A request body whose fields are taken one by one; what is left is refused.
class Body {
 public:
  explicit Body(const In& raw) : raw_(raw) {
    if (!raw_.is_object()) Refuse({400, "the request body must be a JSON object"});
  }
  // The field's value, or nullptr when absent or null.
  const In* Take(const std::string& name) {
    taken_.insert(name);
    auto it = raw_.find(name);
    return it == raw_.end() || it->is_null() ? nullptr : &*it;
  }
  void Rest() const {
    for (const auto& [name, value] : raw_.items()) {
      if (!taken_.count(name)) {
        RefuseField(name, "unknown or unsupported field (docs/openai.md lists the fields)");
      }
    }
  }

 private:
  const In& raw_;
  std::set<std::string> taken_;
};

// An integer, or a float with an integral value (5.0), as JSON writers may give one.
std::optional<int64_t> AsInt(const In& v) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return std::nullopt;
    }
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) == d && std::fabs(d) < 9.2e18) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

std::optional<int64_t> GetInt(Body& body, const std::string& name,
                              std::optional<int64_t> lo = std::nullopt,
                              int64_t hi = std::numeric_limits<int32_t>::max()) {
  const In* v = body.Take(name);
  if (!v) return std::nullopt;
  const std::optional<int64_t> i = AsInt(*v);
  if (!i) RefuseField(name, "expected an integer, got " + Show(*v));
  if (lo && *i < *lo) RefuseField(name, absl::StrCat("must be >= ", *lo, ", got ", *i));
  if (*i > hi) RefuseField(name, absl::StrCat("must be <= ", hi, ", got ", *i));
  return i;
}

std::optional<double> GetNumber(Body& body, const std::string& name, double lo, double hi,
                                bool lo_open = false) {
  const In* v = body.Take(name);
  if (!v) return std::nullopt;
  if (!v->is_number()) RefuseField(name, "expected a number, got " + Show(*v));
  const double d = v->get<double>();
  if (d < lo || (lo_open && d == lo)) {
    RefuseField(name, absl::StrCat("must be ", lo_open ? ">" : ">=", " ", lo, ", got ", d));
  }
  if (d > hi) RefuseField(name, absl::StrCat("must be <= ", hi, ", got ", d));
  return d;
}

std::optional<bool> GetBool(Body& body, const std::string& name) {
  const In* v = body.Take(name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) RefuseField(name, "expected true or false, got " + Show(*v));
  return v->get<bool>();
}

std::optional<std::string> GetString(Body& body, const std::string& name) {
  const In* v = body.Take(name);
  if (!v) return std::nullopt;
  if (!v->is_string()) RefuseField(name, "expected a string, got " + Show(*v));
  return v->get<std::string>();
}

// A field accepted only with a value that changes nothing (its default).
template <typename Allowed>
void RefuseUnless(Body& body, const std::string& name, Allowed allowed, const std::string& why) {
  const In* v = body.Take(name);
  if (v && !allowed(*v)) RefuseField(name, why);
}

bool IsZero(const In& v) { return v.is_number() && v.get<double>() == 0.0; }

// CompressionParams fields by name (kv_params), or DecodeAttentionParams fields (attention):
// each value must have its field's type; a name without a field goes to `extra_map` as text
// when the message has one (compression.params: policies added since), else it is refused.
void SetField(Message* msg, const std::string& key, const In& value, const std::string& param,
              const char* extra_map) {
  const FieldDescriptor* f = msg->GetDescriptor()->FindFieldByName(key);
  const Reflection* r = msg->GetReflection();
  if (f == nullptr || (extra_map != nullptr && key == extra_map)) {
    if (extra_map == nullptr) RefuseField(param, "unknown field");
    std::string text;
    if (value.is_string()) {
      text = value.get<std::string>();
    } else if (value.is_array()) {
      std::vector<std::string> items;
      for (const In& x : value) items.push_back(Show(x));
      text = "[" + absl::StrJoin(items, ", ") + "]";
    } else {
      text = Show(value);
    }
    // Only CompressionParams has a map of parameters by name.
    auto* compression = dynamic_cast<v1::CompressionParams*>(msg);
    if (compression == nullptr) RefuseField(param, "unknown field");
    (*compression->mutable_params())[key] = text;
    return;
  }
  auto int_of = [&](const In& v, int64_t lo, int64_t hi) -> int64_t {
    const std::optional<int64_t> i = AsInt(v);
    if (!i) RefuseField(param, "expected an integer, got " + Show(v));
    if (*i < lo || *i > hi) {
      RefuseField(param, absl::StrCat("must be in [", lo, ", ", hi, "], got ", *i));
    }
    return *i;
  };
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();
  if (f->is_repeated()) {
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_INT32) RefuseField(param, "not settable here");
    const In items = value.is_array() ? value : In::array({value});
    for (const In& x : items)
      r->AddInt32(msg, f, static_cast<int32_t>(int_of(x, kInt32Min, kInt32Max)));
    return;
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      if (!value.is_string()) RefuseField(param, "expected a string, got " + Show(value));
      r->SetString(msg, f, value.get<std::string>());
      return;
    case FieldDescriptor::CPPTYPE_INT32:
      r->SetInt32(msg, f, static_cast<int32_t>(int_of(value, kInt32Min, kInt32Max)));
      return;
    case FieldDescriptor::CPPTYPE_UINT64: {
      if (!value.is_number_integer() || (!value.is_number_unsigned() && value.get<int64_t>() < 0)) {
        RefuseField(param, "expected a non-negative integer, got " + Show(value));
      }
      r->SetUInt64(msg, f, value.get<uint64_t>());
      return;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE:
      if (!value.is_number()) RefuseField(param, "expected a number, got " + Show(value));
      r->SetDouble(msg, f, value.get<double>());
      return;
    default:
      RefuseField(param, "not settable here");
  }
}

constexpr const char* kCompressionShortcuts[] = {"policy", "budget", "ratio", "window"};
constexpr const char* kChatRoles[] = {"system", "developer", "user", "assistant"};

// Whether the proto message has a field of this name (the request's own field lists, so the
// front's never drift from the proto).
template <typename Msg>
bool HasField(const std::string& name) {
  return Msg::descriptor()->FindFieldByName(name) != nullptr;
}

template <size_t N>
bool OneOf(const std::string& s, const char* const (&names)[N]) {
  for (const char* n : names) {
    if (s == n) return true;
  }
  return false;
}

// The fields both endpoints share, into `out`.
void ParseCommon(Body& body, const std::string& model_id, ParsedRequest* out) {
  const In* model = body.Take("model");
  if (!model) RefuseField("model", "required");
  if (!model->is_string()) RefuseField("model", "expected a string");
  if (model->get<std::string>() != model_id) {
    Refuse({404,
            absl::StrCat("model: '", model->get<std::string>(),
                         "' is not served here (GET /v1/models lists '", model_id, "')"),
            "model", "not_found_error", "model_not_found"});
  }
  v1::GenerateRequest& req = out->request;
  v1::SamplingParams& s = *req.mutable_sampling();
  std::optional<int64_t> max_tokens;
  if (out->chat) {
    const auto a = GetInt(body, "max_tokens", 1), b = GetInt(body, "max_completion_tokens", 1);
    if (a && b && *a != *b) {
      RefuseField("max_tokens", "give max_completion_tokens or max_tokens, not both");
    }
    max_tokens = b ? b : a;
    // A refusal of the decode tier about max_tokens names the field the client used.
    out->max_tokens_field = a && !b ? "max_tokens" : "max_completion_tokens";
  } else {
    max_tokens = GetInt(body, "max_tokens", 1);
  }
  if (max_tokens) s.set_max_tokens(static_cast<int32_t>(*max_tokens));
  if (auto t = GetNumber(body, "temperature", 0, 2)) s.set_temperature(static_cast<float>(*t));
  if (auto p = GetNumber(body, "top_p", 0, 1, true)) s.set_top_p(static_cast<float>(*p));
  if (const In* seed = body.Take("seed")) {
    if (!seed->is_number_integer() && !AsInt(*seed)) {
      RefuseField("seed", "expected an integer, got " + Show(*seed));
    }
    if (!seed->is_number_unsigned() && AsInt(*seed).value_or(-1) < 0) {
      RefuseField("seed", absl::StrCat("must be >= 0, got ", Show(*seed)));
    }
    s.set_seed(seed->is_number_unsigned() ? seed->get<uint64_t>()
                                          : static_cast<uint64_t>(*AsInt(*seed)));
  }
  if (const In* stop = body.Take("stop"); stop != nullptr && !stop->is_null()) {
    const In list = stop->is_string() ? In::array({*stop}) : *stop;
    bool ok = list.is_array();
    for (const In& x : list) ok = ok && x.is_string() && !x.get<std::string>().empty();
    if (!ok) RefuseField("stop", "expected a non-empty string or a list of them");
    if (list.size() > kMaxStopStrings) {
      RefuseField("stop", absl::StrCat("at most ", kMaxStopStrings, " strings, got ", list.size()));
    }
    for (const In& x : list) s.add_stop(x.get<std::string>());
  }
  if (auto n = GetInt(body, "n"); n && *n != 1) {
    RefuseField("n", absl::StrCat("only n = 1 is served (one completion per request), got ", *n));
  }
  out->stream = GetBool(body, "stream").value_or(false);
  if (const In* options = body.Take("stream_options")) {
    if (!out->stream) RefuseField("stream_options", "only allowed with stream: true");
    if (!options->is_object()) RefuseField("stream_options", "expected an object");
    for (const auto& [key, value] : options->items()) {
      if (key != "include_usage" && key != "continuous_usage_stats") {
        RefuseField("stream_options." + key,
                    "unknown field (include_usage and continuous_usage_stats are served)");
      }
      if (!value.is_null() && !value.is_boolean()) {
        RefuseField("stream_options." + key, "expected true or false");
      }
      (key == "include_usage" ? out->include_usage : out->continuous_usage) =
          value.is_boolean() && value.get<bool>();
    }
  }
  for (const char* name : {"frequency_penalty", "presence_penalty"}) {
    RefuseUnless(body, name, IsZero, "not supported (only 0)");
  }
  if (const In* bias = body.Take("logit_bias"); bias && !(bias->is_object() && bias->empty())) {
    RefuseField("logit_bias", "not supported");
  }

  // vLLM's extra sampling parameters.
  if (auto top_k = GetInt(body, "top_k", -1)) {
    s.set_top_k(static_cast<int32_t>(std::max<int64_t>(*top_k, 0)));  // -1 and 0: no limit
  }
  if (GetBool(body, "ignore_eos").value_or(false)) s.set_ignore_eos(true);
  if (const In* ids = body.Take("stop_token_ids")) {
    bool ok = ids->is_array();
    for (const In& x : *ids) {
      ok = ok && x.is_number_integer() && AsInt(x).value_or(-1) >= 0 &&
           *AsInt(x) <= std::numeric_limits<int32_t>::max();
    }
    if (!ok) RefuseField("stop_token_ids", "expected a list of token ids");
    for (const In& x : *ids) s.add_stop_token_ids(static_cast<int32_t>(*AsInt(x)));
  }

  // kvwire's knobs.
  v1::CompressionParams& c = *req.mutable_compression();
  if (auto policy = GetString(body, "kv_policy")) c.set_policy(*policy);
  const auto budget = GetInt(body, "kv_budget", 1);
  const auto ratio = GetNumber(body, "kv_ratio", 0, 1, true);
  const auto window = GetInt(body, "kv_window", 1);
  if (budget && ratio) RefuseField("kv_ratio", "give kv_budget or kv_ratio, not both");
  if (budget) c.set_budget(static_cast<int32_t>(*budget));
  if (ratio) c.set_ratio(*ratio);
  if (window) c.set_window(static_cast<int32_t>(*window));
  if (auto format = GetString(body, "kv_format")) c.set_kv_format(*format);
  if (const In* params = body.Take("kv_params")) {
    if (!params->is_object()) {
      RefuseField("kv_params", "expected an object of compression parameters");
    }
    for (const auto& [key, value] : params->items()) {
      const std::string param = "kv_params." + key;
      if (OneOf(key, kCompressionShortcuts))
        RefuseField(param, "use the top-level field kv_" + key);
      if (key == "kv_format") RefuseField(param, "use the top-level field kv_format");
      if (key == "params") RefuseField(param, "give each parameter by name");
      bool ok = value.is_string() || value.is_number();
      if (value.is_array()) {
        ok = true;
        for (const In& x : value) ok = ok && AsInt(x).has_value();
      }
      if (!ok) RefuseField(param, "expected a string, a number or a list of integers");
      SetField(&c, key, value, param, "params");
    }
  }
  if (const In* attention = body.Take("attention")) {
    const In a = attention->is_string() ? In{{"mode", *attention}} : *attention;
    if (!a.is_object()) {
      RefuseField("attention", "expected an object (mode, token_budget, top_k, top_r, page_size)");
    }
    for (const auto& [key, value] : a.items()) {
      const std::string field = key == "budget" ? "token_budget" : key;
      if (!HasField<v1::DecodeAttentionParams>(field)) {
        RefuseField("attention." + key,
                    "unknown field (mode, token_budget, top_k, top_r, page_size)");
      }
      if (value.is_null()) continue;
      SetField(req.mutable_attention(), field, value, "attention." + key, nullptr);
    }
  }
}

// The deepest nesting of arrays and objects in `text`, strings skipped: checked before parsing
// because nlohmann's dump and copies recurse (a body of 100,000 brackets would exhaust a
// worker's stack).
int NestingDepth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

In ParseJson(const std::string& text) {
  if (NestingDepth(text) > kMaxNesting) {
    Refuse({400, absl::StrCat("the request body nests arrays and objects deeper than ", kMaxNesting,
                              " levels")});
  }
  try {
    return In::parse(text);
  } catch (const In::exception& e) {  // a syntax error, or a number out of range (1e400)
    Refuse({400, absl::StrCat("the request body is not JSON: ", e.what())});
  }
}

void ParseCompletionBody(const std::string& text, const std::string& model_id, ParsedRequest* out) {
  const In raw = ParseJson(text);
  Body body(raw);
  ParseCommon(body, model_id, out);
  const In* prompt = body.Take("prompt");
  if (!prompt) RefuseField("prompt", "required");
  auto all_ints = [](const In& list) {
    if (!list.is_array() || list.empty()) return false;
    for (const In& x : list) {
      if (!x.is_number_integer()) return false;
    }
    return true;
  };
  const In* p = prompt;
  if (p->is_array() && !all_ints(*p)) {
    if (p->size() != 1) {
      RefuseField("prompt", absl::StrCat("one prompt per request (got a list of ", p->size(), ")"));
    }
    p = &(*p)[0];
    if (p->is_array() && !all_ints(*p)) {
      RefuseField("prompt", "expected a string or a non-empty list of token ids");
    }
  }
  if (p->is_string() && !p->get<std::string>().empty()) {
    out->request.set_prompt(p->get<std::string>());
  } else if (p->is_array()) {
    for (const In& x : *p) {
      const std::optional<int64_t> id = AsInt(x);
      if (!id || *id < 0 || *id > std::numeric_limits<int32_t>::max()) {
        RefuseField("prompt", "token ids must be in [0, 2^31), got " + Show(x));
      }
      out->request.mutable_prompt_ids()->add_ids(static_cast<int32_t>(*id));
    }
  } else {
    RefuseField("prompt", "expected a non-empty string or a list of token ids");
  }
  const auto logprobs = GetInt(body, "logprobs", 0);
  if (logprobs && *logprobs != 0) {
    RefuseField("logprobs", absl::StrCat("top alternatives are not served: logprobs 0 gives the "
                                         "sampled tokens' log-probabilities, got ",
                                         *logprobs));
  }
  RefuseUnless(
      body, "echo", [](const In& v) { return v == false; }, "not supported (only false)");
  RefuseUnless(
      body, "best_of", [](const In& v) { return AsInt(v) == 1; }, "not supported (only 1)");
  RefuseUnless(
      body, "suffix", [](const In& v) { return v == ""; }, "not supported");
  body.Rest();
  out->logprobs = logprobs.has_value();
  out->request.set_return_logprobs(out->logprobs);
}

Json CheckMessage(size_t i, const In& m) {
  const std::string where = absl::StrCat("messages[", i, "]");
  if (!m.is_object()) RefuseField(where, "expected an object with role and content");
  const auto role = m.find("role");
  if (role == m.end() || !role->is_string() || !OneOf(role->get<std::string>(), kChatRoles)) {
    RefuseField(where + ".role", "expected one of system, developer, user, assistant, got " +
                                     (role == m.end() ? std::string("nothing") : Show(*role)));
  }
  std::string content;
  const auto c = m.find("content");
  if (c != m.end() && c->is_array()) {
    for (size_t j = 0; j < c->size(); ++j) {
      const In& part = (*c)[j];
      const bool ok = part.is_object() && part.size() == 2 && part.contains("type") &&
                      part["type"] == "text" && part.contains("text") && part["text"].is_string();
      if (!ok) {
        RefuseField(absl::StrCat(where, ".content[", j, "]"),
                    "only text parts ({type: text, text}) are served");
      }
      content += part["text"].get<std::string>();
    }
  } else if (c != m.end() && c->is_string()) {
    content = c->get<std::string>();
  } else {
    RefuseField(where + ".content", "expected a string or a list of text parts");
  }
  Json out = {{"role", role->get<std::string>()}, {"content", content}};
  for (const auto& [key, value] : m.items()) {
    if (key == "role" || key == "content") continue;
    if (key == "name" && value.is_string()) {
      out["name"] = value.get<std::string>();
      continue;
    }
    RefuseField(where + "." + key, "unknown or unsupported message field");
  }
  return out;
}

void ParseChatBody(const std::string& text, const std::string& model_id, ParsedRequest* out) {
  const In raw = ParseJson(text);
  Body body(raw);
  out->chat = true;
  ParseCommon(body, model_id, out);
  const In* messages = body.Take("messages");
  if (!messages || !messages->is_array() || messages->empty()) {
    RefuseField("messages", "expected a non-empty list of messages");
  }
  out->messages = Json::array();
  for (size_t i = 0; i < messages->size(); ++i)
    out->messages.push_back(CheckMessage(i, (*messages)[i]));
  out->logprobs = GetBool(body, "logprobs").value_or(false);
  const auto top = GetInt(body, "top_logprobs", 0);
  if (top && *top != 0) {
    RefuseField("top_logprobs",
                "top alternatives are not served (only 0): logprobs: true gives "
                "the sampled tokens' log-probabilities");
  }
  if (top && !out->logprobs) RefuseField("top_logprobs", "needs logprobs: true");
  if (const In* fmt = body.Take("response_format"); fmt && *fmt != In{{"type", "text"}}) {
    RefuseField("response_format", "only {\"type\": \"text\"} is served");
  }
  if (const In* tools = body.Take("tools"); tools && !(tools->is_array() && tools->empty())) {
    RefuseField("tools", "tool calling is not served");
  }
  RefuseUnless(
      body, "tool_choice", [](const In& v) { return v == "none"; }, "tool calling is not served");
  for (const char* name : {"functions", "function_call"}) {
    if (body.Take(name)) RefuseField(name, "function calling is not served");
  }
  RefuseUnless(
      body, "parallel_tool_calls", [](const In& v) { return v.is_boolean(); },
      "expected true or false");
  out->add_generation_prompt = GetBool(body, "add_generation_prompt").value_or(true);
  body.Rest();
  out->request.set_return_logprobs(out->logprobs);
}

template <typename Parse>
ParseResult Catching(Parse parse) {
  ParseResult r;
  try {
    parse(&r.parsed);
  } catch (const Refusal& refusal) {
    r.error = refusal.error;
  }
  return r;
}

}  // namespace

Json ApiError::Body() const {
  Json e;
  e["message"] = message;
  e["type"] = type;
  e["param"] = param ? Json(*param) : Json();
  e["code"] = code ? Json(*code) : Json();
  return Json{{"error", std::move(e)}};
}

ApiError BadField(const std::string& param, const std::string& what) {
  return ApiError{400, param + ": " + what, param};
}

ParseResult ParseCompletion(const std::string& body, const std::string& model_id) {
  return Catching([&](ParsedRequest* out) { ParseCompletionBody(body, model_id, out); });
}

ParseResult ParseChat(const std::string& body, const std::string& model_id) {
  return Catching([&](ParsedRequest* out) { ParseChatBody(body, model_id, out); });
}

std::optional<std::string> BodyParam(const std::string& field, bool chat) {
  // The decode node names GenerateRequest fields ("sampling.top_p", "compression.kernel",
  // "attention.top_r", "prompt_ids[3]"); each has its OpenAI body name.
  const size_t dot = field.find('.');
  const std::string section = dot == std::string::npos ? "" : field.substr(0, dot);
  std::string name = dot == std::string::npos ? field : field.substr(dot + 1);
  if (section.empty()) {
    name = name.substr(0, name.find('['));
    if (name == "prompt" || name == "prompt_ids" || name == "input") {
      return chat ? "messages" : "prompt";
    }
    if (name == "attention") return name;
    return std::nullopt;
  }
  if (section == "sampling" && HasField<v1::SamplingParams>(name)) return name;
  if (section == "compression") {
    // A parameter without a typed field travels in compression.params: kv_params.<name>.
    if (name == "params") return "kv_params";
    if (name == "kv_format") return name;
    return OneOf(name, kCompressionShortcuts) ? "kv_" + name : "kv_params." + name;
  }
  if (section == "attention" && HasField<v1::DecodeAttentionParams>(name)) {
    return "attention." + name;
  }
  return std::nullopt;
}

ApiError FromGrpc(const absl::Status& status, bool chat, const std::string& max_tokens_field) {
  struct Mapping {
    absl::StatusCode grpc;
    int http;
    const char* type;
  };
  static constexpr Mapping kMap[] = {
      {absl::StatusCode::kInvalidArgument, 400, "invalid_request_error"},
      {absl::StatusCode::kOutOfRange, 400, "invalid_request_error"},
      {absl::StatusCode::kFailedPrecondition, 400, "invalid_request_error"},
      {absl::StatusCode::kNotFound, 404, "not_found_error"},
      {absl::StatusCode::kAlreadyExists, 409, "invalid_request_error"},
      {absl::StatusCode::kUnauthenticated, 401, "authentication_error"},
      {absl::StatusCode::kPermissionDenied, 403, "permission_error"},
      {absl::StatusCode::kResourceExhausted, 429, "rate_limit_error"},
      {absl::StatusCode::kUnavailable, 503, "service_unavailable_error"},
      {absl::StatusCode::kCancelled, 503, "service_unavailable_error"},
      {absl::StatusCode::kAborted, 503, "service_unavailable_error"},
      {absl::StatusCode::kDeadlineExceeded, 504, "timeout_error"},
      {absl::StatusCode::kUnimplemented, 501, "server_error"},
  };
  const std::string code = absl::StatusCodeToString(status.code());
  ApiError e{500, "", std::nullopt, "server_error", absl::AsciiStrToLower(code)};
  for (const Mapping& m : kMap) {
    if (status.code() == m.grpc) {
      e.status = m.http;
      e.type = m.type;
    }
  }
  const std::optional<std::string> field = FieldOf(status);
  if (e.status == 400 && field) {
    e.param = *field == "sampling.max_tokens" ? std::optional<std::string>(max_tokens_field)
                                              : BodyParam(*field, chat);
  }
  e.message = absl::StrCat(status.message(), " (", code, " from the decode tier)");
  if (e.param) e.message = *e.param + ": " + e.message;
  return e;
}

const char* FinishReason(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    default:
      return "unspecified";
  }
}

Json Usage(const v1::Final& final, double front_ttft_ms) {
  const v1::RequestStats& st = final.stats();
  Json k;
  k["prompt_tokens"] = st.prompt_tokens();
  k["kept_tokens"] = st.kept_tokens();
  k["full_cache_bytes"] = st.full_cache_bytes();
  k["wire_bytes"] = st.wire_bytes();
  k["kv_payload_bytes"] = st.kv_payload_bytes();
  k["transfer_ms"] = st.transfer_ms();
  k["prefill_ms"] = st.prefill_ms();
  k["queue_ms"] = st.queue_ms();
  k["ttft_ms"] = st.ttft_ms();
  k["mean_itl_ms"] = st.mean_itl_ms();
  k["policy"] = st.policy();
  k["prefill_node"] = st.prefill_node();
  k["decode_node"] = st.decode_node();
  k["attention"] = st.attention();
  k["prefill_attempts"] = st.prefill_attempts();
  k["compression_ratio"] = st.wire_bytes() > 0
                               ? Json(static_cast<double>(st.full_cache_bytes()) / st.wire_bytes())
                               : Json();
  k["front_ttft_ms"] = front_ttft_ms;
  Json u;
  u["prompt_tokens"] = final.usage().prompt_tokens();
  u["completion_tokens"] = final.usage().completion_tokens();
  u["total_tokens"] = final.usage().prompt_tokens() + final.usage().completion_tokens();
  // As OpenAI and vLLM report a prefix cache's hit.
  u["prompt_tokens_details"] = Json{{"cached_tokens", st.cached_tokens()}};
  u["kvwire"] = std::move(k);
  return u;
}

std::vector<std::string> TokenTexts(const v1::GenerateResponse& message) {
  if (message.token_texts_size() == message.token_ids_size()) {
    return {message.token_texts().begin(), message.token_texts().end()};
  }
  if (message.token_ids_size() == 0) return {};
  std::vector<std::string> texts(message.token_ids_size() - 1);
  texts.push_back(message.text());
  return texts;
}

Json CompletionLogprobs(const std::vector<std::string>& tokens, const std::vector<float>& logprobs,
                        size_t* offset) {
  Json offsets = Json::array();
  for (const std::string& t : tokens) {
    offsets.push_back(*offset);
    // OpenAI's offsets count characters: UTF-8 bytes that do not continue a character.
    for (unsigned char ch : t) *offset += (ch & 0xC0) != 0x80;
  }
  Json lp;
  lp["tokens"] = tokens;
  lp["token_logprobs"] = logprobs;
  lp["top_logprobs"] = nullptr;
  lp["text_offset"] = std::move(offsets);
  return lp;
}

Json ChatLogprobs(const std::vector<std::string>& tokens, const std::vector<float>& logprobs) {
  Json content = Json::array();
  for (size_t i = 0; i < tokens.size() && i < logprobs.size(); ++i) {
    Json bytes = Json::array();
    for (unsigned char ch : tokens[i]) bytes.push_back(static_cast<int>(ch));
    Json item;
    item["token"] = tokens[i];
    item["logprob"] = logprobs[i];
    item["bytes"] = std::move(bytes);
    item["top_logprobs"] = Json::array();
    content.push_back(std::move(item));
  }
  return Json{{"content", std::move(content)}, {"refusal", nullptr}};
}

std::string QuoteJson(const std::string& text) { return Show(Json(text)); }

}  // namespace kvwire::openai
