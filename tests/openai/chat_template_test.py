#!/usr/bin/env python3
"""The OpenAI front's chat templates (openai_front/chat_template.py) render exactly as Hugging
Face transformers' apply_chat_template(..., tokenize=False) does, on the real Llama 3, Mistral
and Qwen2 templates committed in tests/data/chat_templates (each file notes its source) and one
that exercises the Jinja setup transformers adds; templates that raise refuse in both. Plus the
documented plain fallback of a model without a template (stories260K).

transformers (PyPI, installed into .venv by scripts/install_deps.sh without torch) is the
oracle; without it the test prints SKIP. Our side renders in a subprocess of the Python the
front runs on (--front-python, Debian's /usr/bin/python3 with python3-jinja2), so the check is of
the Jinja the front is deployed with, not of the newer one transformers needs in .venv."""
import argparse
import glob
import json
import os
import subprocess
import sys
import unittest

REPO = ""
FRONT_PYTHON = "/usr/bin/python3"

# Renders every case of stdin with openai_front/chat_template.py: [{template, special,
# messages, add}] -> [{"text": ...} or {"error": ...}].
RENDER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import chat_template
out = []
for case in json.load(sys.stdin):
  t = chat_template.ChatTemplate(case["template"], case["special"], "test")
  try:
    out.append({"text": t.render(case["messages"], case["add"])})
  except chat_template.TemplateError as e:
    out.append({"error": str(e)})
json.dump(out, sys.stdout)
"""


def render_with_front_python(cases):
  r = subprocess.run([FRONT_PYTHON, "-c", RENDER, os.path.join(REPO, "openai_front")],
                     input=json.dumps(cases), capture_output=True, text=True, timeout=60,
                     check=False)
  if r.returncode != 0:
    raise AssertionError("%s could not render: %s" % (FRONT_PYTHON, r.stderr))
  return json.loads(r.stdout)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "  Name a colour.  "},
     {"role": "assistant", "content": "Blue.\n"},
     {"role": "user", "content": "Another, en français: « vert » ? 🌿"}],
    [{"role": "user", "content": "line one\nline two\n\n"},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "{{ not a template }} {% raw %}"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}],
]


def hf_tokenizer(spec):
  """A transformers tokenizer carrying the template and special tokens (its vocabulary does
  not matter for tokenize=False)."""
  from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  vocab = {"<unk>": 0}
  for key in ("bos_token", "eos_token"):
    if spec.get(key):
      vocab.setdefault(spec[key], len(vocab))
  backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  kwargs = {k: spec[k] for k in ("bos_token", "eos_token") if spec.get(k)}
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                             **kwargs)
  tok.chat_template = spec["chat_template"]
  return tok


class ChatTemplateTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    try:
      import transformers  # pylint: disable=import-outside-toplevel,unused-import
      hf_tokenizer({"chat_template": "{{ 1 }}"}).apply_chat_template(
          [{"role": "user", "content": "x"}], tokenize=False)
    except ImportError as e:
      raise unittest.SkipTest("SKIP: transformers' chat templates are not usable here (%s): "
                              "run scripts/install_deps.sh, which puts it and the jinja2 it "
                              "needs in .venv" % e)
    sys.path.insert(0, os.path.join(REPO, "openai_front"))
    import chat_template  # pylint: disable=import-outside-toplevel
    cls.ct = chat_template
    cls.specs = {}
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "data", "chat_templates", "*.json"))):
      with open(path, encoding="utf-8") as f:
        cls.specs[os.path.basename(path)[:-5]] = json.load(f)

  def test_the_real_templates_are_committed(self):
    for name in ("llama3", "mistral", "qwen2"):
      self.assertIn(name, self.specs)
      self.assertTrue(self.specs[name]["source"].startswith("https://huggingface.co/"))

  def test_renders_as_transformers(self):
    import jinja2  # pylint: disable=import-outside-toplevel
    cases, wants = [], []
    for name, spec in self.specs.items():
      tok = hf_tokenizer(spec)
      special = {k: spec[k] for k in ("bos_token", "eos_token") if spec.get(k)}
      for i, conv in enumerate(CONVERSATIONS):
        for add in (True, False):
          try:
            want = {"text": tok.apply_chat_template(conv, tokenize=False,
                                                    add_generation_prompt=add)}
          except jinja2.exceptions.TemplateError as e:  # the template's raise_exception
            want = {"error": str(e)}
          cases.append({"template": spec["chat_template"], "special": special,
                        "messages": conv, "add": add, "name": name, "i": i})
          wants.append(want)
    got = render_with_front_python(cases)
    compared = refused = 0
    for case, want, ours in zip(cases, wants, got):
      with self.subTest(template=case["name"], conversation=case["i"],
                        add_generation_prompt=case["add"]):
        self.assertEqual(ours, want)
        compared += "text" in want
        refused += "error" in want
    self.assertGreaterEqual(compared, 30)
    self.assertGreaterEqual(refused, 2)  # Mistral refuses a system role

  def test_ours_in_this_python_too(self):
    """The same module under .venv's newer jinja2 (a user may install the front with pip)."""
    spec = self.specs["qwen2"]
    tok = hf_tokenizer(spec)
    ours = self.ct.ChatTemplate(spec["chat_template"], {"eos_token": spec["eos_token"]}, "qwen2")
    for conv in CONVERSATIONS:
      self.assertEqual(ours.render(conv), tok.apply_chat_template(conv, tokenize=False,
                                                                 add_generation_prompt=True))

  def test_model_folder_template_and_plain_fallback(self):
    model = os.path.join(REPO, "..", "shared", "models", "stories260K-hf")
    if os.path.exists(os.path.join(model, "config.json")):
      t = self.ct.ChatTemplate.for_model(model)
      self.assertTrue(t.is_plain)
    t = self.ct.ChatTemplate.for_model("")
    self.assertTrue(t.is_plain)
    self.assertEqual(t.render([{"role": "system", "content": "Be kind."},
                               {"role": "user", "content": "Tell a story."}]),
                     "system: Be kind.\nuser: Tell a story.\nassistant:")
    self.assertEqual(t.render([{"role": "user", "content": "x"}], add_generation_prompt=False),
                     "user: x\n")

  def test_each_turn_starts_with_the_last(self):
    """A conversation's turn n+1, as the front renders it, starts with turn n's prompt (then the
    assistant's answer, as the template writes it): the prefill tier's prefix cache then holds
    turn n's blocks when turn n+1 arrives (issue 33). Six turns, on every shipped template and
    the plain fallback, and in tokens too where the model's tokenizer is here (stories260K,
    whose chat is the plain fallback)."""
    templates = {name: self.ct.ChatTemplate(spec["chat_template"],
                                            {k: spec[k] for k in ("bos_token", "eos_token")
                                             if spec.get(k)}, name)
                 for name, spec in self.specs.items() if name != "jinja_features"}
    templates["plain"] = self.ct.ChatTemplate.for_model("")
    tokenizer = None
    stories = os.path.join(REPO, "..", "shared", "models", "stories260K-hf", "tokenizer.json")
    if os.path.exists(stories):
      from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
      tokenizer = Tokenizer.from_file(stories)
    for name, template in templates.items():
      messages = [] if name == "mistral" else [{"role": "system", "content": "Be brief."}]
      last = ""
      for turn in range(6):
        messages.append({"role": "user", "content": "Question %d: what next?" % turn})
        prompt = template.render(messages)
        messages.append({"role": "assistant", "content": " Answer %d." % turn})
        with self.subTest(template=name, turn=turn):
          self.assertTrue(prompt.startswith(last), "%r\ndoes not start with\n%r" % (prompt, last))
          if tokenizer is not None and name == "plain" and last:
            before = tokenizer.encode(last).ids
            self.assertEqual(tokenizer.encode(prompt).ids[:len(before)], before)
        last = prompt

  def test_tokenizer_config_forms(self):
    import tempfile  # pylint: disable=import-outside-toplevel
    spec = self.specs["llama3"]
    with tempfile.TemporaryDirectory() as d:
      # A list of named templates, and special tokens as AddedToken objects.
      with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": [{"name": "tool_use", "template": "x"},
                                     {"name": "default", "template": spec["chat_template"]}],
                   "bos_token": {"content": spec["bos_token"], "lstrip": False},
                   "eos_token": spec["eos_token"]}, f)
      t = self.ct.ChatTemplate.for_model(d)
      out = t.render([{"role": "user", "content": "hi"}])
      self.assertTrue(out.startswith("<|begin_of_text|><|start_header_id|>user"), out)

  def test_sandbox(self):
    t = self.ct.ChatTemplate("{{ messages.__class__.__mro__ }}", {}, "evil")
    with self.assertRaises(Exception):
      t.render([{"role": "user", "content": "x"}])
    t = self.ct.ChatTemplate("{% set _ = messages.append(1) %}", {}, "mutating")
    with self.assertRaises(self.ct.TemplateError):
      t.render([{"role": "user", "content": "x"}])


def main():
  global REPO, FRONT_PYTHON
  p = argparse.ArgumentParser()
  p.add_argument("--repo-root", required=True)
  p.add_argument("--front-python", default=FRONT_PYTHON,
                 help="the Python the front runs on (with jinja2)")
  args, rest = p.parse_known_args()
  REPO = os.path.abspath(args.repo_root)
  FRONT_PYTHON = args.front_python
  unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
  main()
