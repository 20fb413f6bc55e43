#!/usr/bin/env python3
"""End to end: the OpenAI-compatible front (kvwire-openai, openai_front/) in the local cluster of
deploy/local/cluster.sh, driven by the real `openai` Python package (PyPI, in .venv):

  (a) GET /v1/models, /health;
  (b) completions and chat completions, streaming and not: the same greedy text, usage, and
      kvwire's figures (full-cache bytes, wire bytes, ratio, transfer ms, TTFT) in
      usage.kvwire of the response and of the last chunk (with and without
      stream_options.include_usage), logprobs;
  (c) greedy output equal to Generate's for the same request (the kvwire package's blocking
      client straight to the router), chat through the model's template or the plain fallback;
  (d) stop strings honoured (finish_reason "stop", the text ends before the string);
  (e) every bad or unsupported field a 400 that names it (the front's own checks and the
      decode node's INVALID_ARGUMENT), an unknown model a 404;
  (f) a client that disconnects mid-stream cancels the Generate call: the decode nodes count a
      cancelled request and their KV pool gauge goes back to 0.

Runs under the project's .venv Python (which has `openai`; ctest starts it through
run_in_venv.py) and prints SKIP when the package cannot be had or nginx is absent.

usage: openai_e2e_test.py --repo-root DIR --build-dir DIR [unittest options]
"""
import argparse
import http.client
import json
import os
import re
import signal
import socket
import sys
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from local_cluster import (LocalClusterCase, find_nginx, pick_model,  # noqa: E402
                           require_binaries, stories_prompts, wait_until)

REPO = ""
BUILD = ""
BUDGET = 32
MAX_TOKENS = 24
STREAM_INTERVAL = 3
FALLBACK_PROMPT = ("The little dog ran to the park with his ball and played with a big red kite "
                   "all day. ") * 6


def metric_sum(text, name, labels=""):
  total = 0.0
  for line in text.splitlines():
    m = re.match(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), line)
    if m and labels in (m.group(1) or ""):
      total += float(m.group(2))
  return total


def renice(pids, value):
  """Sets the nice value of every thread of the processes (Linux keeps one per thread).
  Lowering it again needs privilege; without it they stay as they are."""
  for pid in pids:
    for tid in os.listdir("/proc/%d/task" % pid):
      try:
        os.setpriority(os.PRIO_PROCESS, int(tid), value)
      except (PermissionError, ProcessLookupError):
        pass


class OpenAIFrontTest(LocalClusterCase):

  @classmethod
  def setUpClass(cls):
    cls.nginx = find_nginx()
    if not cls.nginx:
      raise unittest.SkipTest("SKIP: nginx is not installed (Debian: apt-get install nginx)")
    import openai  # pylint: disable=import-outside-toplevel
    cls.openai = openai
    require_binaries(BUILD)
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from kvwire_client import import_kvwire  # pylint: disable=import-outside-toplevel
    cls.kvwire = import_kvwire(os.path.join(BUILD, "python"), os.path.join(REPO, "proto"))
    cls.REPO, cls.BUILD = REPO, BUILD
    cls.model = pick_model(REPO, "")
    prompts = stories_prompts(REPO, cls.model, 2)
    cls.prompt = prompts[0] if prompts else FALLBACK_PROMPT
    try:
      # Every third token a message (the decode nodes' --stream-interval): the front turns
      # messages of several tokens into chunks, log-probabilities included.
      cls.start_cluster(cls.model, "kvwire-openai-",
                        start_args=("--set", "DECODE_STREAM_INTERVAL=%d" % STREAM_INTERVAL))
      cls.cluster("wait-ready", "--timeout", "60")
    except BaseException:
      cls.failed = True
      cls.tearDownClass()
      raise
    cls.base = "http://127.0.0.1:%d" % cls.openai_port
    cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", timeout=60,
                               max_retries=0)
    cls.model_id = cls.client.models.list().data[0].id
    cls.grpc = cls.kvwire.Client("127.0.0.1:%d" % cls.router_port, timeout=60)

  @classmethod
  def tearDownClass(cls):
    if hasattr(cls, "grpc"):
      cls.grpc.close()
    cls.stop_cluster()

  def kv(self, **extra):
    body = {"kv_policy": "snapkv", "kv_budget": BUDGET}
    body.update(extra)
    return body

  def check_figures(self, usage, compressed=True):
    self.assertGreater(usage.prompt_tokens, 0)
    self.assertGreater(usage.completion_tokens, 0)
    self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)
    k = usage.model_extra["kvwire"]
    for key in ("full_cache_bytes", "wire_bytes", "kv_payload_bytes", "transfer_ms", "ttft_ms",
                "prefill_ms", "mean_itl_ms", "compression_ratio", "kept_tokens", "policy",
                "decode_node", "prefill_node", "front_ttft_ms"):
      self.assertIn(key, k)
    self.assertGreater(k["full_cache_bytes"], 0)
    self.assertGreater(k["wire_bytes"], 0)
    self.assertGreater(k["ttft_ms"], 0)
    self.assertGreaterEqual(k["front_ttft_ms"], k["ttft_ms"] * 0.5)
    self.assertAlmostEqual(k["compression_ratio"], k["full_cache_bytes"] / k["wire_bytes"])
    if compressed:
      self.assertEqual(k["kept_tokens"], BUDGET)
      self.assertGreater(k["compression_ratio"], 2.0)
      self.assertTrue(k["policy"].startswith("snapkv"), k["policy"])
    return k

  # (a)
  def test_models_and_health(self):
    models = self.client.models.list().data
    self.assertEqual(len(models), 1)
    self.assertEqual(models[0].id, os.path.basename(self.model) if not
                     self.model.startswith("synthetic:") else self.model)
    with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
      self.assertEqual(json.load(r)["status"], "ok")
    with self.assertRaises(self.openai.NotFoundError):
      self.client.models.retrieve("no-such-model")

  # (b), (c)
  def test_completion_equals_generate_streaming_or_not(self):
    want = self.grpc.generate(self.prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                              policy="snapkv", budget=BUDGET)
    r = self.client.completions.create(model=self.model_id, prompt=self.prompt,
                                       max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=self.kv())
    self.assertEqual(r.object, "text_completion")
    self.assertEqual(r.choices[0].text, want.text)
    self.assertEqual(r.choices[0].finish_reason, want.finish_reason)
    self.assertEqual(r.usage.completion_tokens, want.completion_tokens)
    self.assertEqual(r.usage.prompt_tokens, want.prompt_tokens)
    k = self.check_figures(r.usage)
    self.assertEqual(k["full_cache_bytes"], want.stats.full_cache_bytes)
    self.assertEqual(k["kv_payload_bytes"], want.stats.kv_payload_bytes)
    # The second of the same prompt may find it in the prefill node's prefix cache: its trailer
    # then carries cached_tokens, a field of a few bytes more on the wire.
    self.assertLessEqual(abs(k["wire_bytes"] - want.stats.wire_bytes), 8)

    for include_usage in (True, False):
      with self.subTest(include_usage=include_usage):
        chunks = list(self.client.completions.create(
            model=self.model_id, prompt=self.prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": include_usage},
            extra_body=self.kv()))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, want.text)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        self.assertEqual(finish[-1], want.finish_reason)
        self.assertTrue(all(f is None for f in finish[:-1]))
        if include_usage:
          self.assertEqual(chunks[-1].choices, [])
        self.check_figures(chunks[-1].usage)
        self.assertGreater(len(chunks), 3)  # streamed, not one lump

  def test_token_ids_prompt_and_logprobs(self):
    ids = self.grpc.generate(self.prompt, max_tokens=4, temperature=0.0)
    want = self.grpc.generate([1, 400, 401, 402, 403], max_tokens=8, temperature=0.0,
                              logprobs=True)
    r = self.client.completions.create(model=self.model_id, prompt=[1, 400, 401, 402, 403],
                                       max_tokens=8, temperature=0, logprobs=0)
    self.assertEqual(r.choices[0].text, want.text)
    lp = r.choices[0].logprobs
    self.assertEqual(len(lp.token_logprobs), want.completion_tokens)
    for a, b in zip(lp.token_logprobs, want.logprobs):
      self.assertAlmostEqual(a, b, places=5)
    self.assertEqual("".join(lp.tokens), want.text)
    self.assertEqual(lp.tokens, want.token_texts)
    self.assertTrue(ids.text)
    # Streamed, in chunks of several tokens: the same tokens, log-probabilities and offsets.
    chunks = list(self.client.completions.create(
        model=self.model_id, prompt=[1, 400, 401, 402, 403], max_tokens=8, temperature=0,
        logprobs=0, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    self.assertEqual([t for p in parts for t in p.tokens], lp.tokens)
    self.assertEqual([x for p in parts for x in p.text_offset], lp.text_offset)
    for a, b in zip([x for p in parts for x in p.token_logprobs], lp.token_logprobs):
      self.assertAlmostEqual(a, b, places=5)
    self.assertEqual(len(parts[0].tokens), 1)  # the first token at once
    self.assertGreaterEqual(max(len(p.tokens) for p in parts), STREAM_INTERVAL)
    chat = self.client.chat.completions.create(
        model=self.model_id, messages=[{"role": "user", "content": "Tom had a dog."}],
        max_tokens=6, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    self.assertEqual(len(content), chat.usage.completion_tokens)
    self.assertTrue(all(c.logprob <= 0 for c in content))

  def test_chat_equals_generate_of_the_rendered_prompt(self):
    sys.path.insert(0, os.path.join(REPO, "openai_front"))
    from chat_template import ChatTemplate  # pylint: disable=import-outside-toplevel
    model_dir = self.model if os.path.isdir(self.model) else ""
    messages = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": self.prompt}]
    rendered = ChatTemplate.for_model(model_dir).render(messages)
    want = self.grpc.generate(rendered, max_tokens=MAX_TOKENS, temperature=0.0,
                              policy="snapkv", budget=BUDGET)
    r = self.client.chat.completions.create(model=self.model_id, messages=messages,
                                            max_completion_tokens=MAX_TOKENS, temperature=0,
                                            extra_body=self.kv())
    self.assertEqual(r.object, "chat.completion")
    self.assertEqual(r.choices[0].message.role, "assistant")
    self.assertEqual(r.choices[0].message.content, want.text)
    self.assertEqual(r.usage.prompt_tokens, want.prompt_tokens)
    self.check_figures(r.usage)
    chunks = list(self.client.chat.completions.create(
        model=self.model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=self.kv()))
    self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
    self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                     want.text)
    self.assertEqual(chunks[-1].object, "chat.completion.chunk")
    self.check_figures(chunks[-1].usage)

  def test_a_conversation_reads_its_earlier_turns_from_the_prefix_cache(self):
    """Six turns of one chat: each turn's prompt starts with the last one's (the template renders
    them so), the decode nodes route it by its first tokens to the same prefill node (the local
    cluster's affinity routing), and that node's prefix cache holds the earlier turns: every
    turn after the first reports cached prompt tokens, as vLLM does."""
    system = ("You are a storyteller for small children. Every answer is one short, gentle "
              "sentence about a cat named Tom who lives in a little blue house by the sea, "
              "and his friend the old dog who sleeps in the sun all day long. %d" % os.getpid())
    messages = [{"role": "system", "content": system}]
    cached = []
    for turn in range(6):
      messages.append({"role": "user", "content": "What did Tom do on day %d?" % turn})
      r = self.client.chat.completions.create(model=self.model_id, messages=messages,
                                              max_tokens=6, temperature=0)
      cached.append(r.usage.prompt_tokens_details.cached_tokens)
      messages.append({"role": "assistant", "content": r.choices[0].message.content})
    self.assertEqual(cached[0], 0, cached)
    self.assertTrue(all(c > 0 for c in cached[1:]), cached)
    self.assertEqual(cached, sorted(cached), cached)  # the conversation grows, and so its hits

  def test_sampling_seed_and_attention(self):
    args = dict(model=self.model_id, prompt=self.prompt, max_tokens=16, temperature=0.9,
                top_p=0.9, seed=7)
    a = self.client.completions.create(**args)
    b = self.client.completions.create(**args)
    self.assertEqual(a.choices[0].text, b.choices[0].text)
    want = self.grpc.generate(self.prompt, max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    self.assertEqual(a.choices[0].text, want.text)
    r = self.client.completions.create(
        model=self.model_id, prompt=self.prompt, max_tokens=8, temperature=0,
        extra_body={"kv_policy": "full", "attention": {"mode": "hybrid", "token_budget": 32}})
    k = self.check_figures(r.usage, compressed=False)
    self.assertTrue(k["attention"].startswith("hybrid"), k["attention"])

  # (d)
  def test_stop_strings(self):
    free = self.grpc.generate(self.prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    words = free.text.split()
    self.assertGreater(len(words), 4, free.text)
    stop = " " + words[3]
    before = free.text[:free.text.index(stop)]
    for stream in (False, True):
      with self.subTest(stream=stream):
        r = self.client.completions.create(model=self.model_id, prompt=self.prompt,
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           stop=[stop, "zzzz-never"], stream=stream)
        if stream:
          chunks = list(r)
          text = "".join(c.choices[0].text for c in chunks if c.choices)
          finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
          text, finish = r.choices[0].text, r.choices[0].finish_reason
        self.assertEqual(text, before)
        self.assertEqual(finish, "stop")

  # (e)
  def test_bad_fields_are_400_naming_them(self):
    base = dict(model=self.model_id, prompt=self.prompt, max_tokens=4)
    cases = [  # (keywords, extra_body, the param the error names)
        ({"n": 2}, {}, "n"),
        ({"best_of": 2}, {}, "best_of"),
        ({"echo": True}, {}, "echo"),
        ({"logprobs": 2}, {}, "logprobs"),
        ({"frequency_penalty": 0.5}, {}, "frequency_penalty"),
        ({"presence_penalty": 1}, {}, "presence_penalty"),
        ({"logit_bias": {"5": 1}}, {}, "logit_bias"),
        ({"suffix": "x"}, {}, "suffix"),
        ({"user": "me"}, {}, "user"),
        ({"temperature": 3}, {}, "temperature"),
        ({"top_p": 0}, {}, "top_p"),
        ({"max_tokens": 0}, {}, "max_tokens"),
        ({"max_tokens": 10 ** 7}, {}, "max_tokens"),  # the decode node's --max-tokens-limit
        ({"seed": -1}, {}, "seed"),
        ({"stop": [""]}, {}, "stop"),
        ({"stream_options": {"include_usage": True}}, {}, "stream_options"),
        ({}, {"no_such_field": 1}, "no_such_field"),
        ({}, {"kv_budget": 0}, "kv_budget"),
        ({}, {"kv_budget": 8, "kv_ratio": 0.5}, "kv_ratio"),
        ({}, {"kv_policy": "no-such-policy"}, "kv_policy"),  # refused by the decode node
        ({}, {"kv_policy": "snapkv_pp", "kv_params": {"kernel": 7}}, "kv_params.kernel"),
        ({}, {"attention": {"mode": "no-such-mode"}}, "attention.mode"),
        ({}, {"attention": {"top_q": 3}}, "attention.top_q"),
        ({}, {"top_k": -5}, "top_k"),
        ({}, {"ignore_eos": "yes"}, "ignore_eos"),
    ]
    for kwargs, extra, param in cases:
      with self.subTest(param=param, kwargs=kwargs, extra=extra):
        args = dict(base, **kwargs)
        with self.assertRaises(self.openai.BadRequestError) as cm:
          self.client.completions.create(extra_body=extra or None, **args)
        err = cm.exception.body
        self.assertEqual(err.get("param"), param, err)
        self.assertIn(param.split(".")[-1], err["message"])
        self.assertEqual(cm.exception.status_code, 400)

    chat_base = dict(model=self.model_id, messages=[{"role": "user", "content": "hi"}])
    chat_cases = [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
         "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"n": 3}, "n"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "http://x"}}]}]}, "messages[0].content[0]"),
        ({"messages": []}, "messages"),
    ]
    for kwargs, param in chat_cases:
      with self.subTest(param=param, kwargs=kwargs):
        with self.assertRaises(self.openai.BadRequestError) as cm:
          self.client.chat.completions.create(**dict(chat_base, **kwargs))
        self.assertEqual(cm.exception.body.get("param"), param, cm.exception.body)
    with self.assertRaises(self.openai.NotFoundError) as cm:
      self.client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    self.assertEqual(cm.exception.body.get("param"), "model")

    # Not JSON at all, and a streaming request refused before its first byte: plain errors.
    for body in (b"{not json", json.dumps({"model": self.model_id, "prompt": "x",
                                           "stream": True, "kv_policy": "nope"}).encode()):
      req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                   headers={"Content-Type": "application/json"})
      with self.assertRaises(urllib.error.HTTPError) as cm:
        urllib.request.urlopen(req, timeout=30)
      self.assertEqual(cm.exception.code, 400)
      self.assertIn("error", json.load(cm.exception))

  # (f)
  def decode_metrics(self):
    pages = []
    for name in ("decode-0", "decode-1"):
      with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.metrics_ports[name],
                                  timeout=5) as r:
        pages.append(r.read().decode())
    return pages

  def test_disconnect_mid_stream_frees_kv_pages(self):
    cancelled = lambda: sum(metric_sum(p, "kvwire_requests_total", 'status="cancelled"')
                            for p in self.decode_metrics())
    pool_used = lambda: sum(metric_sum(p, "kvwire_kv_pool_used_bytes")
                            for p in self.decode_metrics())
    wait_until(lambda: pool_used() == 0, 30, "an idle KV pool before the test")
    # The tiny model makes a token in well under a millisecond: a generation as long as its
    # context allows lasts tens of milliseconds, about as long as a hang-up takes to reach
    # the decode node. So once the client has read the first event, the decode nodes are
    # paused (SIGSTOP) while it hangs up and the front notices (a write cannot fail: no
    # token comes), then resumed: the cancellation is waiting for them. Three things keep
    # the generation going until it arrives (each seen to fail attempts without it):
    # - a short prompt, which leaves about 500 tokens to make (the stories prompt left 87,
    #   about 13 ms: the decode node generates ahead of what the client has read, its tokens
    #   folded into the message being written, and the pause missed its end);
    # - until the pause, the decode nodes at the lowest priority: on a loaded machine this
    #   client read the first event only after the generation had ended, five attempts in a
    #   row; niced, they yield to it there and run at full speed on an idle one;
    # - after it, a resumption at a twentieth of the time for half a second: gRPC closes the
    #   transport, and so cancels the stream, only once its write in progress is over ("Delayed
    #   close due to in-progress write"), measured 24 to 106 ms after the node resumed, by
    #   when the rest of the generation, about 50 ms, could be done.
    # Tried up to 5 times in case the generation ended first all the same.
    decoders = [self.pids[n] for n in ("decode-0", "decode-1")]
    try:
      for attempt in range(5):
        renice(decoders, 19)  # each time: threads started since are not
        if self.hang_up_mid_stream(decoders, cancelled, pool_used):
          return
        print("attempt %d: the generation ended before its cancellation" % attempt,
              file=sys.stderr)
    finally:
      renice(decoders, 0)
    self.fail("no hang-up cancelled a generation")

  def hang_up_mid_stream(self, decoders, cancelled, pool_used):
    """Whether a streaming generation whose client hangs up after the first event, its
    decode nodes paused meanwhile, ends cancelled on a decode node."""
    before = cancelled()
    conn, resp = self.open_longest_stream()
    line = resp.readline()
    for pid in decoders:
      os.kill(pid, signal.SIGSTOP)
    try:
      self.assertTrue(line.startswith(b"data: {"), line)
      conn.sock.shutdown(socket.SHUT_RDWR)
      conn.close()
      time.sleep(1.0)  # the front polls its connections every 0.2 s
      end = time.monotonic() + 0.5
      while time.monotonic() < end:
        for sig, pause in ((signal.SIGCONT, 0.0005), (signal.SIGSTOP, 0.0095)):
          for pid in decoders:
            os.kill(pid, sig)
          time.sleep(pause)
    finally:
      for pid in decoders:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: pool_used() == 0, 30, "the KV pool to be freed")
    try:
      wait_until(lambda: cancelled() > before, 5, "a cancelled request on a decode node")
      return True
    except AssertionError:
      return False

  def open_longest_stream(self):
    """A streaming completion of as many tokens as the model's context leaves after a
    short prompt (the longest of these that the decode node accepts; it refuses the others
    with a 400 naming max_tokens before streaming)."""
    max_tokens = getattr(self, "stream_length", 4096)
    for _ in range(12):
      body = json.dumps({"model": self.model_id, "prompt": "Once upon a time",
                         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                         "stream": True, "kv_policy": "full"})
      conn = http.client.HTTPConnection("127.0.0.1", self.openai_port, timeout=30)
      conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
      resp = conn.getresponse()
      if resp.status != 400:
        type(self).stream_length = max_tokens
        self.assertEqual(resp.status, 200)
        self.assertEqual(resp.getheader("Content-Type"), "text/event-stream")
        return conn, resp
      err = json.loads(resp.read())["error"]
      conn.close()
      self.assertEqual(err["param"], "max_tokens", err)
      m = re.search(r"prompt \((\d+) tokens\).*context of (\d+)", err["message"])
      max_tokens = int(m.group(2)) - int(m.group(1)) if m else max_tokens // 2
    self.fail("no max_tokens was accepted")


def main():
  global REPO, BUILD
  p = argparse.ArgumentParser()
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  args, rest = p.parse_known_args()
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  try:
    import openai  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    print("SKIP: the openai package is not installed in %s (%s): scripts/install_deps.sh puts "
          "it in .venv" % (sys.executable, e))
    return 0
  unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
