"""What the end-to-end tests share: free ports, process checks, and LocalClusterCase, a test
case that runs deploy/local/cluster.sh in a temporary directory and cleans up after itself
(stopping the cluster, killing stragglers, showing the nodes' logs when a test failed)."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest


def find_nginx():
  """KVWIRE_NGINX if set (as cluster.sh), else nginx on PATH or in /usr/sbin; None if absent."""
  if os.environ.get("KVWIRE_NGINX"):
    return shutil.which(os.environ["KVWIRE_NGINX"])
  return shutil.which("nginx") or shutil.which("/usr/sbin/nginx")


def free_ports(n):
  """n distinct free loopback ports: all bound at once to port 0, then released."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket()
      s.bind(("127.0.0.1", 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def running(pid):
  """Alive and not a zombie (the cluster's processes are not our children, so a dead one
  may linger as a zombie until its new parent reaps it)."""
  try:
    with open("/proc/%d/cmdline" % pid, "rb") as f:
      return bool(f.read())
  except OSError:
    return False


def wait_until(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
    time.sleep(0.05)


def children(pid):
  try:
    with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


def require_binaries(build, extra=()):
  """Raises (an error, not a skip: CI builds them) when a node binary is missing."""
  for path in (os.path.join(build, "decode_service", "kvwire-decode"),
               os.path.join(build, "prefill_service", "kvwire-prefill")) + tuple(extra):
    if not os.access(path, os.X_OK):
      raise RuntimeError("%s not found: run 'bash scripts/build.sh'" % path)


def pick_model(repo, override):
  """The model the cluster serves and up to that many stories prompts for it: `override`
  if given, else the real stories260K model in ../shared, else the synthetic preset (whose
  random weights have no tokenizer-meaningful prompts; callers make their own then)."""
  shared_model = os.path.join(repo, "..", "shared", "models", "stories260K-hf")
  if override:
    model = override
  elif os.path.exists(os.path.join(shared_model, "config.json")):
    model = os.path.abspath(shared_model)
  else:
    model = "synthetic:stories"
  print("model: %s" % model, file=sys.stderr)
  return model


def model_shape(model, cluster_dir):
  """(layers, KV heads, head dim) of the nodes' model: its config.json, or for a synthetic
  model the shape decode-0 printed when it started (in cluster_dir/logs)."""
  if not model.startswith("synthetic:"):
    with open(os.path.join(model, "config.json")) as f:
      c = json.load(f)
    heads = c["num_attention_heads"]
    return (c["num_hidden_layers"], c.get("num_key_value_heads", heads),
            c.get("head_dim", c["hidden_size"] // heads))
  with open(os.path.join(cluster_dir, "logs", "decode-0.log")) as f:
    log = f.read()
  m = re.search(r"(\d+) layers, hidden \d+, \d+/(\d+) heads x (\d+)", log)
  if not m:
    raise AssertionError("decode-0.log does not say the synthetic model's shape:\n" + log)
  return tuple(int(g) for g in m.groups())


def stories_prompts(repo, model, n):
  """The first n prompts of ../shared/data/stories/dev.jsonl for a real model; None when
  the data is absent or the model is synthetic."""
  stories = os.path.join(repo, "..", "shared", "data", "stories", "dev.jsonl")
  if model.startswith("synthetic:") or not os.path.exists(stories):
    return None
  with open(stories) as f:
    return [json.loads(line)["prompt"] for line in f.readlines()[:n]]


class LocalClusterCase(unittest.TestCase):
  """Subclasses set REPO and BUILD, call start_cluster() from setUpClass and
  stop_cluster() from tearDownClass."""

  REPO = BUILD = ""
  failed = False

  @classmethod
  def start_cluster(cls, model, prefix, extra_ports=0, start_args=()):
    """Starts the cluster (the OpenAI front included) on free loopback ports; returns the
    extra free ports asked for."""
    cls.cluster_sh = os.path.join(cls.REPO, "deploy", "local", "cluster.sh")
    cls.tmp = tempfile.mkdtemp(prefix=prefix)
    cls.dir = os.path.join(cls.tmp, "cluster")
    ports = free_ports(10 + extra_ports)
    cls.router_port = ports[0]
    cls.openai_port = ports[9]
    cls.node_ports = {"decode-0": ports[1], "decode-1": ports[2], "prefill-0": ports[3],
                      "prefill-1": ports[4]}
    cls.metrics_ports = {"decode-0": ports[5], "decode-1": ports[6], "prefill-0": ports[7],
                         "prefill-1": ports[8]}
    cls.env = {k: v for k, v in os.environ.items()
               if k not in ("KVWIRE_BASE_PORT", "KVWIRE_MODEL", "KVWIRE_BUILD_DIR")}
    cls.env.update({"KVWIRE_HOST": "127.0.0.1", "KVWIRE_ROUTER_PORT": str(ports[0]),
                    "KVWIRE_OPENAI_PORT": str(ports[9]),
                    "KVWIRE_THREADS": "1", "KVWIRE_NGINX": cls.nginx,
                    "KVWIRE_PYTHON": sys.executable})
    for name in cls.node_ports:
      key = name.upper().replace("-", "")
      cls.env["KVWIRE_%s_PORT" % key] = str(cls.node_ports[name])
      cls.env["KVWIRE_%s_METRICS_PORT" % key] = str(cls.metrics_ports[name])
    cls.pids = {}
    cls.failed = False
    cls.cluster("start", "--model", model, "--build-dir", cls.BUILD, *start_args)
    cls.pids = cls.read_pids()
    return ports[10:]

  @classmethod
  def cluster(cls, *args, check=True):
    r = subprocess.run([cls.cluster_sh, args[0], "--dir", cls.dir] + list(args[1:]),
                       env=cls.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=90)
    if check and r.returncode != 0:
      raise AssertionError("cluster.sh %s failed (exit %d):\n%s" % (args[0], r.returncode,
                                                                    r.stdout))
    return r

  @classmethod
  def read_pids(cls):
    pids = {}
    pid_dir = os.path.join(cls.dir, "pids")
    for name in os.listdir(pid_dir) if os.path.isdir(pid_dir) else []:
      with open(os.path.join(pid_dir, name)) as f:
        pids[name[:-len(".pid")]] = int(f.read())
    return pids

  @classmethod
  def stop_cluster(cls, extra_logs=()):
    """Stops what still runs (SIGKILL for stragglers), prints the logs' tails after a failure
    and keeps the directory then (or with KVWIRE_KEEP_TMP); removes it otherwise."""
    if not hasattr(cls, "dir"):
      return
    pids = dict(cls.read_pids(), **cls.pids)
    if any(running(p) for p in pids.values()):
      subprocess.run([cls.cluster_sh, "stop", "--dir", cls.dir, "--timeout", "10"],
                     env=cls.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for pid in pids.values():
      for p in children(pid) + [pid]:
        if running(p):
          os.kill(p, signal.SIGKILL)
    if cls.failed:
      log_dir = os.path.join(cls.dir, "logs")
      logs = [os.path.join(log_dir, n) for n in sorted(os.listdir(log_dir))] \
          if os.path.isdir(log_dir) else []
      logs += [os.path.join(cls.dir, "router", "logs", "error.log")] + list(extra_logs)
      for path in logs:
        if os.path.exists(path):
          with open(path, errors="replace") as f:
            print("---- %s (last lines)\n%s" % (path, "".join(f.readlines()[-15:])),
                  file=sys.stderr)
    if cls.failed or os.environ.get("KVWIRE_KEEP_TMP"):
      print("kept %s" % cls.tmp, file=sys.stderr)
    else:
      shutil.rmtree(cls.tmp, ignore_errors=True)

  def run(self, result=None):
    # Remembers a failure, so that tearDownClass shows the nodes' logs and keeps them.
    bad = lambda: len(result.failures) + len(result.errors) if result else 0
    before = bad()
    outcome = super().run(result)
    if bad() > before:
      type(self).failed = True
    return outcome
