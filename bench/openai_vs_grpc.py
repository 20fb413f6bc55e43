#!/usr/bin/env python3
"""The OpenAI-compatible front against direct gRPC, in the shape of the serving benchmarks
(vLLM's benchmark_serving, genai-perf): N concurrent clients sending requests at a rate
(Poisson arrivals; inf: each client sends its next request when the last one ends), streamed,
measuring per request the time to first token (TTFT), the inter-token latency (ITL, between
consecutive streamed chunks) and the end-to-end latency (E2E), with p50/p90/p99 and output
tokens/s. The same prompts go once over HTTP to the front (POST /v1/completions, stream: true,
raw SSE with aiohttp, as benchmark_serving does) and once over gRPC Generate to the router
(the kvwire package's asyncio client), interleaved in rounds so that both see the same
machine; the front then calls the same router, so the difference is the front's cost.

  # starts a local cluster (deploy/local/cluster.sh) with the model, runs, stops it:
  python3 bench/openai_vs_grpc.py --start-cluster --model ../shared/models/stories260K-hf \\
      --clients 8 --requests 200 --max-tokens 32
  # against a running cluster:
  python3 bench/openai_vs_grpc.py --openai http://127.0.0.1:8000 --grpc 127.0.0.1:8080

--quick: 2 clients, 8 requests a side (a smoke run). Figures: docs/openai.md."""
import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, ".."))


def percentile(values, q):
  if not values:
    return float("nan")
  values = sorted(values)
  k = (len(values) - 1) * q / 100.0
  lo, hi = int(k), min(int(k) + 1, len(values) - 1)
  return values[lo] + (values[hi] - values[lo]) * (k - lo)


class Record:
  __slots__ = ("ttft", "itls", "e2e", "tokens", "chunks", "error")

  def __init__(self):
    self.ttft, self.itls, self.e2e, self.tokens, self.chunks, self.error = \
        None, [], None, 0, 0, None


async def http_request(session, url, model, prompt, args):
  rec = Record()
  body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
          "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
  body.update(args.extra)
  start = time.perf_counter()
  last = None
  try:
    async with session.post(url + "/v1/completions", json=body) as resp:
      if resp.status != 200:
        rec.error = "HTTP %d: %s" % (resp.status, (await resp.text())[:200])
        return rec
      buf = b""
      async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
          event, buf = buf.split(b"\n\n", 1)
          if not event.startswith(b"data: "):
            continue
          payload = event[6:]
          if payload == b"[DONE]":
            continue
          msg = json.loads(payload)
          if "error" in msg:
            rec.error = msg["error"]["message"]
            continue
          now = time.perf_counter()
          # A token chunk (its text may be empty: part of a UTF-8 character, or random
          # weights' bytes), not the finishing one.
          if msg.get("choices") and msg["choices"][0].get("finish_reason") is None:
            rec.chunks += 1
            if rec.ttft is None:
              rec.ttft = now - start
            else:
              rec.itls.append(now - last)
            last = now
          if msg.get("usage"):
            rec.tokens = msg["usage"]["completion_tokens"]
  except Exception as e:  # pylint: disable=broad-except
    rec.error = repr(e)
  rec.e2e = time.perf_counter() - start
  return rec


async def grpc_request(client, kvwire, prompt, args):
  rec = Record()
  params = kvwire.GenerateParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                 policy=args.extra.get("kv_policy", ""),
                                 budget=args.extra.get("kv_budget"))
  start = time.perf_counter()
  last = None
  try:
    async for chunk in client.stream(prompt, params):
      now = time.perf_counter()
      if chunk.token_ids:
        rec.chunks += 1
        if rec.ttft is None:
          rec.ttft = now - start
        else:
          rec.itls.append(now - last)
        last = now
      if chunk.final is not None:
        rec.tokens = chunk.final.completion_tokens
  except kvwire.GenerationError as e:
    rec.error = "%s: %s" % (e.code, e.details)
  rec.e2e = time.perf_counter() - start
  return rec


async def run_side(send, prompts, args):
  """Sends every prompt with `send(prompt)`, at most args.clients at once, arrivals at
  args.rate per second (Poisson) or back to back; returns (records, wall seconds)."""
  sem = asyncio.Semaphore(args.clients)
  rng = random.Random(args.seed)
  records = []

  async def one(prompt):
    async with sem:
      records.append(await send(prompt))

  start = time.perf_counter()
  tasks = []
  for prompt in prompts:
    tasks.append(asyncio.ensure_future(one(prompt)))
    if args.rate != float("inf"):
      await asyncio.sleep(rng.expovariate(args.rate))
  await asyncio.gather(*tasks)
  return records, time.perf_counter() - start


def summarize(name, records, wall):
  ok = [r for r in records if r.error is None and r.ttft is not None]
  errors = [r.error for r in records if r.error is not None]
  ttft = [1e3 * r.ttft for r in ok]
  itl = [1e3 * x for r in ok for x in r.itls]
  e2e = [1e3 * r.e2e for r in ok]
  tokens = sum(r.tokens for r in ok)
  row = {"side": name, "requests": len(records), "ok": len(ok), "errors": len(errors),
         "first_error": errors[0] if errors else None, "wall_s": wall,
         "output_tokens_per_s": tokens / wall if wall else 0.0,
         "chunks_per_request": statistics.fmean(r.chunks for r in ok) if ok else float("nan"),
         "requests_per_s": len(ok) / wall if wall else 0.0}
  for label, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
    row[label] = {"mean": statistics.fmean(values) if values else float("nan"),
                  **{"p%d" % q: percentile(values, q) for q in (50, 90, 99)}}
  return row


def print_table(rows):
  print("%-7s %5s %4s %9s %6s | %8s %8s %8s | %7s %7s %7s | %8s %8s %8s" %
        ("side", "ok", "err", "out tok/s", "chunks", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
         "E2E p50", "p90", "p99"))
  for r in rows:
    print("%-7s %5d %4d %9.1f %6.1f | %8.2f %8.2f %8.2f | %7.3f %7.3f %7.3f | %8.1f %8.1f %8.1f" %
          (r["side"], r["ok"], r["errors"], r["output_tokens_per_s"], r["chunks_per_request"],
           r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["ttft_ms"]["p99"],
           r["itl_ms"]["p50"], r["itl_ms"]["p90"], r["itl_ms"]["p99"],
           r["e2e_ms"]["p50"], r["e2e_ms"]["p90"], r["e2e_ms"]["p99"]))
    if r["first_error"]:
      print("  first error: %s" % r["first_error"])
  names = sorted({k for r in rows for k in r["cpu_ms_per_request"]})
  print("CPU ms per request: " + ", ".join(
      "%s %s" % (k, "/".join("%.2f" % r["cpu_ms_per_request"].get(k, 0.0) for r in rows))
      for k in names) + "  (%s)" % "/".join(r["side"] for r in rows))


def load_prompts(args):
  data = args.data or os.path.join(REPO, "..", "shared", "data", "stories", "dev.jsonl")
  prompts = []
  if os.path.exists(data) and not args.model.startswith("synthetic:"):
    with open(data) as f:
      prompts = [json.loads(line)["prompt"] for line in f]
  if not prompts:
    base = "The little dog ran to the park with his ball and played all day. "
    prompts = [(base * 40)[i:i + args.prompt_chars] for i in range(50)]
  rng = random.Random(args.seed)
  return [prompts[rng.randrange(len(prompts))] for _ in range(args.requests)]


CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid):
  """User + system CPU seconds of a process (/proc/PID/stat), 0 when it is gone."""
  try:
    with open("/proc/%d/stat" % pid) as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return 0.0
  return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cluster_pids(run_dir):
  """{pid: name} of the cluster's processes (deploy/local/cluster.sh's pid files), nginx's
  workers included under its master's name, "router"."""
  pids = {}
  pid_dir = os.path.join(run_dir, "pids")
  for name in sorted(os.listdir(pid_dir)):
    with open(os.path.join(pid_dir, name)) as f:
      pids[int(f.read().strip())] = name[:-len(".pid")]
  routers = {pid for pid, name in pids.items() if name == "router"}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open("/proc/%s/stat" % entry) as f:
          parent = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, ValueError, IndexError):
        continue
      if parent in routers:
        pids[int(entry)] = "router"
  return pids


def cluster_cpu_s(run_dir):
  """CPU seconds so far of each cluster process (nginx's workers with its master, as
  "router") and of this benchmark ("client")."""
  cpu = {"client": sum(os.times()[:2])}
  if not run_dir:
    return cpu
  for pid, name in cluster_pids(run_dir).items():
    cpu[name] = cpu.get(name, 0.0) + process_cpu_s(pid)
  return cpu


def parse_cpus(value):
  """A Linux CPU list ("1", "0,2", "2-3") as a set of CPU numbers."""
  cpus = set()
  try:
    for part in value.split(","):
      lo, _, hi = part.partition("-")
      cpus.update(range(int(lo), int(hi or lo) + 1))
  except ValueError:
    raise argparse.ArgumentTypeError("expected a CPU list like 1 or 0,2 or 2-3, got '%s'" %
                                     value) from None
  if not cpus or not cpus <= os.sched_getaffinity(0):
    raise argparse.ArgumentTypeError("CPUs %s are not all available here (%s)" % (
        value, sorted(os.sched_getaffinity(0))))
  return cpus


def pin(run_dir, node_cpus, front_cpus):
  """Every thread of the nodes and the router to `node_cpus`; the front's and this
  benchmark's to `front_cpus`: the front's work then takes nothing from the nodes, as when it
  runs in its own pod."""
  def set_affinity(pid, cpus):
    for task in os.listdir("/proc/%d/task" % pid):
      os.sched_setaffinity(int(task), cpus)

  for pid, name in cluster_pids(run_dir).items():
    set_affinity(pid, front_cpus if name == "openai" else node_cpus)
  set_affinity(os.getpid(), front_cpus)


def start_cluster(args):
  run = tempfile.mkdtemp(prefix="kvwire-openai-bench-")
  args.run_dir = run
  cluster = [os.path.join(REPO, "deploy", "local", "cluster.sh")]
  env = dict(os.environ, KVWIRE_PYTHON=sys.executable)
  overrides = ["--set", "DECODE_STREAM_INTERVAL=%d" % args.stream_interval] \
      if args.stream_interval else []
  base = str(args.base_port)
  subprocess.run(cluster + ["start", "--dir", run, "--base-port", base, "--model", args.model,
                            "--build-dir", args.build_dir] + overrides, check=True, env=env,
                 stdout=subprocess.DEVNULL)
  subprocess.run(cluster + ["wait-ready", "--dir", run, "--timeout", "300"], check=True, env=env,
                 stdout=subprocess.DEVNULL)
  args.openai = "http://127.0.0.1:%d" % (args.base_port + 9)
  args.grpc = "127.0.0.1:%d" % args.base_port

  if args.node_cpus:
    pin(run, args.node_cpus, args.front_cpus)

  def stop():
    subprocess.run(cluster + ["stop", "--dir", run], env=env, stdout=subprocess.DEVNULL,
                   check=False)
  return stop


async def bench(args, kvwire):
  import aiohttp  # pylint: disable=import-outside-toplevel
  prompts = load_prompts(args)
  connector = aiohttp.TCPConnector(limit=0)
  timeout = aiohttp.ClientTimeout(total=600)
  async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
      kvwire.AsyncClient(args.grpc, timeout=600) as client:
    async with session.get(args.openai + "/v1/models") as r:
      model = (await r.json())["data"][0]["id"]
    send = {"openai": lambda p: http_request(session, args.openai, model, p, args),
            "grpc": lambda p: grpc_request(client, kvwire, p, args)}
    # Warm both paths (connections, the model's pages), then alternate rounds.
    for side in ("grpc", "openai"):
      await run_side(send[side], prompts[:max(2, args.clients)], args)
    results = {"grpc": ([], 0.0), "openai": ([], 0.0)}
    per_round = []  # (round, side, records, wall) of each run, for the ratios of each round
    cpu = {"grpc": {}, "openai": {}}
    rounds = max(1, args.rounds)
    size = (len(prompts) + rounds - 1) // rounds
    for i in range(rounds):
      chunk = prompts[i * size:(i + 1) * size]
      order = ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc")
      for side in order:
        before = cluster_cpu_s(args.run_dir)
        records, wall = await run_side(send[side], chunk, args)
        after = cluster_cpu_s(args.run_dir)
        results[side] = (results[side][0] + records, results[side][1] + wall)
        per_round.append((i, side, records, wall))
        for name, seconds in after.items():
          cpu[side][name] = cpu[side].get(name, 0.0) + seconds - before.get(name, 0.0)
  rows = [summarize(side, *results[side]) for side in ("grpc", "openai")]
  # Each round's front ÷ gRPC ratios: their spread says how much of the difference is noise.
  by_round = {}
  for i, side, records, wall in per_round:
    by_round.setdefault(i, {})[side] = summarize(side, records, wall)
  rows[1]["round_ratios"] = [
      {"ttft_p50": r["openai"]["ttft_ms"]["p50"] / r["grpc"]["ttft_ms"]["p50"],
       "output_tokens_per_s": r["openai"]["output_tokens_per_s"] /
                              r["grpc"]["output_tokens_per_s"]}
      for _, r in sorted(by_round.items())]
  for row in rows:
    n = max(1, row["requests"])
    row["cpu_ms_per_request"] = {k: 1e3 * v / n for k, v in sorted(cpu[row["side"]].items())}
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--openai", default="http://127.0.0.1:8000", help="the front's base URL")
  p.add_argument("--grpc", default="127.0.0.1:8080", help="the router (or a decode node)")
  p.add_argument("--start-cluster", action="store_true",
                 help="start deploy/local/cluster.sh with --model, and stop it at the end")
  p.add_argument("--model", default=os.path.join(REPO, "..", "shared", "models",
                                                 "stories260K-hf"))
  p.add_argument("--build-dir", default=os.path.join(REPO, "build"))
  p.add_argument("--base-port", type=int, default=18600)
  p.add_argument("--clients", type=int, default=8, help="concurrent requests at most")
  p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (Poisson)")
  p.add_argument("--requests", type=int, default=200, help="requests per side")
  p.add_argument("--rounds", type=int, default=4, help="alternating rounds per side")
  p.add_argument("--max-tokens", type=int, default=32)
  p.add_argument("--prompt-chars", type=int, default=800, help="synthetic models' prompts")
  p.add_argument("--data", default="", help="JSONL with a prompt field")
  p.add_argument("--stream-interval", type=int, default=0,
                 help="with --start-cluster: the decode nodes' --stream-interval (default: "
                      "node-flags.env's)")
  p.add_argument("--node-cpus", type=parse_cpus, default=None,
                 help="with --start-cluster: run the nodes and the router on these CPUs and "
                      "the front and this client on --front-cpus (the front in its own pod)")
  p.add_argument("--front-cpus", type=parse_cpus, default=None)
  p.add_argument("--kv-policy", default="")
  p.add_argument("--kv-budget", type=int, default=0)
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--json", default="", help="write the rows to this file")
  p.add_argument("--quick", action="store_true", help="2 clients, 8 requests a side")
  args = p.parse_args()
  if args.stream_interval and not args.start_cluster:
    p.error("--stream-interval applies to a cluster this script starts (--start-cluster)")
  if (args.node_cpus is None) != (args.front_cpus is None) or \
      (args.node_cpus and not args.start_cluster):
    p.error("--node-cpus and --front-cpus go together, with --start-cluster")
  if args.node_cpus and args.node_cpus & args.front_cpus:
    p.error("--node-cpus and --front-cpus overlap")
  if args.quick:
    args.clients, args.requests, args.rounds = 2, 8, 2
  if args.model and not args.model.startswith("synthetic:") and os.path.isdir(args.model):
    args.model = os.path.abspath(args.model)
  args.extra = {}
  args.run_dir = ""  # the cluster's, when this script starts it: CPU per process
  if args.kv_policy:
    args.extra["kv_policy"] = args.kv_policy
  if args.kv_budget:
    args.extra["kv_budget"] = args.kv_budget
  sys.path.insert(0, os.path.join(REPO, "tools"))
  from kvwire_client import import_kvwire  # pylint: disable=import-outside-toplevel
  kvwire = import_kvwire(os.path.join(args.build_dir, "python"), os.path.join(REPO, "proto"))
  stop = start_cluster(args) if args.start_cluster else None
  try:
    rows = asyncio.run(bench(args, kvwire))
  finally:
    if stop:
      stop()
  print("model %s; %d clients, rate %s/s, %d requests a side, %d output tokens each%s" %
        (args.model, args.clients, args.rate, args.requests, args.max_tokens,
         "; nodes on CPUs %s, the front and the client on %s" % (
             sorted(args.node_cpus), sorted(args.front_cpus)) if args.node_cpus else ""))
  print_table(rows)
  g, o = rows
  print("front vs gRPC: TTFT p50 %+.1f%% (%+.2f ms), output tokens/s %+.1f%%" % (
      100 * (o["ttft_ms"]["p50"] / g["ttft_ms"]["p50"] - 1), o["ttft_ms"]["p50"] - g["ttft_ms"]["p50"],
      100 * (o["output_tokens_per_s"] / g["output_tokens_per_s"] - 1)))
  ratios = o.get("round_ratios", [])
  if len(ratios) > 1:
    for key, label in (("ttft_p50", "TTFT p50"), ("output_tokens_per_s", "output tokens/s")):
      values = sorted(100 * (r[key] - 1) for r in ratios)
      print("  per round (%d): %s median %+.1f%%, range %+.1f%% .. %+.1f%%" % (
          len(values), label, statistics.median(values), values[0], values[-1]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
