#!/usr/bin/env python3
"""Fault injection on the local cluster (deploy/local/cluster.sh: nginx, two decode and two
prefill nodes, mutual TLS between them), as an operator and an attacker would try it. Each
experiment prints one summary line; the process exits non-zero when one misses its bar.

  malformed   bytes that are not a request, and a prompt that is not UTF-8, to the decode
              nodes (through the router) and to a prefill node (with the decode nodes'
              certificate): INVALID_ARGUMENT every time, and the nodes' logs not flooded
  unread      two Prefill streams per prefill node that are never read (small chunks, no
              deadline): Generate through the router still succeeds
  kills       clients in a loop while a prefill node is killed (-9) and restarted again and
              again: failures at most 1% of requests
  stop        a prefill node SIGSTOPped for longer than keepalive needs to notice: no request
              that had time left fails
  load        many clients for a while, a fifth of them cancelling after the first token: no
              RESOURCE_EXHAUSTED while requests have deadline left

After each: every decode node's KV pool back to 0 and no process's RSS grown by more than
--rss-growth. `--quick` runs short versions (what CI runs); the defaults are the issue's
figures (20 kills under 8 clients, 64 clients for 2 minutes).

usage: fault_injection.py --repo-root DIR --build-dir DIR [--quick] [--only a,b] [...]
"""
import argparse
import os
import random
import re
import signal
import sys
import threading
import time
import unittest
import urllib.request

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_cluster import (LocalClusterCase, find_nginx, pick_model, require_binaries,  # noqa: E402
                           running, wait_until)

ARGS = None
PROMPT = ("Once upon a time, there was a little girl named Lily. She liked to play in the park "
          "with her red ball and her dog Max. One day the sun was hot and the sky was blue. ")


def read_bytes(*path):
  with open(os.path.join(*path), "rb") as f:
    return f.read()


def rss_kib(pid):
  with open("/proc/%d/status" % pid) as f:
    return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


class Tally:
  """Outcomes of requests by status code, with the times of failures."""

  def __init__(self):
    self.lock = threading.Lock()
    self.codes = {}
    self.failures = []  # (monotonic time, code, details, had_time_left)

  def add(self, code, details="", at=None, time_left=True):
    with self.lock:
      self.codes[code.name] = self.codes.get(code.name, 0) + 1
      if code != grpc.StatusCode.OK and code != grpc.StatusCode.CANCELLED:
        self.failures.append((at or time.monotonic(), code.name, details, time_left))

  def total(self):
    return sum(self.codes.values())

  def summary(self):
    return ", ".join("%s %d" % kv for kv in sorted(self.codes.items()))


class FaultInjection(LocalClusterCase):

  @classmethod
  def setUpClass(cls):
    cls.nginx = find_nginx()
    if not cls.nginx:
      raise unittest.SkipTest("SKIP: nginx is not installed")
    require_binaries(BUILD)
    from kvwire_client import load_stubs  # pylint: disable=import-outside-toplevel
    cls.pb, cls.pb_grpc = load_stubs(os.path.join(BUILD, "python"), os.path.join(REPO, "proto"))
    from kvwire.v1 import prefill_pb2  # pylint: disable=import-error,import-outside-toplevel
    cls.prefill_pb = prefill_pb2
    cls.REPO, cls.BUILD = REPO, BUILD
    cls.model = pick_model(REPO, "")
    try:
      cls.start_cluster(cls.model, "kvwire-faults-")
      cls.cluster("wait-ready", "--timeout", "60")
    except BaseException:
      cls.failed = True
      cls.tearDownClass()
      raise
    cls.router = "127.0.0.1:%d" % cls.router_port
    tls = os.path.join(cls.dir, "tls")
    cls.decode_identity = grpc.ssl_channel_credentials(read_bytes(tls, "decode", "ca.crt"),
                                                       read_bytes(tls, "decode", "tls.key"),
                                                       read_bytes(tls, "decode", "tls.crt"))

  @classmethod
  def tearDownClass(cls):
    cls.stop_cluster()

  # ---- helpers

  def request(self, max_tokens=8, budget=64):
    req = self.pb.GenerateRequest(prompt=PROMPT * 2)
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    req.compression.policy = "snapkv"
    req.compression.budget = budget
    return req

  def generate(self, stub, req, timeout, cancel_after_first=False):
    """(code, details, tokens) of one Generate call."""
    tokens = 0
    call = stub.Generate(req, timeout=timeout)
    try:
      for msg in call:
        tokens += len(msg.token_ids)
        if cancel_after_first and tokens:
          call.cancel()
          return grpc.StatusCode.CANCELLED, "cancelled by the client", tokens
      return grpc.StatusCode.OK, "", tokens
    except grpc.RpcError as e:
      return e.code(), e.details(), tokens

  def prefill_channel(self, name, options=()):
    return grpc.secure_channel("127.0.0.1:%d" % self.node_ports[name], self.decode_identity,
                               options=[("grpc.ssl_target_name_override", "localhost")] +
                               list(options))

  def pool_used(self):
    total = 0.0
    for name in ("decode-0", "decode-1"):
      url = "http://127.0.0.1:%d/metrics" % self.metrics_ports[name]
      text = urllib.request.urlopen(url, timeout=5).read().decode()
      m = re.search(r"^kvwire_kv_pool_used_bytes(?:\{[^}]*\})? (\S+)$", text, re.M)
      total += float(m.group(1)) if m else 0.0
    return total

  def rss(self):
    self.pids = self.read_pids()
    return {n: rss_kib(p) for n, p in self.pids.items() if running(p)}

  def clients(self, n, seconds, timeout, cancel_share=0.0, stop=None):
    """n threads of back-to-back Generate calls through the router for `seconds`."""
    tally = Tally()
    end = time.monotonic() + seconds
    stop = stop or threading.Event()

    def loop(i):
      rng = random.Random(i)
      with grpc.insecure_channel(self.router) as channel:
        stub = self.pb_grpc.GenerationStub(channel)
        while time.monotonic() < end and not stop.is_set():
          start = time.monotonic()
          code, details, _ = self.generate(stub, self.request(), timeout,
                                           cancel_after_first=rng.random() < cancel_share)
          now = time.monotonic()
          tally.add(code, details, now, time_left=now - start < timeout - 0.5)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
    for t in threads:
      t.start()
    return tally, threads

  def settle(self, what, rss_before):
    """The pools drain back to 0 and RSS stays flat; the line's tail."""
    wait_until(lambda: self.pool_used() == 0, 30, "the KV pools to drain after " + what)
    after = self.rss()
    grown = {n: after[n] - rss_before[n] for n in after if n in rss_before}
    worst = max(grown.items(), key=lambda kv: kv[1]) if grown else ("-", 0)
    self.assertLessEqual(worst[1], ARGS.rss_growth * 1024,
                         "%s: RSS of %s grew by %d KiB" % (what, worst[0], worst[1]))
    return "pools 0; largest RSS growth %s %+d KiB" % worst

  def report(self, line):
    print("fault_injection: " + line, file=sys.stderr, flush=True)

  def skip_unless(self, name):
    if ARGS.only and name not in ARGS.only.split(","):
      self.skipTest("not in --only")

  # ---- experiments (run in name order)

  def test_1_malformed(self):
    self.skip_unless("malformed")
    rss_before = self.rss()
    n = 0
    garbage = [b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x02\xff\xfe", os.urandom(64)]
    with grpc.insecure_channel(self.router) as router, \
        self.prefill_channel("prefill-0") as prefill:
      calls = [router.unary_stream("/kvwire.v1.Generation/Generate"),
               prefill.unary_stream("/kvwire.v1.Prefill/Prefill")]
      for _ in range(ARGS.malformed_rounds):
        for call in calls:
          for body in garbage:
            try:
              for _ in call(body, timeout=10):
                pass
              self.fail("%r was accepted" % body)
            except grpc.RpcError as e:
              if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self.assertIn("could not be parsed", e.details())
              else:  # random bytes can parse; then a field is bad or the input missing
                self.assertIn(e.code(), (grpc.StatusCode.INVALID_ARGUMENT,
                                         grpc.StatusCode.FAILED_PRECONDITION), e.details())
              n += 1
    lines = 0
    for name in ("decode-0", "decode-1", "prefill-0"):
      with open(os.path.join(self.dir, "logs", name + ".log"), errors="replace") as f:
        lines = max(lines, sum(1 for line in f if line.startswith("protobuf ")))
    self.assertLessEqual(lines, 2 * 10, "protobuf's lines are rate-limited")
    self.report("malformed: %d bad messages refused (INVALID_ARGUMENT/FAILED_PRECONDITION); at "
                "most %d protobuf log lines per node; %s" % (n, lines,
                                                          self.settle("malformed", rss_before)))

  def test_2_unread(self):
    self.skip_unless("unread")
    rss_before = self.rss()
    req = self.prefill_pb.PrefillRequest(prompt_ids=[1] + [3 + (i * 37) % 400 for i in range(400)],
                                         max_chunk_bytes=1024)
    req.compression.policy = "full"
    with open(os.path.join(self.dir, "logs", "prefill-0.log"), errors="replace") as f:
      req.model_fingerprint = re.search(r"model fingerprint (\S+)\)", f.read()).group(1)
    # A reader that takes nothing: its transport buffers 64 KiB and no more.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
    idle = []
    for name in ("prefill-0", "prefill-1"):
      for _ in range(2):
        channel = self.prefill_channel(name, options)
        stream = channel.unary_stream("/kvwire.v1.Prefill/Prefill")(req.SerializeToString())
        idle.append((channel, stream))
    for _, stream in idle:  # each has its header: a worker is streaming it
      next(stream)
    latencies = []
    with grpc.insecure_channel(self.router) as channel:
      stub = self.pb_grpc.GenerationStub(channel)
      for _ in range(4):
        start = time.monotonic()
        code, details, tokens = self.generate(stub, self.request(), timeout=60)
        latencies.append(time.monotonic() - start)
        self.assertEqual(code, grpc.StatusCode.OK, details)
        self.assertEqual(tokens, 8)
    for channel, stream in idle:
      stream.cancel()
      channel.close()
    self.report("unread: with 2 unread Prefill streams per prefill node, 4/4 Generate calls "
                "succeeded (slowest %.1f s); %s" % (max(latencies),
                                                    self.settle("unread", rss_before)))

  def test_3_kills(self):
    self.skip_unless("kills")
    rss_before = self.rss()
    stop = threading.Event()
    tally, threads = self.clients(ARGS.clients, 1e9, timeout=30, stop=stop)
    kills = []
    for k in range(ARGS.kills):
      time.sleep(random.uniform(1.0, 2.0))
      name = "prefill-%d" % (k % 2)
      pid = self.read_pids()[name]
      kills.append(time.monotonic())
      os.kill(pid, signal.SIGKILL)
      wait_until(lambda p=pid: not running(p), 10, name + " to die")
      time.sleep(0.5)
      self.cluster("start", "--model", self.model, "--build-dir", BUILD)  # restarts it
    time.sleep(2)
    stop.set()
    for t in threads:
      t.join(timeout=120)
    failed = len(tally.failures)
    near = sum(1 for at, *_ in tally.failures if any(0 <= at - k <= 0.5 for k in kills))
    self.assertGreater(tally.total(), 0)
    self.assertLessEqual(failed, 0.01 * tally.total(), tally.summary())
    self.report("kills: %d kills of a prefill node under %d clients: %d requests, %d failed "
                "(%.2f%%; %d within 0.5 s of a kill) [%s]; %s"
                % (ARGS.kills, ARGS.clients, tally.total(), failed,
                   100.0 * failed / max(1, tally.total()), near, tally.summary(),
                   self.settle("kills", rss_before)))

  def test_4_stop(self):
    self.skip_unless("stop")
    rss_before = self.rss()
    stop = threading.Event()
    tally, threads = self.clients(ARGS.clients, 1e9, timeout=60, stop=stop)
    time.sleep(2)
    pid = self.read_pids()["prefill-0"]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(ARGS.stop_seconds)
    os.kill(pid, signal.SIGCONT)
    time.sleep(3)
    stop.set()
    for t in threads:
      t.join(timeout=120)
    lost = [f for f in tally.failures if f[3]]
    self.assertEqual(lost, [], "requests with time left failed: %s" % lost[:3])
    self.report("stop: prefill-0 SIGSTOPped for %d s under %d clients (60 s deadlines): %d "
                "requests, %d failed with time left [%s]; %s"
                % (ARGS.stop_seconds, ARGS.clients, tally.total(), len(lost), tally.summary(),
                   self.settle("stop", rss_before)))

  def test_5_load(self):
    self.skip_unless("load")
    rss_before = self.rss()
    tally, threads = self.clients(ARGS.load_clients, ARGS.load_seconds, timeout=120,
                                  cancel_share=0.2)
    for t in threads:
      t.join(timeout=ARGS.load_seconds + 180)
    exhausted = [f for f in tally.failures if f[1] == "RESOURCE_EXHAUSTED" and f[3]]
    self.assertEqual(exhausted, [], "RESOURCE_EXHAUSTED with deadline left: %s" % exhausted[:3])
    self.report("load: %d clients for %d s, 20%% cancelling after the first token: %d requests "
                "[%s]; %s" % (ARGS.load_clients, ARGS.load_seconds, tally.total(),
                              tally.summary(), self.settle("load", rss_before)))


def main():
  global ARGS, REPO, BUILD  # pylint: disable=global-statement
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  p.add_argument("--quick", action="store_true", help="short versions (CI)")
  p.add_argument("--only", default="", help="comma-separated: malformed,unread,kills,stop,load")
  p.add_argument("--kills", type=int, default=20)
  p.add_argument("--clients", type=int, default=8)
  p.add_argument("--stop-seconds", type=int, default=20)
  p.add_argument("--load-clients", type=int, default=64)
  p.add_argument("--load-seconds", type=int, default=120)
  p.add_argument("--malformed-rounds", type=int, default=15)
  p.add_argument("--rss-growth", type=int, default=64, help="MiB a process may grow by")
  args, rest = p.parse_known_args()
  if args.quick:
    args.kills, args.clients, args.stop_seconds = 4, 4, 12
    args.load_clients, args.load_seconds, args.malformed_rounds = 16, 15, 3
  ARGS = args
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  sys.path.insert(0, os.path.join(REPO, "tools"))
  unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


REPO = BUILD = ""
if __name__ == "__main__":
  main()
