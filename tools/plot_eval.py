#!/usr/bin/env python3
"""Plots the JSON lines of `kvwire eval fidelity|passkey --json FILE` as a PNG.

  plot_eval.py RECORDS.jsonl OUT.png [--title TITLE]

The kind of evaluation is read from the records: fidelity records (agreement, kl, recall)
give three panels side by side, passkey records (accuracy, and needle_read when measured)
one or two, and one more of accuracy against the KV bytes shipped per prompt when the records
are of several KV formats (kv_format) and carry kv_payload_bytes; passkey rows per task or length bucket are left out (the totals are
plotted). x is the budget on a log2 axis (the bytes on a log10 one); each policy, in each KV
format when the records have several (kv_format), is one line with markers, in the same
colour in every panel, under one shared legend. A null value (the oracle has no agreement or
KL) leaves a gap.

`kvwire eval --plot` runs this script from beside the kvwire executable.
Exit codes: 0 written, 1 the PNG could not be written, 2 bad arguments or records,
3 matplotlib is not installed for this Python.
"""
import argparse
import importlib.util
import json
import math
import sys
import textwrap

EXIT_WRITE, EXIT_INPUT, EXIT_NO_MATPLOTLIB = 1, 2, 3
X_LABEL = "budget (tokens per KV head)"
# (record field, panel title, y label), as `kvwire eval` names them.
PANELS = {
    "fidelity": [("agreement", "top-1 agreement with full KV", "agreement"),
                 ("kl", "KL(full || compressed)", "nats"),
                 ("recall", "attention-mass recall", "recall")],
    "passkey": [("accuracy", "exact-match accuracy", "accuracy"),
                ("needle_read", "needle read by decode (retrieval head)", "share of prompts")],
}
OPTIONAL = {"needle_read"}  # a panel drawn only when some record has the field
FRACTIONS = {"agreement", "recall", "accuracy", "needle_read"}  # y within [0, 1] (and a margin)
DEFAULT_TITLES = {"fidelity": "KV compression fidelity", "passkey": "passkey retrieval"}


class InputError(Exception):
  pass


def is_number(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_records(path):
  """The records and their kind; InputError naming the file (and line) otherwise."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except OSError as e:
    raise InputError(f"cannot read {path}: {e.strerror}") from None
  except UnicodeDecodeError:
    raise InputError(f"{path}: not UTF-8 text; expected JSON lines from kvwire eval --json") \
        from None
  records, kind = [], None
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      r = json.loads(line)
    except json.JSONDecodeError as e:
      raise InputError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(r, dict):
      raise InputError(f"{where}: expected a JSON object, got {type(r).__name__}")
    if not isinstance(r.get("policy"), str) or not r["policy"]:
      raise InputError(f'{where}: expected "policy" (a non-empty string)')
    if not is_number(r.get("budget")) or not 0 < r["budget"] < math.inf:
      raise InputError(f'{where}: expected "budget" (a positive number)')
    line_kind = ("fidelity" if "recall" in r else "passkey" if "accuracy" in r else None)
    if line_kind is None:
      raise InputError(f'{where}: neither a fidelity record ("agreement", "kl", "recall") '
                       f'nor a passkey record ("accuracy")')
    if kind is not None and line_kind != kind:
      raise InputError(f"{where}: a {line_kind} record among {kind} records")
    kind = line_kind
    for field, _, _ in PANELS[kind]:
      if field not in r and field not in OPTIONAL:
        raise InputError(f'{where}: a {kind} record without "{field}"')
      v = r.get(field)
      if v is not None and not is_number(v):
        raise InputError(f'{where}: expected "{field}" to be a number or null, got {v!r}')
    # Passkey records also come per task and length bucket: the plot shows the totals.
    if r.get("task", "all") != "all" or r.get("length", "all") != "all":
      continue
    records.append(r)
  if not records:
    raise InputError(f"{path}: no records; expected JSON lines from kvwire eval --json")
  return records, kind


def plot(records, kind, out, title):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  # A series per policy, and per KV format when the records hold several.
  formats = {r.get("kv_format", "auto") for r in records}
  for r in records:
    f = r.get("kv_format", "auto")
    r["series"] = r["policy"] if len(formats) == 1 else f'{r["policy"]} [{f}]'
  policies = list(dict.fromkeys(r["series"] for r in records))  # legend order: first seen
  palette = plt.get_cmap("tab10" if len(policies) <= 10 else "tab20").colors
  colour = {p: palette[i % len(palette)] for i, p in enumerate(policies)}
  marker = {p: "osD^v<>ph*"[i % 10] for i, p in enumerate(policies)}
  budgets = sorted({r["budget"] for r in records})
  panels = [p for p in PANELS[kind]
            if p[0] not in OPTIONAL or any(r.get(p[0]) is not None for r in records)]
  bytes_panel = (kind == "passkey" and len(formats) > 1 and
                 all(is_number(r.get("kv_payload_bytes")) and is_number(r.get("n")) and r["n"] > 0
                     for r in records))
  if bytes_panel:
    panels.append(("accuracy", "accuracy against KV bytes shipped", "accuracy"))

  # One legend below the panels, as many entries a row as fit (about 8 px a character).
  width = 4.6 * len(panels)
  longest = max(len(p) for p in policies)
  ncol = max(1, min(len(policies), int(width * 100 // ((longest + 6) * 8))))
  legend_h = 0.27 * math.ceil(len(policies) / ncol) + 0.15  # inches
  fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.0 + legend_h), squeeze=False)
  handles = {}
  for i, (ax, (field, panel_title, y_label)) in enumerate(zip(axes[0], panels)):
    by_bytes = bytes_panel and i == len(panels) - 1
    x_of = ((lambda r: r["kv_payload_bytes"] / r["n"]) if by_bytes else (lambda r: r["budget"]))
    for p in policies:
      points = sorted(((x_of(r), r.get(field)) for r in records if r["series"] == p),
                      key=lambda point: point[0])
      y = [math.nan if v is None else float(v) for _, v in points]
      if all(math.isnan(v) for v in y):
        continue  # e.g. the oracle, which has no agreement or KL
      (line,) = ax.plot([b for b, _ in points], y, marker=marker[p], markersize=5, linewidth=1.8,
                        color=colour[p], label=p)
      handles.setdefault(p, line)
    if field in ("accuracy", "needle_read"):
      ax.set_ylim(-0.03, 1.03)  # passkey accuracies span the range; 0 everywhere reads as 0
    elif field in FRACTIONS:
      lo, hi = ax.get_ylim()
      ax.set_ylim(max(lo, -0.03), min(hi, 1.03))
    if by_bytes:
      ax.set_xscale("log", base=10)
      ax.set_xlabel("KV payload bytes per prompt (positions, K and V)")
    else:
      ax.set_xscale("log", base=2)
      ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
      ax.minorticks_off()
      ax.set_xlabel(X_LABEL)
    ax.set_title(panel_title)
    ax.set_ylabel(y_label)
    ax.grid(True, color="0.9")
  fig.suptitle(textwrap.fill(title, int(width * 100 / 11.5)), fontweight="bold")
  shown = [p for p in policies if p in handles]
  fig.legend([handles[p] for p in shown], shown, loc="lower center", ncol=ncol)
  fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
  try:
    fig.savefig(out, dpi=100, format="png")
  finally:
    plt.close(fig)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("records", help="JSON lines written by kvwire eval --json")
  ap.add_argument("out", help="the PNG to write")
  ap.add_argument("--title", help="figure title (default: from the kind of evaluation)")
  args = ap.parse_args()
  try:
    records, kind = read_records(args.records)
  except InputError as e:
    print(f"plot_eval.py: {e}", file=sys.stderr)
    return EXIT_INPUT
  if importlib.util.find_spec("matplotlib") is None:  # checked here to say what to install
    print(f"plot_eval.py: matplotlib is not installed for {sys.executable} "
          f"(Debian: apt-get install python3-matplotlib)", file=sys.stderr)
    return EXIT_NO_MATPLOTLIB
  try:
    plot(records, kind, args.out, args.title or DEFAULT_TITLES[kind])
  except OSError as e:
    print(f"plot_eval.py: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
    return EXIT_WRITE
  return 0


if __name__ == "__main__":
  sys.exit(main())
