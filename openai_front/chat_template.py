"""Chat templates rendered the way Hugging Face `transformers` renders them
(`apply_chat_template(..., tokenize=False)`): the `chat_template` Jinja string of the model's
tokenizer_config.json in jinja2's ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loop-controls extension, a `{% generation %}` block that renders its body
(transformers uses it to mark assistant tokens), the globals `raise_exception` and
`strftime_now`, a `tojson` filter that keeps non-ASCII text and takes indent/separators/
sort_keys, and the special tokens (bos_token, eos_token, ...) as variables.
tests/openai/chat_template_test.py checks the output against transformers itself.

A model without a template gets PLAIN_TEMPLATE (documented in docs/openai.md): each message as
"role: content" on its own line, then "assistant:" when a reply is wanted; the tiny stories
models were never trained on a chat format, so this only keeps the request meaningful."""
import datetime
import json
import os
from typing import Dict, List, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] "
                  "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}"
                  "{% endif %}")

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class TemplateError(ValueError):
  """The template failed to render (raise_exception in it, or a Jinja error)."""


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` renders its body unchanged."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes HTML characters and sorts keys; the templates expect json.dumps.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


def _environment():
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


def _token_text(value):
  """A tokenizer_config.json special token: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value


class ChatTemplate:
  """A compiled template and the special tokens it is rendered with."""

  def __init__(self, source: str, special_tokens: Optional[Dict[str, str]] = None,
               origin: str = ""):
    self.source = source
    self.special_tokens = dict(special_tokens or {})
    self.origin = origin
    try:
      self.template = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise TemplateError("%s: chat template does not parse: %s" % (origin or "template", e))

  @classmethod
  def for_model(cls, model_dir: str, override: str = "") -> "ChatTemplate":
    """The template of a Hugging Face model folder (tokenizer_config.json's chat_template, a
    string or a list of named templates, of which "default"), `override` (a file) if given, or
    PLAIN_TEMPLATE."""
    config = {}
    path = os.path.join(model_dir, "tokenizer_config.json") if model_dir else ""
    if path and os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        config = json.load(f)
    special = {n: _token_text(config[n]) for n in SPECIAL_TOKEN_NAMES if config.get(n)}
    if override:
      with open(override, encoding="utf-8") as f:
        return cls(f.read(), special, override)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    if not source and model_dir and os.path.exists(os.path.join(model_dir, "chat_template.jinja")):
      with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
        source = f.read()
    if not source:
      return cls(PLAIN_TEMPLATE, special, "plain fallback (the model has no chat template)")
    return cls(source, special, path)

  @property
  def is_plain(self) -> bool:
    return self.source == PLAIN_TEMPLATE

  def render(self, messages: List[dict], add_generation_prompt: bool = True,
             **kwargs) -> str:
    """The prompt text, as transformers' apply_chat_template(tokenize=False) gives it."""
    # As transformers: tools and documents are passed (None when absent), then the special
    # tokens, then the caller's keywords.
    variables = dict(self.special_tokens)
    variables.update(kwargs)
    try:
      return self.template.render(messages=messages, tools=None, documents=None,
                                  add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
      raise TemplateError(str(e) or type(e).__name__) from None


def render_prompt(template: ChatTemplate, messages_json: str, add_generation_prompt: bool) -> str:
  """The prompt of a chat request, as the C++ front (chat_template_python.cc) asks for it:
  `messages_json` is the checked messages as JSON text. A leading bos_token is dropped: the
  decode node's tokenizer adds the BOS the model asks for, as transformers' encode does, and a
  template that writes bos_token itself would give two (apply_chat_template tokenizes with
  add_special_tokens=False for that reason)."""
  text = template.render(json.loads(messages_json), add_generation_prompt)
  bos = template.special_tokens.get("bos_token")
  if bos and text.startswith(bos):
    text = text[len(bos):]
  return text
