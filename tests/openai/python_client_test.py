#!/usr/bin/env python3
"""The kvwire Python client package (clients/python):

  (a) `pip install ./clients/python` into a fresh virtual environment (offline: no build
      isolation, no dependencies; grpcio and protobuf are Debian's, seen through
      --system-site-packages) generates the gRPC stubs at build time: the installed package
      imports kvwire.v1 from its own folder, away from the source tree;
  (b) the installed package's blocking and asyncio clients, against a real decode node (the
      tiny model, prefilling locally): the same greedy text, typed results with the figures,
      a stream left early cancels its call, an invalid field is GenerationError
      INVALID_ARGUMENT;
  (c) tools/kvwire_client.py, now a command line over the package, keeps its output.

Prints SKIP when the Python has no venv module or pip (Debian: python3-venv).

usage: python_client_test.py --repo-root DIR --build-dir DIR
"""
import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

REPO = BUILD = ""

CHECK = r"""
import asyncio, json, os, sys
import kvwire
from kvwire.v1 import generation_pb2
target = sys.argv[1]
out = {"file": kvwire.__file__, "stubs": generation_pb2.__file__}
with kvwire.Client(target, timeout=60) as c:
  r = c.generate("Once upon a time", max_tokens=12, temperature=0.0, policy="full")
  out["sync"] = {"text": r.text, "finish": r.finish_reason, "completion": r.completion_tokens,
                 "full": r.stats.full_cache_bytes, "wire": r.stats.wire_bytes,
                 "ratio": r.stats.compression_ratio, "ttft": r.stats.ttft_ms,
                 "type": type(r.stats).__name__}
  chunks = []
  for ch in c.stream("Once upon a time", max_tokens=12, temperature=0.0, policy="full"):
    chunks.append(ch)
  out["streamed"] = "".join(ch.text for ch in chunks)
  out["final_last"] = chunks[-1].final is not None
  try:
    c.generate("x", max_tokens=2, attention_mode="no-such-mode")
  except kvwire.GenerationError as e:
    out["error"] = e.code
  it = c.stream("Once upon a time", max_tokens=400, ignore_eos=True)
  next(it)
  it.close()  # leaves early: the call is cancelled
async def run():
  async with kvwire.AsyncClient(target, timeout=60) as a:
    r = await a.generate("Once upon a time", max_tokens=12, temperature=0.0, policy="full")
    text = []
    async for ch in a.stream("Once upon a time", max_tokens=12, temperature=0.0, policy="full"):
      text.append(ch.text)
    return r.text, "".join(text)
out["async"], out["async_streamed"] = asyncio.run(run())
print(json.dumps(out))
"""


class PythonClientPackageTest(unittest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.tmp = tempfile.mkdtemp(prefix="kvwire-pyclient-")
    cls.venv = os.path.join(cls.tmp, "venv")
    r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", cls.venv],
                       capture_output=True, text=True, check=False)
    cls.py = os.path.join(cls.venv, "bin", "python")
    if r.returncode != 0 or subprocess.run([cls.py, "-m", "pip", "--version"],
                                           capture_output=True, check=False).returncode:
      shutil.rmtree(cls.tmp, ignore_errors=True)
      raise unittest.SkipTest("SKIP: %s cannot make a virtual environment with pip (Debian: "
                              "python3-venv): %s" % (sys.executable, r.stderr.strip()))
    cls.decode = None

  @classmethod
  def tearDownClass(cls):
    if cls.decode is not None:
      cls.decode.terminate()
      cls.decode.wait(timeout=30)
    shutil.rmtree(cls.tmp, ignore_errors=True)

  def start_decode_node(self):
    binary = os.path.join(BUILD, "decode_service", "kvwire-decode")
    if not os.access(binary, os.X_OK):
      raise RuntimeError("%s not found: run 'bash scripts/build.sh'" % binary)
    model = os.path.join(REPO, "..", "shared", "models", "stories260K-hf")
    model = os.path.abspath(model) if os.path.exists(os.path.join(model, "config.json")) \
        else "synthetic:stories"
    log = open(os.path.join(self.tmp, "decode.log"), "w+")
    # Every prompt prefills on the node itself: no prefill node is needed (nor reached).
    cls = type(self)
    cls.decode = subprocess.Popen(
        [binary, "--model", model, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
         "--prefill", "ipv4:127.0.0.1:1", "--local-prefill-below", "1000000", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      log.seek(0)
      m = re.search(r"on port (\d+), metrics on port (\d+)", log.read())
      if m:
        return "127.0.0.1:%s" % m.group(1)
      if cls.decode.poll() is not None:
        break
      time.sleep(0.1)
    log.seek(0)
    raise AssertionError("the decode node did not start:\n" + log.read())

  def test_install_and_use(self):
    r = subprocess.run([self.py, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--no-build-isolation", "--disable-pip-version-check",
                        os.path.join(REPO, "clients", "python")],
                       capture_output=True, text=True, cwd=self.tmp, check=False)
    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
    # What the build leaves in the source tree (setuptools' build/ and egg-info) is ignored.
    status = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "clients/python"],
                            capture_output=True, text=True, check=False)
    self.assertNotIn("??", status.stdout, "pip left untracked files in clients/python")

    target = self.start_decode_node()
    r = subprocess.run([self.py, "-c", CHECK, target], capture_output=True, text=True,
                       cwd=self.tmp, timeout=120, check=False)
    self.assertEqual(r.returncode, 0, r.stderr)
    out = json.loads(r.stdout)
    site = os.path.join(self.venv, "lib")
    self.assertTrue(out["file"].startswith(site), out["file"])
    self.assertTrue(out["stubs"].startswith(site), out["stubs"])
    s = out["sync"]
    self.assertEqual(s["type"], "Stats")
    self.assertEqual(s["completion"], 12)
    self.assertEqual(s["finish"], "length")
    self.assertGreater(s["full"], 0)
    self.assertEqual(s["wire"], 0)  # prefilled on the node: nothing crossed a wire
    self.assertTrue(math.isnan(s["ratio"]))
    self.assertGreater(s["ttft"], 0)
    self.assertTrue(s["text"])
    self.assertEqual(out["streamed"], s["text"])
    self.assertTrue(out["final_last"])
    self.assertEqual(out["error"], "INVALID_ARGUMENT")
    self.assertEqual(out["async"], s["text"])
    self.assertEqual(out["async_streamed"], s["text"])

    # The command line keeps its flags and output.
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "kvwire_client.py"),
                        "--target", target, "--json", "--max-tokens", "12", "--policy", "full",
                        "--stubs", os.path.join(BUILD, "python")],
                       capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(r.returncode, 0, r.stderr)
    row = json.loads(r.stdout)
    self.assertEqual(row["text"], s["text"])
    self.assertEqual(row["finish_reason"], "FINISH_REASON_LENGTH")
    for key in ("full_cache_bytes", "wire_bytes", "ttft_ms", "mean_itl_ms", "policy",
                "client_ttft_ms", "token_ids", "kept_tokens"):
      self.assertIn(key, row)


def main():
  global REPO, BUILD
  p = argparse.ArgumentParser()
  p.add_argument("--repo-root", required=True)
  p.add_argument("--build-dir", required=True)
  args, rest = p.parse_known_args()
  REPO, BUILD = os.path.abspath(args.repo_root), os.path.abspath(args.build_dir)
  unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
  main()
