#!/usr/bin/env python3
"""tools/plot_eval.py on small fidelity and passkey records, and `kvwire eval passkey --plot`
running it from beside the executable (where the build copies it).

The images are checked for what the plot is for: the expected size, not blank, one colour
per policy (tab10 in legend order), the oracle drawn only in the recall panel; bad records
are exit code 2 with a message naming the file and line.

usage: plot_eval_test.py --kvwire build/tools/kvwire
Prints "SKIP: ..." and exits 0 when this Python has no matplotlib.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

KVWIRE = None
SCRIPT = None
TAB10 = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def fidelity_records():
  # The oracle first: it is first in the legend, so it takes the first colour in every
  # panel, including the ones it is not drawn in.
  out = [{"policy": "oracle", "budget": b, "agreement": None, "kl": None,
          "recall": 0.9 + b / 2048, "hit_rate": 1.0, "n": 4, "predictions": 0}
         for b in [16, 32, 64, 128]]
  for i, policy in enumerate(["snapkv", "streaming", "random"]):
    for b in [16, 32, 64, 128]:
      out.append({"policy": policy, "budget": b, "agreement": 0.5 + 0.1 * i + b / 512,
                  "kl": 1.0 / b + 0.01 * i, "recall": 0.3 + 0.1 * i + b / 512,
                  "hit_rate": 0.5, "n": 4, "predictions": 32})
  return out


def passkey_records():
  return [{"policy": p, "budget": b, "accuracy": a, "n": 10, "skipped": 0}
          for p, acc in [("full", [1.0, 1.0, 1.0]), ("streaming", [0.1, None, 0.6])]
          for b, a in zip([32, 64, 128], acc)]


def colour_mask(img, rgb, tol=6):
  import numpy as np
  px = (img[:, :, :3] * 255).round().astype(int)
  return (np.abs(px - np.array(rgb)).max(axis=2) <= tol)


class PlotEvalScript(unittest.TestCase):

  def setUp(self):
    self.dir = tempfile.mkdtemp(prefix="plot_eval_test.")
    self.addCleanup(shutil.rmtree, self.dir)

  def plot(self, records_path, *extra):
    out = os.path.join(self.dir, "out.png")
    r = subprocess.run([sys.executable, SCRIPT, records_path, out, *extra],
                       capture_output=True, text=True, timeout=60)
    return r, out

  def read_png(self, path):
    import matplotlib.image
    self.assertTrue(os.path.isfile(path), path)
    with open(path, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    return matplotlib.image.imread(path)

  def assert_not_blank(self, img):
    self.assertGreater(float(img[:, :, :3].var()), 0.005)

  def test_fidelity_three_panels_one_colour_per_policy(self):
    path = os.path.join(self.dir, "fidelity.jsonl")
    write_jsonl(path, fidelity_records())
    r, out = self.plot(path, "--title", "fidelity of a test model")
    self.assertEqual(r.returncode, 0, r.stderr)
    img = self.read_png(out)
    height, width = img.shape[:2]
    self.assertTrue(1200 <= width <= 1600 and 350 <= height <= 600, img.shape)
    self.assert_not_blank(img)
    # The oracle and three policies: the first four colours drawn, the fifth not.
    for i in range(4):
      self.assertGreater(int(colour_mask(img, TAB10[i]).sum()), 200, f"colour {i}")
    self.assertEqual(int(colour_mask(img, TAB10[4]).sum()), 0)
    # Above the legend, the oracle (first colour) is only in the recall panel, the right
    # third; each policy keeps its legend colour in the agreement panel, the left third.
    panels = img[: int(height * 0.8)]
    oracle = colour_mask(panels, TAB10[0])
    self.assertEqual(int(oracle[:, : 2 * width // 3].sum()), 0)
    self.assertGreater(int(oracle[:, 2 * width // 3:].sum()), 100)
    for i in range(1, 4):
      self.assertGreater(int(colour_mask(panels[:, : width // 3], TAB10[i]).sum()), 50)

  def test_passkey_one_panel(self):
    path = os.path.join(self.dir, "passkey.jsonl")
    write_jsonl(path, passkey_records())
    r, out = self.plot(path)
    self.assertEqual(r.returncode, 0, r.stderr)
    img = self.read_png(out)
    height, width = img.shape[:2]
    self.assertTrue(350 <= width <= 600 and 350 <= height <= 600, img.shape)
    self.assert_not_blank(img)
    self.assertGreater(int(colour_mask(img, TAB10[0]).sum()), 100)
    streaming = colour_mask(img, TAB10[1])
    self.assertGreater(int(streaming.sum()), 100)
    self.assertEqual(int(colour_mask(img, TAB10[2]).sum()), 0)
    # streaming's null at budget 64 (mid-axis) leaves a gap: no marker, no line through it.
    self.assertEqual(int(streaming[: int(height * 0.75), int(width * 0.35):int(width * 0.7)]
                         .sum()), 0)

  def test_passkey_totals_only_and_a_needle_panel(self):
    """Rows per task or length bucket are not plotted (a third policy only in them leaves no
    colour); needle_read adds a second panel of the same size."""
    records = passkey_records()
    for r in records:
      r.update({"task": "all", "length": "all", "needle_read": r["accuracy"]})
    records += [{"policy": "only-in-breakdown", "budget": 64, "accuracy": 0.5, "task": "multi",
                 "length": "all", "needle_read": 0.5},
                {"policy": "only-in-breakdown", "budget": 64, "accuracy": 0.5, "task": "all",
                 "length": 1024, "needle_read": 0.5}]
    path = os.path.join(self.dir, "passkey.jsonl")
    write_jsonl(path, records)
    r, out = self.plot(path)
    self.assertEqual(r.returncode, 0, r.stderr)
    img = self.read_png(out)
    height, width = img.shape[:2]
    self.assertTrue(800 <= width <= 1000, img.shape)
    for half in (img[:, : width // 2], img[:, width // 2:]):
      self.assertGreater(int(colour_mask(half, TAB10[0]).sum()), 50)
      self.assertGreater(int(colour_mask(half, TAB10[1]).sum()), 50)
    self.assertEqual(int(colour_mask(img, TAB10[2]).sum()), 0)

  def test_passkey_formats_are_series_and_bytes_a_panel(self):
    """Records of several KV formats: each policy and format is a series of its own colour,
    and the KV bytes per prompt add a panel where a smaller format's points lie to the left."""
    records = []
    for fmt, row, accs in [("auto", 1024, [0.5, 0.9, 1.0]), ("int4", 144, [0.3, 0.7, 0.8])]:
      for b, acc in zip([32, 64, 128], accs):
        records.append({"policy": "snapkv", "kv_format": fmt, "budget": b, "accuracy": acc,
                        "n": 2, "task": "all", "length": "all",
                        "kv_payload_bytes": 2 * b * row})
    path = os.path.join(self.dir, "formats.jsonl")
    write_jsonl(path, records)
    r, out = self.plot(path)
    self.assertEqual(r.returncode, 0, r.stderr)
    img = self.read_png(out)
    height, width = img.shape[:2]
    self.assertTrue(800 <= width <= 1000, img.shape)  # accuracy by budget, by bytes
    panels = img[: int(height * 0.75)]
    for i in range(2):
      self.assertGreater(int(colour_mask(panels[:, : width // 2], TAB10[i]).sum()), 50, i)
    self.assertEqual(int(colour_mask(img, TAB10[2]).sum()), 0)
    # In the bytes panel, int4's series (orange) lies left of auto's (blue).
    import numpy as np
    right = panels[:, width // 2:]
    cols = lambda i: np.nonzero(colour_mask(right, TAB10[i]).any(axis=0))[0]
    self.assertLess(float(cols(1).mean()), float(cols(0).mean()))

  def test_bad_records_are_exit_code_2_with_a_message(self):
    cases = [
        ('{"policy": "a", "budget": 32, "accuracy": 1}\n{oops\n', "bad.jsonl:2: not valid JSON"),
        ("", "no records"),
        ("\n\n", "no records"),
        ('{"policy": "a", "budget": 32}\n', "neither a fidelity record"),
        ('{"policy": "a", "budget": -1, "accuracy": 1}\n', '"budget"'),
        ('{"policy": "a", "budget": 32, "accuracy": "high"}\n', '"accuracy"'),
        ('{"policy": "a", "budget": 32, "recall": 0.5}\n', 'without "agreement"'),
        ('{"policy": "a", "budget": 32, "accuracy": 1}\n'
         '{"policy": "a", "budget": 32, "agreement": 1, "kl": 0, "recall": 1}\n',
         "bad.jsonl:2: a fidelity record among passkey records"),
    ]
    path = os.path.join(self.dir, "bad.jsonl")
    for contents, expect in cases:
      with open(path, "w") as f:
        f.write(contents)
      r, out = self.plot(path)
      self.assertEqual(r.returncode, 2, contents)
      self.assertIn(expect, r.stderr, contents)
      self.assertFalse(os.path.exists(out))
    r, _ = self.plot(os.path.join(self.dir, "missing.jsonl"))
    self.assertEqual(r.returncode, 2)
    self.assertIn("cannot read", r.stderr)
    self.assertIn("missing.jsonl", r.stderr)


class KvwireEvalPlot(unittest.TestCase):
  """`kvwire eval passkey --plot` on a synthetic model: records to a temporary file (or
  --json's), the script beside the executable, and the failures say where the records are."""

  def setUp(self):
    self.dir = tempfile.mkdtemp(prefix="kvwire_eval_plot.")
    self.addCleanup(shutil.rmtree, self.dir)
    self.data = os.path.join(self.dir, "passkey.jsonl")
    write_jsonl(self.data, [{"prompt_ids": [1] + [3 + (t * (7 + i)) % 250 for t in range(1, 60)],
                             "answer_ids": [5, 6]} for i in range(2)])
    self.tmp = os.path.join(self.dir, "tmp")
    os.mkdir(self.tmp)

  def eval_passkey(self, python, *extra):
    env = dict(os.environ, KVWIRE_PYTHON=python, TMPDIR=self.tmp)
    return subprocess.run(
        [KVWIRE, "eval", "passkey", "--model", "synthetic:tiny", "--threads", "1",
         "--data", self.data, "--policies", "snapkv,streaming", "--budgets", "16,32",
         "--window", "4", *extra], env=env, capture_output=True, text=True, timeout=60)

  def test_plot_without_json_leaves_no_records_behind(self):
    png = os.path.join(self.dir, "passkey.png")
    r = self.eval_passkey(sys.executable, "--plot", png)
    self.assertEqual(r.returncode, 0, r.stderr)
    import matplotlib.image
    img = matplotlib.image.imread(png)
    self.assertTrue(350 <= img.shape[1] <= 600, img.shape)
    self.assertGreater(float(img[:, :, :3].var()), 0.005)
    self.assertEqual(os.listdir(self.tmp), [])

  def test_failures_name_the_records(self):
    png = os.path.join(self.dir, "passkey.png")
    fake = os.path.join(self.dir, "python-without-matplotlib")
    with open(fake, "w") as f:
      f.write("#!/bin/sh\nexit 3\n")  # plot_eval.py's exit code for a missing matplotlib
    os.chmod(fake, 0o755)
    r = self.eval_passkey(fake, "--plot", png)
    self.assertEqual(r.returncode, 1, r.stderr)
    self.assertIn("matplotlib is not installed", r.stderr)
    [kept] = os.listdir(self.tmp)
    self.assertIn(os.path.join(self.tmp, kept), r.stderr)
    with open(os.path.join(self.tmp, kept)) as f:
      records = [json.loads(line) for line in f]
    # 2 methods x 2 budgets, each over all prompts and over their one length bucket
    self.assertEqual(len(records), 8)
    self.assertEqual(len([r for r in records if r["length"] == "all"]), 4)

    records = os.path.join(self.dir, "records.jsonl")
    r = self.eval_passkey(os.path.join(self.dir, "no-such-python"), "--plot", png,
                          "--json", records)
    self.assertEqual(r.returncode, 1, r.stderr)
    self.assertIn("cannot run", r.stderr)
    self.assertIn("the JSON records are in " + records, r.stderr)
    self.assertTrue(os.path.isfile(records))
    self.assertFalse(os.path.exists(png))


def main():
  global KVWIRE, SCRIPT
  ap = argparse.ArgumentParser()
  ap.add_argument("--kvwire", required=True, help="the kvwire executable; plot_eval.py beside it")
  args, rest = ap.parse_known_args()
  KVWIRE = os.path.abspath(args.kvwire)
  SCRIPT = os.path.join(os.path.dirname(KVWIRE), "plot_eval.py")
  try:
    import matplotlib
    matplotlib.use("Agg")
  except ImportError:
    print(f"SKIP: matplotlib is not installed for {sys.executable} "
          f"(Debian: apt-get install python3-matplotlib); plot_eval not run")
    return 0
  prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
  return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
  sys.exit(main())
