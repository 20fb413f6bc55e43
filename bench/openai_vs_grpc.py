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
  __slots__ = ("ttft", "itls", "e2e", "tokens", "error")

  def __init__(self):
    self.ttft, self.itls, self.e2e, self.tokens, self.error = None, [], None, 0, None


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
         "requests_per_s": len(ok) / wall if wall else 0.0}
  for label, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
    row[label] = {"mean": statistics.fmean(values) if values else float("nan"),
                  **{"p%d" % q: percentile(values, q) for q in (50, 90, 99)}}
  return row


def print_table(rows):
  print("%-7s %5s %4s %9s | %8s %8s %8s | %7s %7s %7s | %8s %8s %8s" %
        ("side", "ok", "err", "out tok/s", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
         "E2E p50", "p90", "p99"))
  for r in rows:
    print("%-7s %5d %4d %9.1f | %8.2f %8.2f %8.2f | %7.3f %7.3f %7.3f | %8.1f %8.1f %8.1f" %
          (r["side"], r["ok"], r["errors"], r["output_tokens_per_s"],
           r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["ttft_ms"]["p99"],
           r["itl_ms"]["p50"], r["itl_ms"]["p90"], r["itl_ms"]["p99"],
           r["e2e_ms"]["p50"], r["e2e_ms"]["p90"], r["e2e_ms"]["p99"]))
    if r["first_error"]:
      print("  first error: %s" % r["first_error"])


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


def start_cluster(args):
  run = tempfile.mkdtemp(prefix="kvwire-openai-bench-")
  cluster = [os.path.join(REPO, "deploy", "local", "cluster.sh")]
  env = dict(os.environ, KVWIRE_PYTHON=sys.executable)
  base = str(args.base_port)
  subprocess.run(cluster + ["start", "--dir", run, "--base-port", base, "--model", args.model,
                            "--build-dir", args.build_dir], check=True, env=env,
                 stdout=subprocess.DEVNULL)
  subprocess.run(cluster + ["wait-ready", "--dir", run, "--timeout", "300"], check=True, env=env,
                 stdout=subprocess.DEVNULL)
  args.openai = "http://127.0.0.1:%d" % (args.base_port + 9)
  args.grpc = "127.0.0.1:%d" % args.base_port

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
    rounds = max(1, args.rounds)
    per_round = (len(prompts) + rounds - 1) // rounds
    for i in range(rounds):
      chunk = prompts[i * per_round:(i + 1) * per_round]
      order = ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc")
      for side in order:
        records, wall = await run_side(send[side], chunk, args)
        results[side] = (results[side][0] + records, results[side][1] + wall)
  return [summarize(side, *results[side]) for side in ("grpc", "openai")]


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
  p.add_argument("--kv-policy", default="")
  p.add_argument("--kv-budget", type=int, default=0)
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--json", default="", help="write the rows to this file")
  p.add_argument("--quick", action="store_true", help="2 clients, 8 requests a side")
  args = p.parse_args()
  if args.quick:
    args.clients, args.requests, args.rounds = 2, 8, 2
  if args.model and not args.model.startswith("synthetic:") and os.path.isdir(args.model):
    args.model = os.path.abspath(args.model)
  args.extra = {}
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
  print("model %s; %d clients, rate %s/s, %d requests a side, %d output tokens each" %
        (args.model, args.clients, args.rate, args.requests, args.max_tokens))
  print_table(rows)
  g, o = rows
  print("front vs gRPC: TTFT p50 %+.1f%% (%+.2f ms), output tokens/s %+.1f%%" % (
      100 * (o["ttft_ms"]["p50"] / g["ttft_ms"]["p50"] - 1), o["ttft_ms"]["p50"] - g["ttft_ms"]["p50"],
      100 * (o["output_tokens_per_s"] / g["output_tokens_per_s"] - 1)))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
