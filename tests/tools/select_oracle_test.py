#!/usr/bin/env python3
"""`kvwire select` against an independent NumPy implementation of the policies, written
from the papers' own listings (SnapKV Listing 1 with repeat_kv, RocketKV Algorithm 1,
ChunkKV Algorithm 1) rather than from kvwire's C++.

The C++ scores in float32 and NumPy in float64, so near-ties at the selection boundary
may legitimately resolve differently; such a disagreement is accepted only when the two
positions' pooled scores are within a relative 1e-4 of each other.

usage: select_oracle_test.py --kvwire build/tools/kvwire
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np


def write_safetensors(path, tensors):
  header, blobs, offset = {}, [], 0
  for name, arr in tensors.items():
    data = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
    header[name] = {"dtype": "F32", "shape": list(arr.shape),
                    "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
  text = json.dumps(header).encode()
  text += b" " * ((8 - len(text) % 8) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for b in blobs:
      f.write(b)


def window_attention(q, k, window):
  """SnapKV Listing 1: softmax over all keys of the last `window` queries, causal."""
  heads, length, d = q.shape
  group = heads // k.shape[0]
  kr = np.repeat(k, group, axis=0).astype(np.float64)  # repeat_kv
  qw = q[:, length - window:, :].astype(np.float64)
  logits = qw @ kr.transpose(0, 2, 1) / np.sqrt(d)
  for i in range(window):
    logits[:, i, length - window + i + 1:] = -np.inf
  logits -= logits.max(axis=-1, keepdims=True)
  attn = np.exp(logits)
  return attn / attn.sum(axis=-1, keepdims=True)


def pool1d(x, kernel, kind):
  """F.max_pool1d / F.avg_pool1d(kernel, stride=1, padding=kernel//2), count_include_pad."""
  if kernel <= 1:
    return x.copy()
  half = kernel // 2
  pad = -np.inf if kind == "max" else 0.0
  padded = np.pad(x, ((0, 0), (half, half)), constant_values=pad)
  windows = np.stack([padded[:, i:i + x.shape[1]] for i in range(kernel)])
  return windows.max(axis=0) if kind == "max" else windows.sum(axis=0) / kernel


def topk_sorted(scores, n, tie):
  """Best first by pooled score, ties by the raw vote, then the lower position."""
  order = np.lexsort((np.arange(len(scores)), -tie, -scores))
  return sorted(order[:n].tolist())


def snapkv(q, k, window, budget, kernel, pool, gqa):
  heads, length, _ = q.shape
  kv = k.shape[0]
  prefix = length - window
  vote = window_attention(q, k, window)[:, :, :prefix].sum(axis=1)  # Listing 1 l.11
  if gqa == "sum":  # SnapKV++ / RocketKV Alg. 1: group sum before pooling
    vote = vote.reshape(kv, heads // kv, prefix).sum(axis=1)
  pooled = pool1d(vote, kernel, pool)
  rows = [topk_sorted(p, budget - window, v) + list(range(prefix, length))
          for p, v in zip(pooled, vote)]
  return rows, pooled


def chunkkv(q, k, window, budget, chunk, per_kv_head=False):
  """ChunkKV Alg. 1 over the prefix; chunk score = mean of the votes summed over all heads
  (one index set per layer), or over each KV head's group (one per KV head)."""
  heads, length, _ = q.shape
  prefix = length - window
  votes = window_attention(q, k, window)[:, :, :prefix].sum(axis=1)  # [heads, prefix]
  if per_kv_head:
    group = heads // k.shape[0]
    return [chunk_rows(votes[g * group:(g + 1) * group].sum(axis=0), prefix, length, window,
                       budget, chunk) for g in range(k.shape[0])], None
  return [chunk_rows(votes.sum(axis=0), prefix, length, window, budget, chunk)] * k.shape[0], None


def chunk_rows(tok, prefix, length, window, budget, chunk):
  n_chunks = -(-prefix // chunk)
  means = np.array([tok[m * chunk:min(prefix, (m + 1) * chunk)].mean() for m in range(n_chunks)])
  chosen, covered = [], 0
  for m in np.argsort(-means, kind="stable"):
    if covered >= budget - window:
      break
    take = min(min(prefix, (m + 1) * chunk) - m * chunk, budget - window - covered)
    chosen.append((int(m), take))  # the last one taken is cut to fit
    covered += take
  kept = [j for m, take in sorted(chosen) for j in range(m * chunk, m * chunk + take)]
  return kept + list(range(prefix, length))


def run_kvwire(kvwire, path, args):
  out = subprocess.run([kvwire, "select", "--tensors", path] + args, capture_output=True,
                       text=True, check=False)
  if out.returncode != 0:
    raise RuntimeError("kvwire select failed: %s" % out.stderr)
  return json.loads(out.stdout)["kept"]


def near_tie_ok(got, want, pooled, length, window):
  """Differences allowed only between positions whose scores tie to 1e-4."""
  if pooled is None:
    return False
  for row_got, row_want, scores in zip(got, want, pooled):
    extra = set(row_got) - set(row_want)
    missing = set(row_want) - set(row_got)
    for a, b in zip(sorted(extra), sorted(missing)):
      if a >= length - window or b >= length - window:
        return False
      if abs(scores[a] - scores[b]) > 1e-4 * max(abs(scores[a]), abs(scores[b]), 1e-12):
        return False
  return True


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--kvwire", required=True)
  args = parser.parse_args()
  rng = np.random.default_rng(123)
  failures, checked = 0, 0
  with tempfile.TemporaryDirectory() as tmp:
    for trial in range(24):
      kv = int(rng.integers(1, 4))
      heads = kv * int(rng.integers(1, 4))
      d = int(rng.choice([4, 8, 16]))
      length = int(rng.integers(40, 400))
      window = int(rng.integers(1, 17))
      budget = window + int(rng.integers(1, length - window))
      # Peaky attention, as trained models have: scaled Gaussian queries and keys.
      q = rng.standard_normal((heads, length, d)) * 1.5
      k = rng.standard_normal((kv, length, d)) * 1.5
      path = os.path.join(tmp, "qk%d.safetensors" % trial)
      write_safetensors(path, {"q": q, "k": k})
      kernel = int(rng.choice([1, 3, 5, 7]))
      pool = str(rng.choice(["max", "avg"]))
      chunk = int(rng.integers(1, 12))
      cases = [
          ("snapkv per_query_head",
           ["--policy", "snapkv", "--gqa", "per_query_head", "--kernel", str(kernel), "--pool",
            pool], lambda: snapkv(q, k, window, budget, kernel, pool, "per_query_head")),
          ("snapkv sum",
           ["--policy", "snapkv", "--gqa", "sum", "--kernel", str(kernel), "--pool", pool],
           lambda: snapkv(q, k, window, budget, kernel, pool, "sum")),
          ("snapkv_pp",
           ["--policy", "snapkv_pp", "--kernel-small", str(kernel), "--kernel-large", "63",
            "--kernel-threshold", "200"],
           lambda: snapkv(q, k, window, budget, kernel if length < 200 else 63, "max", "sum")),
          ("chunkkv", ["--policy", "chunkkv", "--chunk", str(chunk)],
           lambda: chunkkv(q, k, window, budget, chunk)),
          ("chunkkv per_kv_head",
           ["--policy", "chunkkv", "--chunk", str(chunk), "--chunk-scope", "per_kv_head"],
           lambda: chunkkv(q, k, window, budget, chunk, per_kv_head=True)),
      ]
      for name, flags, oracle in cases:
        got = run_kvwire(args.kvwire, path,
                         flags + ["--budget", str(budget), "--window", str(window)])
        want, pooled = oracle()
        checked += 1
        if got != want and not near_tie_ok(got, want, pooled, length, window):
          failures += 1
          print("MISMATCH %s: heads=%d kv=%d L=%d w=%d budget=%d" %
                (name, heads, kv, length, window, budget))
          for r, (a, b) in enumerate(zip(got, want)):
            if a != b:
              print("  row %d: kvwire-only %s oracle-only %s" %
                    (r, sorted(set(a) - set(b))[:10], sorted(set(b) - set(a))[:10]))
  print("%d of %d policy selections agree with the NumPy oracle" % (checked - failures, checked))
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
