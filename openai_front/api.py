"""The OpenAI request and response shapes, checked and translated to and from kvwire's
Generate. Nothing here does I/O: server.py feeds it parsed JSON and gRPC results.

A field is either carried to the GenerateRequest or refused with a 400 that names it: a field
the front does not implement (tools, logit_bias, n > 1, top log-probabilities ...) is never
silently ignored. kvwire's own knobs are extra body fields, as vLLM's extra parameters are:
kv_policy, kv_budget, kv_ratio, kv_window, kv_params (any other CompressionParams field by
name), attention (DecodeAttentionParams: mode, token_budget, top_k, top_r, page_size), and
vLLM's top_k, ignore_eos and stop_token_ids."""
import dataclasses
import re
from typing import Dict, List, Optional, Tuple, Union

MAX_STOP_STRINGS = 16


class ApiError(Exception):
  """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               type_: str = "invalid_request_error", code: Optional[str] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(param: str, what: str) -> ApiError:
  return ApiError(400, "%s: %s" % (param, what), param=param)


# gRPC status (from the decode tier) -> HTTP status, OpenAI error type.
GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "CANCELLED": (503, "service_unavailable_error"),
    "ABORTED": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "UNIMPLEMENTED": (501, "server_error"),
}


COMPRESSION_FIELDS = ("policy", "budget", "ratio", "window", "pool", "kernel", "gqa",
                      "kernel_small", "kernel_large", "kernel_threshold", "chunk",
                      "reuse_layers", "block", "groups", "sinks", "seed", "skip_layers")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos")


def grpc_param(details: str, chat: bool) -> Optional[str]:
  """The body field a decode node's INVALID_ARGUMENT message is about. Its messages start
  with the request field ("sampling.max_tokens: ...", "compression.policy must be ...",
  "compression: budget (...) ...", "prompt (N tokens) + max_tokens (M) exceeds ...")."""
  if "max_tokens (" in details and "context" in details:
    return "max_tokens"
  m = re.search(r"\b(sampling|compression|attention)\.([a-z_]+)", details) or \
      re.match(r"(compression|attention): ([a-z_]+)\b", details)
  if m:
    section, name = m.groups()
  else:
    m = re.match(r"([a-z_]+)(\[\d+\])?\s*[:(=]", details)
    if not m:
      return None
    section, name = "sampling", m.group(1)
  if section == "sampling":
    if name in ("prompt", "prompt_ids"):
      return "messages" if chat else "prompt"
    return name if name in SAMPLING_FIELDS else None
  if section == "compression" and name in COMPRESSION_FIELDS:
    return "kv_" + name if name in ("policy", "budget", "ratio", "window") else "kv_params." + name
  if section == "attention" and name in ATTENTION_FIELDS:
    return "attention." + name
  return None


def from_grpc(code: str, details: str, chat: bool = False) -> ApiError:
  status, type_ = GRPC_TO_HTTP.get(code, (500, "server_error"))
  param = grpc_param(details, chat) if status == 400 else None
  if status == 400 and param == "max_tokens" and chat:
    param = "max_completion_tokens"
  message = "%s (%s from the decode tier)" % (details, code)
  if param:
    message = "%s: %s" % (param, message)
  return ApiError(status, message, param=param, type_=type_, code=code.lower())


class Body:
  """A request body whose fields are taken one by one; what is left is refused."""

  def __init__(self, raw):
    if not isinstance(raw, dict):
      raise ApiError(400, "the request body must be a JSON object")
    self.raw = raw
    self.taken = set()

  def take(self, name):
    self.taken.add(name)
    return self.raw.get(name)

  def present(self, name) -> bool:
    return self.raw.get(name) is not None

  def rest(self):
    for name in self.raw:
      if name not in self.taken:
        raise bad(name, "unknown or unsupported field (docs/openai.md lists the fields)")


def _is_int(v):
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(body: Body, name: str, lo=None, hi=None) -> Optional[int]:
  v = body.take(name)
  if v is None:
    return None
  if isinstance(v, float) and v.is_integer():
    v = int(v)
  if not _is_int(v):
    raise bad(name, "expected an integer, got %r" % (v,))
  if lo is not None and v < lo:
    raise bad(name, "must be >= %d, got %d" % (lo, v))
  if hi is not None and v > hi:
    raise bad(name, "must be <= %d, got %d" % (hi, v))
  return v


def get_number(body: Body, name: str, lo=None, hi=None, lo_open=False) -> Optional[float]:
  v = body.take(name)
  if v is None:
    return None
  if not _is_number(v):
    raise bad(name, "expected a number, got %r" % (v,))
  if lo is not None and (v < lo or (lo_open and v == lo)):
    raise bad(name, "must be %s %g, got %g" % (">" if lo_open else ">=", lo, v))
  if hi is not None and v > hi:
    raise bad(name, "must be <= %g, got %g" % (hi, v))
  return float(v)


def get_bool(body: Body, name: str) -> Optional[bool]:
  v = body.take(name)
  if v is None:
    return None
  if not isinstance(v, bool):
    raise bad(name, "expected true or false, got %r" % (v,))
  return v


def get_str(body: Body, name: str) -> Optional[str]:
  v = body.take(name)
  if v is None:
    return None
  if not isinstance(v, str):
    raise bad(name, "expected a string, got %r" % (v,))
  return v


def refuse_unless(body: Body, name: str, allowed, why: str):
  """A field accepted only with a value that changes nothing (its default)."""
  v = body.take(name)
  if v is not None and v not in allowed:
    raise bad(name, why)


@dataclasses.dataclass
class Parsed:
  """A checked request: the prompt (text or token ids), the kvwire.GenerateParams keywords,
  and how to answer."""
  prompt: Union[str, List[int]]
  params: Dict[str, object]
  stream: bool = False
  include_usage: bool = False
  logprobs: bool = False
  chat: bool = False
  messages: Optional[List[dict]] = None
  add_generation_prompt: bool = True


COMPRESSION_SHORTCUTS = {"kv_policy": "policy", "kv_budget": "budget", "kv_ratio": "ratio",
                         "kv_window": "window"}
ATTENTION_FIELDS = {"mode": str, "token_budget": int, "top_k": int, "top_r": int,
                    "page_size": int}


def _common(body: Body, model_id: str, chat: bool) -> Tuple[Dict[str, object], bool, bool]:
  """The fields both endpoints share; returns (GenerateParams keywords, stream,
  include_usage)."""
  model = body.take("model")
  if model is None:
    raise bad("model", "required")
  if not isinstance(model, str):
    raise bad("model", "expected a string")
  if model != model_id:
    raise ApiError(404, "model: '%s' is not served here (GET /v1/models lists '%s')" %
                   (model, model_id), param="model", type_="not_found_error",
                   code="model_not_found")
  params: Dict[str, object] = {}
  if chat:
    a, b = get_int(body, "max_tokens", lo=1), get_int(body, "max_completion_tokens", lo=1)
    if a is not None and b is not None and a != b:
      raise bad("max_tokens", "give max_completion_tokens or max_tokens, not both")
    params["max_tokens"] = b if b is not None else a
  else:
    params["max_tokens"] = get_int(body, "max_tokens", lo=1)
  params["temperature"] = get_number(body, "temperature", lo=0, hi=2)
  params["top_p"] = get_number(body, "top_p", lo=0, hi=1, lo_open=True)
  params["seed"] = get_int(body, "seed", lo=0, hi=2**64 - 1)
  stop = body.take("stop")
  if stop is not None:
    if isinstance(stop, str):
      stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
      raise bad("stop", "expected a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
      raise bad("stop", "at most %d strings, got %d" % (MAX_STOP_STRINGS, len(stop)))
    params["stop"] = stop
  n = get_int(body, "n")
  if n is not None and n != 1:
    raise bad("n", "only n = 1 is served (one completion per request), got %d" % n)
  stream = bool(get_bool(body, "stream"))
  include_usage = False
  options = body.take("stream_options")
  if options is not None:
    if not stream:
      raise bad("stream_options", "only allowed with stream: true")
    if not isinstance(options, dict):
      raise bad("stream_options", "expected an object")
    for key, value in options.items():
      if key != "include_usage":
        raise bad("stream_options." + key, "unknown field (include_usage is the only one)")
      if value is not None and not isinstance(value, bool):
        raise bad("stream_options.include_usage", "expected true or false")
      include_usage = bool(value)
  for name in ("frequency_penalty", "presence_penalty"):
    refuse_unless(body, name, (0, 0.0), "not supported (only 0)")
  logit_bias = body.take("logit_bias")
  if logit_bias not in (None, {}):
    raise bad("logit_bias", "not supported")

  # vLLM's extra sampling parameters.
  top_k = get_int(body, "top_k", lo=-1)
  if top_k is not None:
    params["top_k"] = max(top_k, 0)  # vLLM's -1 and kvwire's 0 both mean no limit
  if get_bool(body, "ignore_eos"):
    params["ignore_eos"] = True
  ids = body.take("stop_token_ids")
  if ids is not None:
    if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
      raise bad("stop_token_ids", "expected a list of token ids")
    params["stop_token_ids"] = ids

  # kvwire's knobs.
  params["policy"] = get_str(body, "kv_policy") or ""
  params["budget"] = get_int(body, "kv_budget", lo=1)
  params["ratio"] = get_number(body, "kv_ratio", lo=0, hi=1, lo_open=True)
  params["window"] = get_int(body, "kv_window", lo=1)
  if params["budget"] is not None and params["ratio"] is not None:
    raise bad("kv_ratio", "give kv_budget or kv_ratio, not both")
  kv_params = body.take("kv_params")
  if kv_params is not None:
    if not isinstance(kv_params, dict):
      raise bad("kv_params", "expected an object of compression parameters")
    compression = {}
    for key, value in kv_params.items():
      if key in COMPRESSION_SHORTCUTS.values() or key == "params":
        raise bad("kv_params." + key, "use the top-level field kv_%s" % key
                  if key != "params" else "give each parameter by name")
      ok = (isinstance(value, (str, int, float)) and not isinstance(value, bool)) or \
           (isinstance(value, list) and all(_is_int(x) for x in value))
      if not ok:
        raise bad("kv_params." + key, "expected a string, a number or a list of integers")
      compression[key] = value
    params["compression"] = compression
  attention = body.take("attention")
  if attention is not None:
    if isinstance(attention, str):
      attention = {"mode": attention}
    if not isinstance(attention, dict):
      raise bad("attention", "expected an object (mode, token_budget, top_k, top_r, page_size)")
    out = {}
    for key, value in attention.items():
      field = "token_budget" if key == "budget" else key
      kind = ATTENTION_FIELDS.get(field)
      if kind is None:
        raise bad("attention." + key, "unknown field (mode, token_budget, top_k, top_r, "
                  "page_size)")
      if value is None:
        continue
      if (kind is str and not isinstance(value, str)) or (kind is int and not _is_int(value)):
        raise bad("attention." + key, "expected %s" % ("a string" if kind is str else
                                                         "an integer"))
      out[field] = value
    params["attention"] = out
  return {k: v for k, v in params.items() if v is not None}, stream, include_usage


def parse_completion(raw, model_id: str) -> Parsed:
  body = Body(raw)
  params, stream, include_usage = _common(body, model_id, chat=False)
  prompt = body.take("prompt")
  if prompt is None:
    raise bad("prompt", "required")
  if isinstance(prompt, list) and prompt and all(_is_int(x) for x in prompt):
    pass
  elif isinstance(prompt, list):
    if len(prompt) != 1:
      raise bad("prompt", "one prompt per request (got a list of %d)" % len(prompt))
    prompt = prompt[0]
    if isinstance(prompt, list) and not (prompt and all(_is_int(x) for x in prompt)):
      raise bad("prompt", "expected a string or a non-empty list of token ids")
  if not isinstance(prompt, (str, list)) or (isinstance(prompt, str) and not prompt):
    raise bad("prompt", "expected a non-empty string or a list of token ids")
  logprobs = get_int(body, "logprobs", lo=0)
  if logprobs:
    raise bad("logprobs", "top alternatives are not served: logprobs 0 gives the sampled "
              "tokens' log-probabilities, got %d" % logprobs)
  refuse_unless(body, "echo", (False,), "not supported (only false)")
  refuse_unless(body, "best_of", (1,), "not supported (only 1)")
  refuse_unless(body, "suffix", ("",), "not supported")
  body.rest()
  params["logprobs"] = logprobs is not None
  return Parsed(prompt=prompt, params=params, stream=stream, include_usage=include_usage,
                logprobs=logprobs is not None)


CHAT_ROLES = ("system", "developer", "user", "assistant")


def _message(i: int, m) -> dict:
  where = "messages[%d]" % i
  if not isinstance(m, dict):
    raise bad(where, "expected an object with role and content")
  role = m.get("role")
  if role not in CHAT_ROLES:
    raise bad(where + ".role", "expected one of %s, got %r" % (", ".join(CHAT_ROLES), role))
  content = m.get("content")
  if isinstance(content, list):
    texts = []
    for j, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text" or \
         not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
        raise bad("%s.content[%d]" % (where, j), "only text parts ({type: text, text}) are served")
      texts.append(part["text"])
    content = "".join(texts)
  if not isinstance(content, str):
    raise bad(where + ".content", "expected a string or a list of text parts")
  out = {"role": role, "content": content}
  for key, value in m.items():
    if key in ("role", "content"):
      continue
    if key == "name" and isinstance(value, str):
      out["name"] = value
      continue
    raise bad("%s.%s" % (where, key), "unknown or unsupported message field")
  return out


def parse_chat(raw, model_id: str) -> Parsed:
  body = Body(raw)
  params, stream, include_usage = _common(body, model_id, chat=True)
  messages = body.take("messages")
  if not isinstance(messages, list) or not messages:
    raise bad("messages", "expected a non-empty list of messages")
  messages = [_message(i, m) for i, m in enumerate(messages)]
  logprobs = bool(get_bool(body, "logprobs"))
  top = get_int(body, "top_logprobs", lo=0)
  if top:
    raise bad("top_logprobs", "top alternatives are not served (only 0): logprobs: true gives "
              "the sampled tokens' log-probabilities")
  if top is not None and not logprobs:
    raise bad("top_logprobs", "needs logprobs: true")
  fmt = body.take("response_format")
  if fmt is not None and fmt != {"type": "text"}:
    raise bad("response_format", "only {\"type\": \"text\"} is served")
  tools = body.take("tools")
  if tools not in (None, []):
    raise bad("tools", "tool calling is not served")
  refuse_unless(body, "tool_choice", ("none",), "tool calling is not served")
  for name in ("functions", "function_call"):
    if body.take(name) is not None:
      raise bad(name, "function calling is not served")
  refuse_unless(body, "parallel_tool_calls", (False, True), "expected true or false")
  add_generation_prompt = get_bool(body, "add_generation_prompt")
  body.rest()
  params["logprobs"] = logprobs
  return Parsed(prompt="", params=params, stream=stream, include_usage=include_usage,
                logprobs=logprobs, chat=True, messages=messages,
                add_generation_prompt=add_generation_prompt is not False)


# ---- responses ------------------------------------------------------------------------------


def kvwire_figures(stats, front_ttft_ms: Optional[float]) -> dict:
  """usage.kvwire: the decode node's RequestStats, and the front's own time to first token."""
  d = stats.to_dict()
  d["front_ttft_ms"] = front_ttft_ms
  return d


def usage(final, front_ttft_ms) -> dict:
  return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
          "total_tokens": final.prompt_tokens + final.completion_tokens,
          "kvwire": kvwire_figures(final.stats, front_ttft_ms)}


def token_texts(chunk) -> List[str]:
  """Per-token strings for log-probabilities: the decode node's (token_texts, with
  return_logprobs), else, from a node that predates them, the message's text on its last token
  (a message's text is never half a UTF-8 character)."""
  if len(chunk.token_texts) == len(chunk.token_ids):
    return list(chunk.token_texts)
  return [""] * (len(chunk.token_ids) - 1) + [chunk.text] if chunk.token_ids else []


def completion_logprobs(tokens: List[str], logprobs: List[float], offset: int) -> dict:
  offsets = []
  for t in tokens:
    offsets.append(offset)
    offset += len(t)
  return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
          "text_offset": offsets}


def chat_logprobs(tokens: List[str], logprobs: List[float]) -> dict:
  return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                       "top_logprobs": []} for t, lp in zip(tokens, logprobs)],
          "refusal": None}
