#!/usr/bin/env python3
"""End to end: the local cluster of deploy/local/cluster.sh (nginx as the gRPC router, two
decode nodes, two prefill nodes, real processes on free loopback ports in a temporary
directory), driven through nginx by tools/kvwire_client.py as a user runs it.

  (a) greedy generations through the router equal `kvwire generate` in one process, for the
      full cache and for SnapKV with 64 tokens per KV head;
  (b) SnapKV sends fewer bytes than the full cache would need, as many as the budget's
      arithmetic says plus the wire format's overhead, and the nodes' metrics count them;
  (c) an invalid request through nginx is INVALID_ARGUMENT, and the access log shows it;
  (d) nginx's own failures (no decode node reachable) are gRPC UNAVAILABLE, not an HTML page;
  (e) with one prefill node killed (-9), requests still succeed on the other;
  (f) `cluster.sh stop` ends every process (the OpenAI front's too);
  (g) the decode-to-prefill links are mutual TLS (cluster.sh's default): a prefill node
      refuses a plaintext client, a TLS client without a certificate and one with a
      certificate of another CA, and takes the decode nodes' own.

Uses the real tiny model in ../shared when present, else synthetic:stories. Skips (exit 0)
when nginx is not installed. Needs only Debian's python3 with grpcio and protobuf.

usage: cluster_e2e_test.py --repo-root DIR --build-dir DIR [unittest options]
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import unittest
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_cluster import (LocalClusterCase, children, find_nginx, free_ports,  # noqa: E402
                           model_shape, pick_model, require_binaries, running, stories_prompts,
                           wait_until)

REPO = ""
BUILD = ""
MODEL_OVERRIDE = ""

BUDGET = 64
MAX_TOKENS = 32
SHORT_PROMPT = "Once upon a time, there was a little girl named Lily."
# Long prompts when ../shared/data is absent: about 350 tokens for the synthetic model (one
# token per byte) with 4 repeats, and for the real one with 12.
FALLBACK_SENTENCE = ("The little dog ran to the park with his ball and played with a big red kite "
                     "all day. ")


def unread_bytes(port):
  """Bytes that arrived on the established connections of the server listening on `port`
  and that it has not read yet (the receive queues in Linux's /proc/net/tcp)."""
  total = 0
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
      with open(table) as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      fields = row.split()  # sl local_address rem_address st tx_queue:rx_queue ...
      if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # ESTABLISHED
        total += int(fields[4].split(":")[1], 16)
  return total


def read_bytes(*path):
  with open(os.path.join(*path), "rb") as f:
    return f.read()


def prefill_call(target, credentials):
  """(code, details) of a Prefill call (an empty request) to the prefill node at `target`:
  over plaintext when `credentials` is None, else over TLS checking the name that
  cluster.sh's decode nodes check (localhost)."""
  if credentials is None:
    channel = grpc.insecure_channel(target)
  else:
    channel = grpc.secure_channel(target, credentials,
                                  options=[("grpc.ssl_target_name_override", "localhost")])
  with channel:
    call = channel.unary_stream("/kvwire.v1.Prefill/Prefill")
    try:
      for _ in call(b"", timeout=10):
        pass
    except grpc.RpcError as e:
      return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def metric_sum(text, name):
  """Sum of a Prometheus text-format metric over all its label sets."""
  total = 0.0
  for line in text.splitlines():
    m = re.match(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), line)
    if m:
      total += float(m.group(2))
  return total


class ClusterE2ETest(LocalClusterCase):

  @classmethod
  def setUpClass(cls):
    cls.nginx = find_nginx()
    if not cls.nginx:
      raise unittest.SkipTest("SKIP: nginx is not installed (Debian: apt-get install nginx)")
    cls.cluster_sh = os.path.join(REPO, "deploy", "local", "cluster.sh")
    cls.client_py = os.path.join(REPO, "tools", "kvwire_client.py")
    cls.kvwire = os.path.join(BUILD, "tools", "kvwire")
    require_binaries(BUILD, extra=(cls.kvwire,))
    cls.model = pick_model(REPO, MODEL_OVERRIDE)
    cls.long_prompts = stories_prompts(REPO, cls.model, 2)
    if cls.long_prompts is None:
      text = FALLBACK_SENTENCE * (4 if cls.model.startswith("synthetic:") else 12)
      cls.long_prompts = [text, text[:-30] + "Then he went home."]

    cls.REPO, cls.BUILD = REPO, BUILD
    try:
      # Round robin between the prefill nodes: test_5 needs both to serve a few prompts, which
      # affinity routing (the default) may send to one (the pair test covers affinity).
      cls.start_cluster(cls.model, "kvwire-e2e-",
                        start_args=("--set", "DECODE_PREFILL_AFFINITY_TOKENS=0"))
      cls.decode_metrics = ["127.0.0.1:%d" % cls.metrics_ports[n] for n in ("decode-0", "decode-1")]
      cls.prefill0_port = cls.node_ports["prefill-0"]
      cls.cluster("wait-ready", "--timeout", "60")
    except BaseException:
      cls.failed = True
      cls.tearDownClass()
      raise

  @classmethod
  def tearDownClass(cls):
    cls.stop_cluster()

  def client_cmd(self, prompts, *flags, target=None):
    """The Python client (--json) sending `prompts` one after another through the router."""
    cmd = [sys.executable, self.client_py, "--json", "--timeout", "30",
           "--target", target or "127.0.0.1:%d" % self.router_port,
           "--stubs", os.path.join(BUILD, "python"), "--max-tokens", str(MAX_TOKENS),
           "--attention", "dense"] + list(flags)
    for p in prompts:
      cmd += ["--prompt", p]
    return cmd

  def parse_rows(self, stdout, stderr, returncode, n, expect_ok=True):
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    self.assertEqual(len(rows), n, "client output:\n%s\n%s" % (stdout, stderr))
    if expect_ok:
      for row in rows:
        self.assertNotIn("error", row, "request failed through the router: %s" % row)
      self.assertEqual(returncode, 0, stderr)
    return rows

  def generate(self, prompts, *flags, target=None, expect_ok=True):
    """Runs the client; one dict per prompt (its results and figures, or its error)."""
    r = subprocess.run(self.client_cmd(prompts, *flags, target=target), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=60)
    return self.parse_rows(r.stdout, r.stderr, r.returncode, len(prompts), expect_ok)

  def single_process(self, prompt, *flags):
    """`kvwire generate` in one process, with the decode nodes' compression defaults from
    node-flags.env (the request sets policy and budget itself) and their thread count."""
    policy = flags[flags.index("--policy") + 1] if "--policy" in flags else "full"
    cmd = [self.kvwire, "generate", "--model", self.model, "--prompt", prompt,
           "--max-tokens", str(MAX_TOKENS), "--threads", "1"] + self.cli_node_flags(policy) + list(flags)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    err = r.stderr.decode(errors="replace")
    self.assertEqual(r.returncode, 0, err)
    counts = re.search(r"prompt (\d+) tokens, generated (\d+)", err)
    cache = re.search(r"kv cache: full (\d+) bytes, compressed (\d+) bytes", err)
    self.assertTrue(counts and cache, "unexpected kvwire generate output:\n" + err)
    return {"stdout": r.stdout.decode("utf-8", errors="replace"),
            "prompt_tokens": int(counts.group(1)), "completion_tokens": int(counts.group(2)),
            "full_bytes": int(cache.group(1)), "kept_bytes": int(cache.group(2))}

  def cli_node_flags(self, policy):
    """The node defaults that apply to a request for `policy`, as a decode node applies
    them: its default policy's parameters only when the request keeps that policy (another
    policy starts from its own defaults), and the shared ones (window) for any that takes
    them; the rest of node-flags.env's flags that `kvwire generate` has too."""
    if not hasattr(self, "_registry"):
      out = subprocess.run([self.kvwire, "policies", "--json"], stdout=subprocess.PIPE,
                           check=True, text=True).stdout
      type(self)._registry = {p["name"]: p for p in json.loads(out)["policies"]}
      help_text = subprocess.run([self.kvwire, "generate", "--help"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True).stdout
      node = {}
      with open(os.path.join(REPO, "deploy", "local", "node-flags.env")) as f:
        for line in f:
          m = re.match(r"^DECODE_([A-Z0-9_]+)=(\S*)$", line.strip())
          if m and ("--%s " % m.group(1).lower().replace("_", "-")) in help_text:
            node[m.group(1).lower()] = m.group(2)
      type(self)._node = node
    registry, node = self._registry, self._node
    compression = {q["name"] for p in registry.values() for q in p["params"]}
    compression |= {"policy", "budget", "ratio", "window", "skip_layers"}
    flags = ["--%s=%s" % (k.replace("_", "-"), v) for k, v in node.items() if k not in compression]
    takes = set(registry[policy]["shared"]) - {"budget", "ratio"}
    if policy == node.get("policy"):
      takes |= {q["name"] for q in registry[policy]["params"]}
    flags += ["--%s=%s" % (k.replace("_", "-"), v) for k, v in node.items() if k in takes]
    return flags


  def decode_counters(self):
    wire = full = 0.0
    for target in self.decode_metrics:
      with urllib.request.urlopen("http://%s/metrics" % target, timeout=5) as r:
        text = r.read().decode()
      wire += metric_sum(text, "kvwire_kv_wire_bytes_total")
      full += metric_sum(text, "kvwire_kv_full_bytes_total")
    return wire, full

  # ---- tests (run in name order; 5 kills a node, 6 stops the cluster) ---------------------

  def test_0_prefill_nodes_take_only_the_decode_certificate(self):
    tls = os.path.join(self.dir, "tls")
    with open(os.path.join(self.dir, "links")) as f:
      self.assertEqual(f.read().strip(), "mtls", "cluster.sh start without --insecure")
    # A CA and a decode certificate the cluster does not know.
    other = os.path.join(self.tmp, "other-ca")
    r = subprocess.run([os.path.join(REPO, "scripts", "make_certs.sh"), other],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.assertEqual(r.returncode, 0, r.stdout)
    ca = read_bytes(tls, "decode", "ca.crt")
    refused = {
        "plaintext": None,
        "TLS without a client certificate": grpc.ssl_channel_credentials(ca),
        "a client certificate of another CA": grpc.ssl_channel_credentials(
            ca, read_bytes(other, "decode", "tls.key"), read_bytes(other, "decode", "tls.crt")),
    }
    decode_identity = grpc.ssl_channel_credentials(ca, read_bytes(tls, "decode", "tls.key"),
                                                   read_bytes(tls, "decode", "tls.crt"))
    for name in ("prefill-0", "prefill-1"):
      target = "127.0.0.1:%d" % self.node_ports[name]
      for what, credentials in refused.items():
        with self.subTest(node=name, client=what):
          code, details = prefill_call(target, credentials)
          self.assertEqual(code, grpc.StatusCode.UNAVAILABLE,
                           "%s: a Prefill call with %s got %s: %s" % (name, what, code, details))
      with self.subTest(node=name, client="the decode nodes' certificate"):
        # Past the handshake, the empty request reaches the service, which judges it.
        code, details = prefill_call(target, decode_identity)
        self.assertNotEqual(code, grpc.StatusCode.UNAVAILABLE, details)
    # And the cluster serves, every prefill on a prefill node.
    rows = self.generate([SHORT_PROMPT, self.long_prompts[0]], "--policy", "snapkv",
                         "--budget", str(BUDGET))
    for row in rows:
      self.assertIn(row["prefill_node"], ("prefill-0", "prefill-1"), row)
      self.assertGreater(row["completion_tokens"], 0, row)

  def test_1_router_equals_single_process(self):
    prompts = [SHORT_PROMPT, self.long_prompts[0]]
    for flags in (["--policy", "full"], ["--policy", "snapkv", "--budget", str(BUDGET)]):
      for i, (prompt, got) in enumerate(zip(prompts, self.generate(prompts, *flags))):
        with self.subTest(policy=flags[1], prompt=("short", "long")[i]):
          want = self.single_process(prompt, *flags)
          self.assertEqual(got["prompt_tokens"], want["prompt_tokens"])
          self.assertEqual(got["completion_tokens"], want["completion_tokens"])
          self.assertGreater(got["completion_tokens"], 0)
          # kvwire generate prints the prompt, then the generated text, then a newline.
          self.assertEqual(prompt + got["text"] + "\n", want["stdout"])
          self.assertEqual(got["full_cache_bytes"], want["full_bytes"])

  def test_2_snapkv_sends_what_the_budget_says(self):
    prompt = self.long_prompts[1]
    before = self.decode_counters()
    snap, = self.generate([prompt], "--policy", "snapkv", "--budget", str(BUDGET))
    full, = self.generate([prompt], "--policy", "full")
    n, kept = snap["prompt_tokens"], snap["kept_tokens"]
    self.assertGreaterEqual(n, 4 * BUDGET, "the long prompt should be well over the budget")
    self.assertEqual(kept, BUDGET)
    self.assertEqual(full["kept_tokens"], n)
    self.assertEqual(snap["full_cache_bytes"], full["full_cache_bytes"])
    # The kept K/V rows are kept/prompt of the full cache, exactly (the single-process
    # engine's figure); the wire adds the kept positions, coded compactly per KV head and layer
    # (docs/wire_format.md), and per-request and per-chunk headers.
    want = self.single_process(prompt, "--policy", "snapkv", "--budget", str(BUDGET))
    payload = want["kept_bytes"]
    self.assertEqual(payload * n, snap["full_cache_bytes"] * kept)
    self.assertGreaterEqual(snap["wire_bytes"], payload)
    self.assertLessEqual(snap["wire_bytes"], 1.10 * payload + 4096)
    # The chunks' payload: those rows and their positions (per KV head and layer a byte of
    # coding, then deltas of at most 2 bytes here or a bitmap), less than the framed messages.
    positions = snap["kv_payload_bytes"] - payload
    layers, kv_heads, _ = model_shape(self.model, self.dir)
    self.assertGreaterEqual(positions, layers * kv_heads * (1 + kept // 8))
    self.assertLessEqual(positions, layers * kv_heads * (1 + 2 * kept))
    self.assertLess(snap["kv_payload_bytes"], snap["wire_bytes"])
    self.assertLess(snap["wire_bytes"] / snap["full_cache_bytes"], 1.10 * kept / n + 0.02)
    self.assertGreaterEqual(full["wire_bytes"], full["full_cache_bytes"])
    self.assertLessEqual(full["wire_bytes"], 1.10 * full["full_cache_bytes"] + 4096)
    # The decode nodes' Prometheus counters saw the same bytes (polled, as a scrape would
    # be: a node need not have counted by the time the client has its answer).
    delta = lambda: tuple(a - b for a, b in zip(self.decode_counters(), before))
    wire_sent = snap["wire_bytes"] + full["wire_bytes"]
    full_sent = snap["full_cache_bytes"] + full["full_cache_bytes"]
    wait_until(lambda: delta() == (wire_sent, full_sent), 10,
               "decode metrics to count %d wire / %d full bytes (have %s)"
               % (wire_sent, full_sent, delta()))

  def test_3_invalid_request_is_invalid_argument(self):
    bad, = self.generate([SHORT_PROMPT], "--policy", "no-such-policy", expect_ok=False)
    self.assertEqual(bad.get("error"), "INVALID_ARGUMENT", bad)
    self.assertIn("compression.policy", bad["message"])
    too_long, = self.generate([SHORT_PROMPT], "--max-tokens", "1000000", expect_ok=False)
    self.assertEqual(too_long.get("error"), "INVALID_ARGUMENT", too_long)
    # The router's access log carries the gRPC status of each call (written on completion).
    log = os.path.join(self.dir, "router", "logs", "access.log")

    def logged_statuses():
      with open(log) as f:
        return [json.loads(line) for line in f if "/kvwire.v1.Generation/Generate" in line]
    wait_until(lambda: sum(e["grpc_status"] == "3" for e in logged_statuses()) >= 2, 5,
               "two INVALID_ARGUMENT calls in %s" % log)
    self.assertTrue(all(e["http_status"] == 200 for e in logged_statuses()))

  def test_4_router_errors_are_grpc_errors(self):
    """A router whose decode nodes are unreachable answers UNAVAILABLE (the error_page
    mapping of 502), so clients see a gRPC status, not an HTML page."""
    prefix = os.path.join(self.tmp, "router-down")
    os.makedirs(os.path.join(prefix, "logs"))
    listen, closed = free_ports(2)
    with open(os.path.join(REPO, "deploy", "router", "nginx.conf.template")) as f:
      conf = (f.read().replace("@PREFIX@", prefix).replace("@LISTEN@", "127.0.0.1:%d" % listen)
              .replace("@DECODE_SERVERS@", "    server 127.0.0.1:%d;" % closed))
    with open(os.path.join(prefix, "nginx.conf"), "w") as f:
      f.write(conf)
    cmd = [self.nginx, "-p", prefix, "-e", os.path.join(prefix, "logs", "error.log"),
           "-c", os.path.join(prefix, "nginx.conf")]
    if os.geteuid() == 0:
      cmd += ["-g", "user root;"]
    nginx = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
      def listening():
        self.assertIsNone(nginx.poll(), "nginx exited; see %s/logs/error.log" % prefix)
        with socket.socket() as s:
          return s.connect_ex(("127.0.0.1", listen)) == 0
      wait_until(listening, 10, "nginx to listen")
      row, = self.generate([SHORT_PROMPT], target="127.0.0.1:%d" % listen, expect_ok=False)
      self.assertEqual(row.get("error"), "UNAVAILABLE", row)
      self.assertIn("router: no decode node available", row["message"])
    finally:
      nginx.send_signal(signal.SIGQUIT)
      nginx.wait(timeout=30)

  def test_5_killed_prefill_node(self):
    flags = ("--policy", "snapkv", "--budget", str(BUDGET))
    prompts = [self.long_prompts[0], SHORT_PROMPT + " She had a red ball.",
               self.long_prompts[1], SHORT_PROMPT]
    # Both decode nodes (nginx round robin) and both prefill nodes (each decode node's
    # gRPC round robin) serve.
    rows = self.generate(prompts, *flags)
    self.assertEqual({r["decode_node"] for r in rows}, {"decode-0", "decode-1"})
    self.assertEqual({r["prefill_node"] for r in rows}, {"prefill-0", "prefill-1"})

    # Freeze prefill-0, so that the next Prefill call sent to it stays in flight (its bytes
    # wait unread in the socket), then kill it -9: that call fails, and the decode node has
    # to retry it on prefill-1 for the client's request to succeed.
    victim = self.pids["prefill-0"]
    os.kill(victim, signal.SIGSTOP)
    try:
      client = subprocess.Popen(self.client_cmd(prompts, *flags), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
      wait_until(lambda: unread_bytes(self.prefill0_port) > 0 or client.poll() is not None, 30,
                 "a Prefill call to reach the frozen prefill-0")
      self.assertIsNone(client.poll(), "no request went to prefill-0 while it was frozen")
    finally:
      os.kill(victim, signal.SIGKILL)
    out, err = client.communicate(timeout=60)
    rows = self.parse_rows(out, err, client.returncode, len(prompts))
    self.assertTrue(all(r["prefill_node"] == "prefill-1" for r in rows), rows)
    wait_until(lambda: not running(victim), 10, "prefill-0 to die")

    # Later requests go to the surviving node only.
    rows = self.generate(prompts, *flags)
    self.assertEqual({r["prefill_node"] for r in rows}, {"prefill-1"})
    self.assertEqual({r["decode_node"] for r in rows}, {"decode-0", "decode-1"})
    status = self.cluster("status", check=False)
    self.assertEqual(status.returncode, 3, status.stdout)
    self.assertRegex(status.stdout, r"prefill-0 +prefill +%d .* dead" % victim)
    self.assertRegex(status.stdout, r"prefill-1 +prefill +\d+ .* alive")

  def test_6_stop_ends_every_process(self):
    procs = dict(self.pids)
    for pid in children(self.pids["router"]):  # nginx's worker
      procs["nginx worker %d" % pid] = pid
    self.assertGreater(len(procs), len(self.pids), "nginx has no worker process")
    stop = self.cluster("stop")
    for name, pid in procs.items():
      self.assertFalse(running(pid), "%s (pid %d) still runs after stop:\n%s"
                       % (name, pid, stop.stdout))
    self.assertEqual(os.listdir(os.path.join(self.dir, "pids")), [])
    self.assertTrue(os.path.getsize(os.path.join(self.dir, "logs", "decode-0.log")) > 0)
    for port in (self.router_port, self.openai_port):
      with socket.socket() as s:
        self.assertNotEqual(s.connect_ex(("127.0.0.1", port)), 0)
    status = self.cluster("status", check=False)
    self.assertEqual(status.returncode, 3)
    # 2 prefill and 2 decode nodes, the router and the OpenAI front.
    self.assertIn("openai", self.pids)
    self.assertEqual(status.stdout.count(" stopped"), 6, status.stdout)


def main():
  global REPO, BUILD, MODEL_OVERRIDE
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  p.add_argument("--model", default="",
                 help="model for the nodes and kvwire generate (default: ../shared's, else "
                      "synthetic:stories)")
  args, rest = p.parse_known_args()
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  MODEL_OVERRIDE = args.model
  if not find_nginx():
    print("SKIP: nginx is not installed (Debian: apt-get install nginx); cluster e2e not run")
    return 0
  prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
  return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
  sys.exit(main())
