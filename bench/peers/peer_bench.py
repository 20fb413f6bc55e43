#!/usr/bin/env python3
"""kvwire against llama.cpp on the same weights, the same token ids and the same threads.

Models (made once under --out by make_models.py): a random Llama of the 1B class (bf16) and
stories260K (f32), each as a Hugging Face folder for kvwire and as GGUF for llama.cpp.

Greedy ids must agree between the engines (and, for stories260K, with REFERENCE.json): the first
round's ids are compared before the other rounds run, and when no llama.cpp configuration agrees
with kvwire on the first --min-agree ids after each model's shortest prompt, the conversion is
wrong and the run stops (a conversion error shows at once, in every configuration; later
differences, or one configuration's alone, are rounding, and are reported). After the longer
prompts the agreement is reported only: there the engines round differently (llama.cpp's f16
K/V, with flash attention its f16 accumulator; the orders of long sums), and a random model's
near-tied logits let the ids part within a few tokens. So that the check can be trusted,
stories260K is also converted without the Q/K row interleave (the wrong RoPE layout for
llama.cpp), which must disagree within those ids.

Then each measurement runs --runs times with the engines interleaved (the order reversed every
other round). llama.cpp runs in four configurations: flash attention on and off (its default,
"auto", is on for the CPU, and which is faster depends on the model and context), each with the
GGUF memory-mapped (its default) and read into its own buffers (kvwire copies its weights into
huge-page buffers at load); each row compares kvwire with the fastest of their medians. Ratios are speeds: llama.cpp's time over kvwire's,
> 1 when kvwire is faster. The table goes to stdout; every run's times and ids to a JSON file
under --out.

kvwire is timed by `kvwire timing` (a process per run, after an untimed warm-up that pages the
weights in); llama.cpp through llama-cpp-python's C API in this process, after one untimed run:
llama_decode of the whole prompt, then one llama_decode per token, each token picked by a greedy
sampler in C. Run it through bench/peers/run.sh, which builds the environment.
"""
import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata

import numpy as np

import make_models

# (prompt tokens, decode steps) per model: a run with decode steps measures its prefill and
# the decode after it, at a context of the prompt's length.
CASES_1B = [(16, 64), (512, 0), (2000, 64)]
# stories260K has a 512-token context: the long case is 447 + 64 (+ 1, the last id, unfed).
CASES_STORIES = [(16, 64), (256, 0), (447, 64)]

_QUIET_LOG = None  # llama.cpp's log callback: one for the process, never freed


def log(msg):
  print(msg, file=sys.stderr, flush=True)


class Kvwire:
  """`kvwire timing` on a model folder, one process per run."""

  def __init__(self, binary, model_dir, threads):
    self.binary, self.model_dir, self.threads = binary, model_dir, threads

  def run(self, ids, steps):
    cmd = [self.binary, "timing", "--model", self.model_dir, "--threads", str(self.threads),
           "--prompt-ids", ",".join(map(str, ids)), "--decode", str(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
      raise RuntimeError(f"kvwire timing failed ({p.returncode}): {p.stderr.strip()}")
    r = json.loads(p.stdout)["runs"][0]
    return r["prefill_seconds"], r["decode_seconds"], r["ids"]


class LlamaCppModel:
  """A GGUF loaded by llama.cpp: memory-mapped (its default) or read into its own buffers."""

  def __init__(self, gguf_path, use_mmap=True):
    import llama_cpp as lc  # pylint: disable=import-outside-toplevel
    global _QUIET_LOG  # pylint: disable=global-statement
    if _QUIET_LOG is None:
      _QUIET_LOG = lc.llama_log_callback(lambda level, text, user: None)
      lc.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
      lc.llama_backend_init()
    self.lc = lc
    mp = lc.llama_model_default_params()
    mp.use_mmap = use_mmap
    self.model = lc.llama_model_load_from_file(gguf_path.encode(), mp)
    if not self.model:
      raise RuntimeError(f"llama.cpp could not load {gguf_path}")

  def close(self):
    self.lc.llama_model_free(self.model)


class LlamaCpp:
  """A llama.cpp context on a loaded model, with a greedy sampler."""

  def __init__(self, model, threads, n_ctx, flash_attn, mmap="on"):
    lc = self.lc = model.lc
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = max(2048, n_ctx)  # the whole prompt in one llama_decode (n_ubatch: default)
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.flash_attn_type = {"on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
    self.params = {k: getattr(cp, k) for k in ("n_ctx", "n_batch", "n_ubatch", "n_threads",
                                               "n_threads_batch", "type_k", "type_v")}
    self.params["flash_attn"] = flash_attn
    self.params["mmap"] = mmap
    self.ctx = lc.llama_init_from_model(model.model, cp)
    if not self.ctx:
      raise RuntimeError("llama.cpp could not create a context")
    self.sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_greedy())

  def decode(self, arr, n):
    rc = self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(arr, n))
    if rc != 0:
      raise RuntimeError(f"llama_decode returned {rc}")

  def run(self, ids, steps):
    lc = self.lc
    lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
    prompt = (lc.llama_token * len(ids))(*ids)
    one = (lc.llama_token * 1)()
    t0 = time.perf_counter()
    self.decode(prompt, len(ids))
    tok = lc.llama_sampler_sample(self.sampler, self.ctx, -1)
    t1 = time.perf_counter()
    out = [tok]
    for _ in range(steps):
      one[0] = tok
      self.decode(one, 1)
      tok = lc.llama_sampler_sample(self.sampler, self.ctx, -1)
      out.append(tok)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, [int(t) for t in out]

  def close(self):
    self.lc.llama_sampler_free(self.sampler)
    self.lc.llama_free(self.ctx)


def agreement(a, b):
  """How many leading ids agree."""
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def random_prompt(rng, n, vocab):
  """BOS, then ids drawn uniformly from the vocabulary past the special tokens."""
  return [1] + [int(x) for x in rng.integers(3, vocab, size=n - 1)]


def check_greedy(label, got, min_agree, reference=None, enforce=True):
  """Compares greedy ids {engine: ids} with kvwire's (and a reference's, if given); exits when
  no llama.cpp configuration agrees on the first min_agree ids (a conversion error shows in
  all of them; one configuration's numerics may differ alone), unless enforce is false (then
  the agreement is only reported). Returns a record for the JSON."""
  of = len(got["kvwire"])
  want = min(min_agree, of)
  rec = {"label": label, "of": of, "ids": got, "enforced": enforce,
         "agree": {e: agreement(got["kvwire"], got[e]) for e in got if e != "kvwire"}}
  parts = [f"{e} {n}" for e, n in rec["agree"].items()]
  bad = enforce and max(rec["agree"].values()) < want
  if reference is not None:
    rec["reference"] = reference
    rec["against_reference"] = {e: agreement(got[e], reference) for e in got}
    parts += [f"{e} {n} with REFERENCE.json" for e, n in rec["against_reference"].items()]
    bad = bad or rec["against_reference"]["kvwire"] < want
  line = f"greedy {label}: of {of} ids, kvwire agrees with " + ", ".join(parts)
  if not enforce:
    line += " (reported, not checked)"
  log(line)
  if bad:
    detail = "\n".join(f"  {e:<16} {v}" for e, v in got.items())
    raise SystemExit(f"FAIL: {line}\n{detail}\n(an early difference means the GGUF conversion "
                     "is wrong: tensor layout, Q/K row order, or metadata)")
  return rec


def check_layout_error_is_caught(out, stories_dir, threads, ref, min_agree):
  """The greedy check has teeth: stories260K converted without the Q/K row interleave (the
  wrong RoPE layout for llama.cpp) must disagree with the reference within min_agree ids."""
  wrong = os.path.join(out, "models", "stories260K.no-interleave.gguf")
  make_models.convert_hf_folder(stories_dir, wrong, "stories260K-wrong", interleave=False)
  model = LlamaCppModel(wrong)
  engine = LlamaCpp(model, threads, 512, "off")
  ids = engine.run(ref["prompt_ids"], len(ref["ids"]) - 1)[2]
  engine.close()
  model.close()
  n = agreement(ids, ref["ids"])
  log(f"layout check: without the Q/K interleave, llama.cpp agrees with REFERENCE.json on "
      f"{n} of {len(ref['ids'])} ids")
  if n >= min_agree:
    raise SystemExit(f"FAIL: a GGUF without the Q/K interleave agrees with the reference on "
                     f"{n} ids (--min-agree is {min_agree}): the greedy check would not see a "
                     "layout error")
  return {"label": "no Q/K interleave (deliberately wrong) vs REFERENCE.json", "agree": n,
          "of": len(ref["ids"])}


def measure(label, engines, cases, prompts, runs, after_first_round):
  """Interleaved runs: {"N+S": {engine: [{prefill_seconds, decode_seconds, ids}, ...]}}.
  after_first_round(raw) checks the ids before the other rounds are spent."""
  raw = {}
  names = list(engines)
  for r in range(runs):
    for (n, steps) in cases:
      for e in (names if r % 2 == 0 else names[::-1]):
        p, d, ids = engines[e].run(prompts[n], steps)
        raw.setdefault(f"{n}+{steps}", {}).setdefault(e, []).append(
            {"prefill_seconds": p, "decode_seconds": d, "ids": ids})
    log(f"{label}: round {r + 1}/{runs} done")
    if r == 0:
      after_first_round(raw)
  return raw


def summarise(model, threads, cases, raw):
  """A row per measurement: kvwire's median against the faster llama.cpp configuration's."""
  rows = []
  for (n, steps) in cases:
    runs = raw[f"{n}+{steps}"]
    parts = [("prefill_seconds", f"prefill {n}", n)]
    if steps:
      parts.append(("decode_seconds", f"decode @{n} ({steps} tok)", steps))
    for key, what, tokens in parts:
      med = {e: statistics.median(x[key] for x in runs[e]) for e in runs}
      llama = min((e for e in med if e != "kvwire"), key=lambda e: med[e])
      rows.append({
          "model": model, "threads": threads, "what": what, "tokens": tokens,
          "kvwire_s": med["kvwire"], "llama_s": med[llama], "llama_config": llama,
          "medians_s": med, "kvwire_tok_s": tokens / med["kvwire"],
          "llama_tok_s": tokens / med[llama],
          "ratio": med[llama] / med["kvwire"],  # a speed ratio: > 1 means kvwire is faster
      })
  return rows


def print_table(rows, runs, configs):
  print(f"\nkvwire ÷ llama.cpp (speed; > 1: kvwire faster), medians of {runs} interleaved runs; "
        f"llama.cpp: the faster of {', '.join(configs)} per row")
  head = (f"{'model':<16} {'thr':>3}  {'measurement':<22} {'kvwire tok/s':>12} "
          f"{'llama.cpp tok/s':>15}  {'(config)':<16} {'ratio':>6}")
  print(head)
  print("-" * len(head))
  for r in rows:
    config = r["llama_config"].replace("llama.cpp ", "")
    print(f"{r['model']:<16} {r['threads']:>3}  {r['what']:<22} {r['kvwire_tok_s']:>12.1f} "
          f"{r['llama_tok_s']:>15.1f}  {config:<16} {r['ratio']:>6.2f}")


def ensure_models(out, stories_dir, skip_1b):
  models = os.path.join(out, "models")
  os.makedirs(models, exist_ok=True)
  made = {}
  if not skip_1b:
    hf = os.path.join(models, "random-llama-1b")
    gg = os.path.join(models, "random-llama-1b.bf16.gguf")
    stamp = os.path.join(models, "random-llama-1b.done")
    if not os.path.exists(stamp):
      log("making the random 1B model (bf16 safetensors and GGUF, 2 GB each)...")
      t = time.time()
      make_models.make_random_llama(hf, gg)
      with open(stamp, "w", encoding="utf-8") as f:
        f.write("made by make_models.make_random_llama, seed 1234\n")
      log(f"  done in {time.time() - t:.0f} s")
    made["random-llama-1b"] = (hf, gg)
  if stories_dir:
    gg = os.path.join(models, "stories260K.f32.gguf")
    make_models.convert_hf_folder(stories_dir, gg, "stories260K")
    made["stories260K"] = (stories_dir, gg)
  return made


def main():
  here = os.path.dirname(os.path.abspath(__file__))
  repo = os.path.dirname(os.path.dirname(here))
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--kvwire", default=os.path.join(repo, "build", "tools", "kvwire"))
  p.add_argument("--out", default=os.path.join(repo, "build", "peers"))
  p.add_argument("--stories",
                 default=os.path.join(repo, "..", "shared", "models", "stories260K-hf"))
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--threads", type=int, default=2, help="both engines' threads, 1B model")
  p.add_argument("--stories-threads", default="1,2", help="stories260K's thread counts")
  p.add_argument("--flash-attn", default="on,off",
                 help="llama.cpp configurations to run: flash attention on, off, or both")
  p.add_argument("--llama-mmap", default="on,off",
                 help="llama.cpp configurations to run: weights memory-mapped from the GGUF "
                 "(on, its default), read into its own buffers (off, as kvwire copies them), "
                 "or both")
  p.add_argument("--min-agree", type=int, default=8,
                 help="leading greedy ids that must agree after each model's shortest prompt "
                 "and stories260K from BOS (fewer fails the run)")
  p.add_argument("--seed", type=int, default=7, help="of the prompts' token ids")
  p.add_argument("--skip-1b", action="store_true", help="stories260K only (a minute)")
  a = p.parse_args()
  start = time.time()
  if not os.access(a.kvwire, os.X_OK):
    raise SystemExit(f"{a.kvwire} not found: build first (bash scripts/build.sh)")
  stories = a.stories if os.path.exists(os.path.join(a.stories, "config.json")) else None
  if stories is None:
    log(f"{a.stories} not found: stories260K is left out")
  fa_modes = a.flash_attn.split(",")
  if not fa_modes or any(m not in ("on", "off") for m in fa_modes):
    raise SystemExit(f"--flash-attn: expected on, off or on,off, got {a.flash_attn!r}")
  mmap_modes = a.llama_mmap.split(",")
  if not mmap_modes or any(m not in ("on", "off") for m in mmap_modes):
    raise SystemExit(f"--llama-mmap: expected on, off or on,off, got {a.llama_mmap!r}")
  models = ensure_models(a.out, stories, a.skip_1b)

  import llama_cpp  # pylint: disable=import-outside-toplevel
  result = {
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
      "llama_cpp_python": llama_cpp.__version__, "gguf": metadata.version("gguf"),
      "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
      "runs": a.runs, "greedy": [], "models": {}, "rows": [],
  }
  log(f"llama-cpp-python {result['llama_cpp_python']}: {result['llama_cpp_system_info']}")
  rng = np.random.default_rng(a.seed)
  plans = []
  if "random-llama-1b" in models:
    plans.append(("random-llama-1b", [a.threads], CASES_1B, 32000, 4096))
  if "stories260K" in models:
    plans.append(("stories260K", [int(t) for t in a.stories_threads.split(",")], CASES_STORIES,
                  512, 512))
  rows = []
  for name, thread_counts, cases, vocab, n_ctx in plans:
    hf, gg = models[name]
    prompts = {n: random_prompt(rng, n, vocab) for n, _ in cases}
    record = result["models"][name] = {"kvwire_dir": hf, "gguf": gg, "prompts": prompts}
    loaded = {mm: LlamaCppModel(gg, use_mmap=mm == "on") for mm in mmap_modes}
    for threads in thread_counts:
      engines = {"kvwire": Kvwire(a.kvwire, hf, threads)}
      for mm, model in loaded.items():
        for m in fa_modes:
          e = f"llama.cpp fa={m} mmap={mm}"
          engines[e] = LlamaCpp(model, threads, n_ctx, m, mm)
          engines[e].run(prompts[cases[0][0]], 2)  # warm-up: weights paged in
      record["llama_cpp_params"] = {e: x.params for e, x in engines.items() if e != "kvwire"}
      first = threads == thread_counts[0]

      def check_first_round(raw, name=name, first=first):
        if not first:
          return
        shortest = min(n for n, steps in cases if steps)
        for n, steps in cases:
          if steps:
            got = {e: runs[0]["ids"] for e, runs in raw[f"{n}+{steps}"].items()}
            result["greedy"].append(check_greedy(f"{name}, {n}-token prompt", got, a.min_agree,
                                                 enforce=n == shortest))

      if first and name == "stories260K":
        with open(os.path.join(hf, "REFERENCE.json"), encoding="utf-8") as f:
          ref = json.load(f)["greedy_from_bos"]
        got = {e: x.run(ref["prompt_ids"], len(ref["ids"]) - 1)[2] for e, x in engines.items()}
        result["greedy"].append(check_greedy(f"{name} from BOS", got, a.min_agree, ref["ids"]))
        result["greedy"].append(
            check_layout_error_is_caught(a.out, stories, threads, ref, a.min_agree))
      log(f"timing {name}, {threads} thread(s), {a.runs} interleaved rounds...")
      raw = measure(f"{name} ({threads} thr)", engines, cases, prompts, a.runs, check_first_round)
      record[f"threads={threads}"] = raw
      for case, per_engine in raw.items():  # the timed runs' ids agree too (or say where not)
        for e, runs in per_engine.items():
          if e != "kvwire":
            result["greedy"].append({
                "label": f"{name}, {threads} thr, timed {case}, {e}", "of": len(runs[0]["ids"]),
                "agree_per_run": [agreement(k["ids"], l["ids"])
                                  for k, l in zip(per_engine["kvwire"], runs)]})
      rows += summarise(name, threads, cases, raw)
      for e, x in engines.items():
        if e != "kvwire":
          x.close()
    for model in loaded.values():
      model.close()

  result["rows"] = rows
  result["wall_seconds"] = time.time() - start
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = os.path.join(a.out, f"peer_bench-{stamp}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print_table(rows, a.runs, [f"fa={m} mmap={mm}" for mm in mmap_modes for m in fa_modes])
  print("\ngreedy ids (leading ids that agree with kvwire's, unless said otherwise):")
  timed = [g for g in result["greedy"] if "agree_per_run" in g]
  short = [g for g in timed if min(g["agree_per_run"]) < g["of"]]
  for g in result["greedy"]:
    if "agree_per_run" in g:
      if g in short:
        print(f"  {g['label']}: {g['agree_per_run']} of {g['of']}")
    elif isinstance(g["agree"], dict):
      line = ", ".join(f"{e} {n}" for e, n in g["agree"].items())
      if "against_reference" in g:
        line += "; with REFERENCE.json: " + ", ".join(
            f"{e} {n}" for e, n in g["against_reference"].items())
      print(f"  {g['label']}: {line} of {g['of']}")
    else:
      print(f"  {g['label']}: {g['agree']} of {g['of']}")
  print(f"  timed runs: {len(timed) - len(short)} of {len(timed)} (measurement, llama.cpp "
        "configuration) pairs agreed with kvwire on every id of every run")
  print(f"\nraw timings: {path}\nwall time: {result['wall_seconds'] / 60:.1f} min")


if __name__ == "__main__":
  main()
