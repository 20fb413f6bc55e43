"""GenerateRequest from Python values. Unset values are left unset, so the decode node's
defaults (its --policy, --budget, --default-max-tokens ... flags) apply."""
import dataclasses
import uuid
from typing import Dict, List, Optional, Sequence, Union

Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass
class GenerateParams:
  """Everything of a GenerateRequest but the prompt. `compression` and `attention` take the
  proto fields by name (CompressionParams: policy, budget, ratio, window, kernel, pool, gqa,
  groups, ...; a name without a field goes to `params` as text, for policies added since;
  DecodeAttentionParams: mode, token_budget, top_k, top_r, page_size). The shortcuts
  policy/budget/ratio/window/attention_mode/attention_budget fill the same fields."""
  max_tokens: Optional[int] = None
  temperature: Optional[float] = None
  top_p: Optional[float] = None
  top_k: Optional[int] = None
  seed: Optional[int] = None
  stop: List[str] = dataclasses.field(default_factory=list)
  stop_token_ids: List[int] = dataclasses.field(default_factory=list)
  ignore_eos: bool = False
  logprobs: bool = False
  policy: str = ""
  budget: Optional[int] = None
  ratio: Optional[float] = None
  window: Optional[int] = None
  compression: Dict[str, object] = dataclasses.field(default_factory=dict)
  attention_mode: str = ""
  attention_budget: Optional[int] = None
  attention: Dict[str, object] = dataclasses.field(default_factory=dict)
  request_id: str = ""


def _set_fields(msg, values: Dict[str, object], what: str, extra_map: str = ""):
  names = {f.name: f for f in msg.DESCRIPTOR.fields}
  for key, value in values.items():
    if value is None:
      continue
    f = names.get(key)
    if f is None or key == extra_map:
      if not extra_map:
        raise ValueError("%s has no field '%s' (fields: %s)" % (what, key, ", ".join(sorted(names))))
      getattr(msg, extra_map)[key] = value if isinstance(value, str) else repr(value)
    elif f.label == f.LABEL_REPEATED:
      getattr(msg, key).extend(value if isinstance(value, (list, tuple)) else [value])
    else:
      setattr(msg, key, value)


def build_request(pb, prompt: Prompt, params: GenerateParams):
  """A GenerateRequest of the generated module `pb` (kvwire.v1.generation_pb2)."""
  p = params
  req = pb.GenerateRequest(request_id=p.request_id or str(uuid.uuid4()),
                           return_logprobs=p.logprobs)
  if isinstance(prompt, str):
    req.prompt = prompt
  else:
    req.prompt_ids.ids.extend(int(x) for x in prompt)
  s = req.sampling
  for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
    value = getattr(p, name)
    if value is not None:
      setattr(s, name, value)
  s.stop.extend(p.stop)
  s.stop_token_ids.extend(p.stop_token_ids)
  s.ignore_eos = p.ignore_eos
  compression = dict(p.compression)
  for name in ("policy", "budget", "ratio", "window"):
    value = getattr(p, name)
    if value not in (None, ""):
      compression[name] = value
  _set_fields(req.compression, compression, "compression", extra_map="params")
  attention = dict(p.attention)
  if p.attention_mode:
    attention["mode"] = p.attention_mode
  if p.attention_budget is not None:
    attention["token_budget"] = p.attention_budget
  _set_fields(req.attention, attention, "attention")
  return req
