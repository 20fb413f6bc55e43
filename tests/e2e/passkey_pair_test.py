#!/usr/bin/env python3
"""Passkey retrieval through the local cluster (nginx as the router, two decode and two prefill
nodes serving ../shared/models/passkey-induction-hf): `kvwire eval passkey --target ROUTER`
sends every prompt, method and budget as a Generate call, and

  (a) its answers equal the in-process evaluation's prompt for prompt (`--compare`), for
      prompt compression (SnapKV, StreamingLLM, ChunkKV, HBW-KV), sparse decode (Quest) and
      both at once (RocketKV), with the same KV payload bytes;
  (b) SnapKV at budget 128 answers a fixed handful of dev prompts and StreamingLLM at 32 none
      of them (their needles lie far from the end);
  (c) the records carry the breakdown (task, length bucket) and the wire's bytes, which exceed
      the payload by the framing only.

Skips (exit 0) when nginx is not installed or ../shared is absent.

usage: passkey_pair_test.py --repo-root DIR --build-dir DIR [unittest options]
"""
import argparse
import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_cluster import LocalClusterCase, find_nginx, require_binaries  # noqa: E402

REPO = ""
BUILD = ""
# tests/test_util.h's kPasskeyHandful: 491 to 1975 tokens, single and multi, depth 0 to 0.56.
HANDFUL = ["dev-512-026", "dev-1024-025", "dev-1536-000", "dev-2000-001", "dev-2000-026"]
METHODS = "snapkv,streaming,chunkkv,hbw,quest,rocketkv"
BUDGETS = "32,128"


class PasskeyPairTest(LocalClusterCase):

  @classmethod
  def setUpClass(cls):
    cls.nginx = find_nginx()
    cls.shared = os.path.join(REPO, "..", "shared")
    cls.model = os.path.abspath(os.path.join(cls.shared, "models", "passkey-induction-hf"))
    cls.kvwire = os.path.join(BUILD, "tools", "kvwire")
    require_binaries(BUILD, extra=(cls.kvwire,))
    cls.REPO, cls.BUILD = REPO, BUILD
    try:
      cls.start_cluster(cls.model, "kvwire-passkey-")
      # The handful, from the dataset (written to the run's temporary directory only).
      cls.data = os.path.join(cls.tmp, "handful.jsonl")
      by_id = {}
      with open(os.path.join(cls.shared, "data", "passkey", "dev.jsonl")) as f:
        for line in f:
          by_id[json.loads(line)["id"]] = line
      with open(cls.data, "w") as f:
        f.writelines(by_id[i] for i in HANDFUL)
      cls.cluster("wait-ready", "--timeout", "60")
    except BaseException:
      cls.failed = True
      cls.tearDownClass()
      raise

  @classmethod
  def tearDownClass(cls):
    cls.stop_cluster()

  def eval(self, name, *extra):
    answers = os.path.join(self.tmp, name + "-answers.jsonl")
    records = os.path.join(self.tmp, name + ".jsonl")
    r = subprocess.run([self.kvwire, "eval", "passkey", "--model", self.model, "--data",
                        self.data, "--policies", METHODS, "--budgets", BUDGETS, "--answers",
                        answers, "--json", records] + list(extra),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    with open(answers) if os.path.exists(answers) else open(os.devnull) as f:
      rows = [json.loads(line) for line in f]
    return r, answers, rows, records

  def test_through_the_router_equals_in_process(self):
    r, reference, local, _ = self.eval("in-process", "--threads", "1")
    self.assertEqual(r.returncode, 0, r.stderr)
    self.assertEqual(len(local), len(HANDFUL) * 6 * 2)
    router = "127.0.0.1:%d" % self.router_port
    r, _, remote, records = self.eval("router", "--target", router, "--concurrency", "2",
                                      "--compare", reference)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertIn("0 of %d answers differ" % len(local), r.stderr)
    # Progress in a log: whole lines, not a redrawn bar.
    self.assertNotIn("\r", r.stderr)
    self.assertIn("5/5 prompts (100%)", r.stderr)

    # (b) the regression: SnapKV at 128 answers all, StreamingLLM at 32 none.
    def correct(policy, budget):
      return [a["correct"] for a in remote if a["policy"] == policy and a["budget"] == budget]
    self.assertEqual(correct("snapkv", 128), [True] * len(HANDFUL))
    self.assertEqual(correct("streaming", 32), [False] * len(HANDFUL))

    # (c) the wire's bytes: the payload plus framing (under 1%).
    for a in remote:
      self.assertGreater(a["wire_bytes"], a["kv_payload_bytes"], a)
      self.assertLess(a["wire_bytes"], a["kv_payload_bytes"] * 1.01, a)
    with open(records) as f:
      rows = [json.loads(line) for line in f]
    totals = [x for x in rows if x["task"] == "all" and x["length"] == "all"]
    self.assertEqual(len(totals), 6 * 2)
    self.assertEqual({x["task"] for x in rows}, {"all", "single", "multi"})
    self.assertEqual({x["length"] for x in rows}, {"all", 512, 1024, 1536, 2048})
    snapkv = [x for x in totals if x["policy"] == "snapkv" and x["budget"] == 128][0]
    self.assertEqual(snapkv["accuracy"], 1.0)
    self.assertGreater(snapkv["ratio"], 3.5)  # 491..1975 tokens kept to 128
    self.assertLess(snapkv["wire_ratio"], snapkv["ratio"])

  def test_warm_pass_finds_each_prompt_cached(self):
    """--warm-pass: each request twice. With the prefix cache and affinity routing (the local
    cluster's defaults: both decode nodes send a prompt to the same prefill node) the second
    finds its prompt cached there, and answers as the first did."""
    router = "127.0.0.1:%d" % self.router_port
    r, _, rows, _ = self.eval("warm", "--target", router, "--warm-pass")
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    self.assertIn("warm pass (the same request again)", r.stdout)
    self.assertEqual(len(rows), len(HANDFUL) * 6 * 2)
    for a in rows:
      self.assertEqual(a["warm_tokens"], a["tokens"], a)
      self.assertGreater(a["warm_cached_tokens"], 0, a)
      self.assertGreater(a["ttft_ms"], 0, a)
      self.assertGreater(a["warm_ttft_ms"], 0, a)

  def test_flags_of_the_other_mode_are_refused(self):
    r, _, _, _ = self.eval("bad", "--concurrency", "2")
    self.assertEqual(r.returncode, 2, r.stderr)
    self.assertIn("--concurrency applies only with --target", r.stderr)
    r, _, _, _ = self.eval("bad3", "--warm-pass")
    self.assertEqual(r.returncode, 2, r.stderr)
    self.assertIn("--warm-pass applies only with --target", r.stderr)
    r, _, _, _ = self.eval("bad2", "--target", "127.0.0.1:%d" % self.router_port, "--threads",
                           "2")
    self.assertEqual(r.returncode, 2, r.stderr)
    self.assertIn("--threads does not apply with --target", r.stderr)


def main():
  global REPO, BUILD
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  args, rest = p.parse_known_args()
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  if not find_nginx():
    print("SKIP: nginx is not installed (Debian: apt-get install nginx); passkey e2e not run")
    return 0
  if not os.path.exists(os.path.join(REPO, "..", "shared", "models", "passkey-induction-hf")):
    print("SKIP: ../shared/models/passkey-induction-hf not found; passkey e2e not run")
    return 0
  prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
  return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
  sys.exit(main())
