#!/usr/bin/env python3
"""End to end with a real Prometheus: the local cluster of deploy/local/cluster.sh (nginx, two
decode and two prefill nodes on free loopback ports) scraped every second by a Prometheus server
configured from deploy/prometheus/local.yml.template, driven through nginx by
tools/kvwire_client.py. Once Prometheus has scraped every node after the last request, its HTTP
API must tell the same story as the clients:

  (a) sum(kvwire_kv_wire_bytes_total) of the decode nodes, and of the prefill nodes, equals the
      wire bytes the clients were told, exactly;
  (b) sum by policy of kvwire_kv_full_bytes_total equals the clients' full-cache bytes;
  (c) each request's wire bytes are what the budget's arithmetic says: kept/prompt of the full
      cache (the K/V rows), plus 4 bytes per kept token per KV head per layer (positions), plus
      at most 2% + 1 KiB of framing; the full/wire ratio Prometheus computes matches, and the
      kvwire_kv_compression_ratio histograms counted each remote request once;
  (d) kvwire_requests_total{status="ok"} of the decode nodes equals the successful requests, and
      each got a time-to-first-token observation;
  (e) a request that its first token ends (max_tokens 1) is counted too.

Uses the real tiny model and its long prompts in ../shared when present, else synthetic:stories
with token-id prompts. Prints "SKIP: ..." and exits 0 when nginx or prometheus is not installed.

usage: prometheus_e2e_test.py --repo-root DIR --build-dir DIR [--model M] [unittest options]
"""
import argparse
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import unittest
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The cluster test's helpers: free ports, process checks, polling.
from local_cluster import (LocalClusterCase, find_nginx, model_shape, pick_model,  # noqa: E402
                           require_binaries, stories_prompts, wait_until)

REPO = ""
BUILD = ""
MODEL_OVERRIDE = ""

BUDGET = 64
MAX_TOKENS = 8
SCRAPE_INTERVAL_S = 1
REQUESTS_PER_POLICY = 3
# Framing the wire may add to a request's K/V rows and positions: the header, the chunk fields
# and CRCs, the trailer.
OVERHEAD_REL, OVERHEAD_ABS = 0.02, 1024


def find_prometheus():
  """KVWIRE_PROMETHEUS if set, else prometheus on PATH or Debian's /usr/bin/prometheus."""
  if os.environ.get("KVWIRE_PROMETHEUS"):
    return shutil.which(os.environ["KVWIRE_PROMETHEUS"])
  return shutil.which("prometheus") or shutil.which("/usr/bin/prometheus")


def parse_rfc3339(text):
  """Prometheus's timestamps ("2025-01-02T03:04:05.123456789+00:00" or "...Z") as Unix time."""
  m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", text)
  if not m:
    raise AssertionError("unexpected timestamp from Prometheus: %r" % text)
  tz = "+00:00" if m.group(3) == "Z" else m.group(3)
  base = datetime.datetime.fromisoformat(m.group(1) + tz).timestamp()
  return base + (float("0." + m.group(2)) if m.group(2) else 0.0)


def kvwire_samples(text):
  """The kvwire_* sample lines of a /metrics page, as a set (to see whether a node settled)."""
  return {line for line in text.splitlines() if line.startswith("kvwire_")}


class PrometheusE2ETest(LocalClusterCase):

  @classmethod
  def setUpClass(cls):
    cls.nginx, cls.prometheus_bin = find_nginx(), find_prometheus()
    if not cls.nginx or not cls.prometheus_bin:
      raise unittest.SkipTest("SKIP: nginx or prometheus is not installed")
    cls.cluster_sh = os.path.join(REPO, "deploy", "local", "cluster.sh")
    cls.client_py = os.path.join(REPO, "tools", "kvwire_client.py")
    require_binaries(BUILD)
    cls.model = pick_model(REPO, MODEL_OVERRIDE)
    n_prompts = 2 * REQUESTS_PER_POLICY + 1
    cls.prompts = stories_prompts(REPO, cls.model, n_prompts)
    if cls.prompts is None:
      # Token ids for the synthetic model (vocabulary 512; 3.. skips BOS/EOS), 350-450 long.
      rng = random.Random(7)
      cls.prompts = ["ids:" + ",".join(str(rng.randrange(3, 500))
                                       for _ in range(rng.randrange(350, 450)))
                     for _ in range(n_prompts)]

    cls.REPO, cls.BUILD = REPO, BUILD
    cls.prom = None
    try:
      (cls.prom_port,) = cls.start_cluster(cls.model, "kvwire-prom-e2e-", extra_ports=1)
      cls.start_prometheus()
      cls.cluster("wait-ready", "--timeout", "60")
      cls.wait_prometheus_ready()
    except BaseException:
      cls.failed = True
      cls.tearDownClass()
      raise

  @classmethod
  def tearDownClass(cls):
    if cls.prom is not None and cls.prom.poll() is None:
      cls.prom.terminate()
      try:
        cls.prom.wait(timeout=10)
      except subprocess.TimeoutExpired:
        cls.prom.kill()
        cls.prom.wait()
    cls.stop_cluster(extra_logs=[os.path.join(cls.tmp, "prometheus.log")] if hasattr(cls, "tmp") else [])

  # ---- the cluster and Prometheus -----------------------------------------------------------

  @classmethod
  def start_prometheus(cls):
    """Renders deploy/prometheus/local.yml.template for this cluster's ports and starts a
    Prometheus server on it, with its storage and log in the temporary directory."""
    with open(os.path.join(REPO, "deploy", "prometheus", "local.yml.template")) as f:
      conf = f.read()
    values = {"HOST": "127.0.0.1", "SCRAPE_INTERVAL": "%ds" % SCRAPE_INTERVAL_S,
              "PREFILL0_METRICS_PORT": cls.metrics_ports["prefill-0"],
              "PREFILL1_METRICS_PORT": cls.metrics_ports["prefill-1"],
              "DECODE0_METRICS_PORT": cls.metrics_ports["decode-0"],
              "DECODE1_METRICS_PORT": cls.metrics_ports["decode-1"]}
    for key, value in values.items():
      conf = conf.replace("@%s@" % key, str(value))
    left = re.findall(r"@[A-Z0-9_]+@", conf)
    if left:
      raise AssertionError("local.yml.template has placeholders this test does not fill: %s"
                           % sorted(set(left)))
    config = os.path.join(cls.tmp, "prometheus.yml")
    with open(config, "w") as f:
      f.write(conf)
    cls.prom_log = open(os.path.join(cls.tmp, "prometheus.log"), "w")
    cls.prom = subprocess.Popen(
        [cls.prometheus_bin, "--config.file=" + config,
         "--storage.tsdb.path=" + os.path.join(cls.tmp, "tsdb"),
         "--web.listen-address=127.0.0.1:%d" % cls.prom_port, "--storage.tsdb.retention.time=1h"],
        stdin=subprocess.DEVNULL, stdout=cls.prom_log, stderr=subprocess.STDOUT)

  @classmethod
  def wait_prometheus_ready(cls):
    def ready():
      if cls.prom.poll() is not None:
        raise AssertionError("prometheus exited (%d); see %s/prometheus.log"
                             % (cls.prom.returncode, cls.tmp))
      try:
        with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % cls.prom_port,
                                    timeout=2) as r:
          return r.status == 200
      except OSError:
        return False
    wait_until(ready, 30, "prometheus to be ready")

    last = {}

    def all_up():
      last["up"] = {dict(k).get("instance"): v for k, v in cls.query_vector("up").items()}
      return len(last["up"]) == 4 and all(v == 1 for v in last["up"].values())
    try:
      wait_until(all_up, 30, "prometheus to scrape the 4 nodes (up == 1)")
    except AssertionError as e:
      raise AssertionError("%s; up by instance: %s; the nodes' metrics ports: %s"
                           % (e, last.get("up"), cls.metrics_ports)) from None

  @classmethod
  def api(cls, path, **params):
    url = "http://127.0.0.1:%d/api/v1/%s?%s" % (cls.prom_port, path,
                                                urllib.parse.urlencode(params))
    with urllib.request.urlopen(url, timeout=10) as r:
      body = json.loads(r.read().decode())
    if body.get("status") != "success":
      raise AssertionError("prometheus %s failed: %s" % (url, body))
    return body["data"]

  @classmethod
  def query_vector(cls, promql):
    """An instant query's result as {frozenset(labels): value}."""
    data = cls.api("query", query=promql)
    if data["resultType"] != "vector":
      raise AssertionError("%s: expected a vector, got %s" % (promql, data["resultType"]))
    return {frozenset(s["metric"].items()): float(s["value"][1]) for s in data["result"]}

  def query_scalar(self, promql):
    """The value of a query that yields at most one series; 0 when it yields none (a counter
    no node has incremented yet)."""
    vec = self.query_vector(promql)
    self.assertLessEqual(len(vec), 1, "%s: expected one series, got %s" % (promql, vec))
    return next(iter(vec.values()), 0.0)

  def query_by(self, promql, label):
    return {dict(k).get(label, ""): v for k, v in self.query_vector(promql).items()}

  def node_metrics(self):
    out = {}
    for name, port in self.metrics_ports.items():
      with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        out[name] = kvwire_samples(r.read().decode())
    return out

  def wait_scraped(self):
    """Returns once every node has settled (its kvwire_* samples unchanged over 0.3 s) and
    Prometheus has since started two scrapes of each: scrapes of a target run one after
    another, so the first of the two has been stored by the time the second starts."""
    prev = self.node_metrics()
    deadline = time.monotonic() + 15
    while True:
      time.sleep(0.3)
      cur = self.node_metrics()
      if cur == prev:
        break
      self.assertLess(time.monotonic(), deadline, "the nodes' metrics kept changing")
      prev = cur
    settled = time.time()

    def last_scrapes():
      targets = self.api("targets", state="active")["activeTargets"]
      self.assertEqual(len(targets), 4, "prometheus targets: %s" % targets)
      for t in targets:
        self.assertEqual(t["health"], "up", "target %s: %s" % (t["scrapeUrl"], t["lastError"]))
      return {t["scrapeUrl"]: parse_rfc3339(t["lastScrape"]) for t in targets}
    wait_until(lambda: min(last_scrapes().values()) > settled, 10,
               "prometheus to scrape every node after the last request")
    first = last_scrapes()
    wait_until(lambda: all(v > first[k] for k, v in last_scrapes().items()), 10,
               "a second scrape of every node")

  def generate(self, prompts, *flags):
    cmd = [sys.executable, self.client_py, "--json", "--timeout", "60",
           "--target", "127.0.0.1:%d" % self.router_port, "--stubs", os.path.join(BUILD, "python"),
           "--ignore-eos"] + list(flags)
    for p in prompts:
      cmd += ["--prompt", p]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=90)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    self.assertEqual(len(rows), len(prompts), "client output:\n%s\n%s" % (r.stdout, r.stderr))
    for row in rows:
      self.assertNotIn("error", row, "request failed through the router: %s" % row)
    self.assertEqual(r.returncode, 0, r.stderr)
    return rows

  def model_shape(self):
    return model_shape(self.model, self.dir)

  def snapshot(self):
    """The figures this test checks, as Prometheus has them now."""
    q = self.query_scalar
    return {
        "wire_decode": q('sum(kvwire_kv_wire_bytes_total{role="decode"})'),
        "wire_prefill": q('sum(kvwire_kv_wire_bytes_total{role="prefill"})'),
        "full_decode": self.query_by('sum by (policy) (kvwire_kv_full_bytes_total{role="decode"})',
                                     "policy"),
        "full_prefill": self.query_by(
            'sum by (policy) (kvwire_kv_full_bytes_total{role="prefill"})', "policy"),
        "wire_decode_by_policy": self.query_by(
            'sum by (policy) (kvwire_kv_wire_bytes_total{role="decode"})', "policy"),
        "ratio_count_decode": self.query_by(
            'sum by (policy) (kvwire_kv_compression_ratio_count{role="decode"})', "policy"),
        "ratio_count_prefill": self.query_by(
            'sum by (policy) (kvwire_kv_compression_ratio_count{role="prefill"})', "policy"),
        "ratio_sum_decode": q('sum(kvwire_kv_compression_ratio_sum{role="decode"})'),
        "ok_decode": q('sum(kvwire_requests_total{role="decode",status="ok"})'),
        "not_ok_decode": q('sum(kvwire_requests_total{role="decode",status!="ok"})'),
        "ok_prefill": q('sum(kvwire_requests_total{role="prefill",status="ok"})'),
        "ttft_count": q('sum(kvwire_time_to_first_token_seconds_count{role="decode"})'),
    }

  # ---- tests ----------------------------------------------------------------------------------

  def test_1_prometheus_agrees_with_the_clients(self):
    self.wait_scraped()
    before = self.snapshot()
    k = REQUESTS_PER_POLICY
    rows = {"snapkv": self.generate(self.prompts[:k], "--max-tokens", str(MAX_TOKENS),
                                    "--policy", "snapkv", "--budget", str(BUDGET)),
            "full": self.generate(self.prompts[k:2 * k], "--max-tokens", str(MAX_TOKENS),
                                  "--policy", "full")}
    every = rows["snapkv"] + rows["full"]
    remote = [r for r in every if r["prefill_node"] not in ("", "local")]
    self.assertEqual(len(remote), len(every), "requests prefilled on the decode node itself "
                     "(prefill_node %s): this test is about remote prefills"
                     % [r["prefill_node"] for r in every])
    self.wait_scraped()
    after = self.snapshot()

    def delta(key, label=None):
      if label is None:
        return after[key] - before[key]
      return after[key].get(label, 0.0) - before[key].get(label, 0.0)

    # (a) Bytes on the wire, as the decode nodes received them and the prefill nodes sent them.
    told_wire = sum(r["wire_bytes"] for r in every)
    self.assertGreater(told_wire, 0)
    self.assertEqual(delta("wire_decode"), told_wire,
                     "sum(kvwire_kv_wire_bytes_total{role=\"decode\"}) grew by %d, but the "
                     "clients were told %d wire bytes" % (delta("wire_decode"), told_wire))
    self.assertEqual(delta("wire_prefill"), told_wire,
                     "sum(kvwire_kv_wire_bytes_total{role=\"prefill\"}) grew by %d, but the "
                     "clients were told %d wire bytes" % (delta("wire_prefill"), told_wire))

    # (b) Full-cache bytes, per policy, on both roles.
    for policy, group in rows.items():
      told_full = sum(r["full_cache_bytes"] for r in group)
      for role in ("decode", "prefill"):
        got = delta("full_" + role, policy)
        self.assertEqual(got, told_full,
                         "kvwire_kv_full_bytes_total{role=\"%s\",policy=\"%s\"} grew by %d, but "
                         "the clients were told %d full-cache bytes" % (role, policy, got,
                                                                        told_full))

    # (c) The budget's arithmetic, request by request, then as Prometheus aggregates it.
    layers, kv_heads, head_dim = self.model_shape()
    expected_min, expected_max = {}, {}
    for policy, group in rows.items():
      expected_min[policy] = expected_max[policy] = 0
      for r in group:
        n, kept, full, wire = (r["prompt_tokens"], r["kept_tokens"], r["full_cache_bytes"],
                               r["wire_bytes"])
        what = "%s request %s (prompt %d, kept %d, full %d, wire %d)" % (
            policy, r["request_id"][:8], n, kept, full, wire)
        self.assertEqual(kept, BUDGET if policy == "snapkv" else n, what)
        self.assertGreater(n, 4 * BUDGET, what + ": the prompt should be well over the budget")
        self.assertEqual(full % n, 0, what + ": full-cache bytes are not whole tokens")
        per_token = full // n  # K and V, every layer and KV head
        self.assertIn(per_token // (2 * layers * kv_heads * head_dim), (2, 4),
                      what + ": %d bytes per token is not 2 x %d layers x %d KV heads x %d dims "
                      "of a 2- or 4-byte type" % (per_token, layers, kv_heads, head_dim))
        payload = kept * per_token  # = kept/prompt of the full cache
        # Positions are coded per KV head and layer as deltas (a byte each while gaps are
        # below 128, two below 16384) or a bitmap (a bit per prompt token), behind a byte of
        # coding: at least that byte and a bit per kept token, at most 1 + 2 bytes per token.
        heads = kv_heads * layers
        positions = heads * (1 + kept // 8)
        positions_max = heads * (1 + 2 * kept)
        overhead = wire - payload - positions
        self.assertGreaterEqual(overhead, 0, what + ": fewer bytes than the kept K/V rows (%d) "
                                "and their positions (%d)" % (payload, positions))
        self.assertLessEqual(overhead, OVERHEAD_REL * payload + OVERHEAD_ABS +
                             positions_max - positions,
                             what + ": %d bytes of framing over K/V %d + positions %d..%d"
                             % (overhead, payload, positions, positions_max))
        expected_min[policy] += payload + positions
        expected_max[policy] += payload + positions_max
    snap_full = sum(r["full_cache_bytes"] for r in rows["snapkv"])
    snap_wire = delta("wire_decode_by_policy", "snapkv")
    ratio = snap_full / snap_wire
    lo = snap_full / (expected_max["snapkv"] * (1 + OVERHEAD_REL) + OVERHEAD_ABS * k)
    hi = snap_full / expected_min["snapkv"]
    self.assertTrue(lo <= ratio <= hi, "snapkv full/wire ratio from Prometheus %.3f is not in "
                    "[%.3f, %.3f], the budget's arithmetic" % (ratio, lo, hi))
    self.assertGreater(ratio, 4, "SnapKV at budget %d should move several times less KV" % BUDGET)
    for policy, group in rows.items():
      for role in ("decode", "prefill"):
        got = delta("ratio_count_" + role, policy)
        self.assertEqual(got, len(group),
                         "kvwire_kv_compression_ratio_count{role=\"%s\",policy=\"%s\"} grew by "
                         "%d for %d remote requests" % (role, policy, got, len(group)))
    told_ratios = sum(r["full_cache_bytes"] / r["wire_bytes"] for r in remote)
    self.assertAlmostEqual(delta("ratio_sum_decode"), told_ratios, delta=1e-6 * told_ratios,
                           msg="kvwire_kv_compression_ratio_sum of the decode nodes")

    # (d) Request counts and TTFT observations.
    self.assertEqual(delta("ok_decode"), len(every),
                     "kvwire_requests_total{role=\"decode\",status=\"ok\"} grew by %d for %d "
                     "successful requests" % (delta("ok_decode"), len(every)))
    self.assertEqual(delta("not_ok_decode"), 0, "requests that did not end ok were counted")
    self.assertEqual(delta("ok_prefill"), len(remote),
                     "kvwire_requests_total{role=\"prefill\",status=\"ok\"} grew by %d for %d "
                     "remote prefills" % (delta("ok_prefill"), len(remote)))
    self.assertEqual(delta("ttft_count"), len(every),
                     "kvwire_time_to_first_token_seconds_count of the decode nodes")

  def test_2_request_ended_by_its_first_token(self):
    """max_tokens 1: the prefill node's first token ends the request before it joins the
    decode batch; its KV transfer still happened and must be counted. (The decode engine
    counts a transfer where a sequence joins the batch; the branch for a sequence its first
    token finished must count it too.)"""
    self.wait_scraped()
    before = self.snapshot()
    row, = self.generate(self.prompts[-1:], "--max-tokens", "1", "--policy", "snapkv",
                         "--budget", str(BUDGET))
    self.assertEqual(row["completion_tokens"], 1, row)
    self.wait_scraped()
    after = self.snapshot()
    for role in ("prefill", "decode"):
      got = after["wire_" + role] - before["wire_" + role]
      self.assertEqual(got, row["wire_bytes"],
                       "sum(kvwire_kv_wire_bytes_total{role=\"%s\"}) grew by %d for a request "
                       "the client was told moved %d wire bytes (max_tokens 1)"
                       % (role, got, row["wire_bytes"]))
    self.assertEqual(after["ok_decode"] - before["ok_decode"], 1)


def main():
  global REPO, BUILD, MODEL_OVERRIDE
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  p.add_argument("--model", default="",
                 help="model for the nodes (default: ../shared's, else synthetic:stories)")
  args, rest = p.parse_known_args()
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  MODEL_OVERRIDE = args.model
  missing = [name for name, found in (("nginx", find_nginx()), ("prometheus", find_prometheus()))
             if not found]
  if missing:
    print("SKIP: %s not installed (Debian: apt-get install %s); Prometheus e2e not run"
          % (" and ".join(missing), " ".join(missing)))
    return 0
  prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
  return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
  sys.exit(main())
