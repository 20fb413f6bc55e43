#!/usr/bin/env python3
"""The layering of docs/architecture.md, checked: every #include of every source folder names
only the folders its row allows (the folder itself and Abseil aside), gRPC headers appear only
in the folders that may use gRPC, prometheus-cpp only in common/telemetry, and no source file
includes a test header. The table is the specification; this test keeps it true."""
import argparse
import os
import re
import sys

GRPC_FOLDERS = {"common/server", "proto", "prefill_service", "decode_service", "openai_front",
                "tools", "bench"}
PROMETHEUS_FOLDERS = {"common/telemetry"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def read_table(repo):
  """{folder: set of folders it may include} from docs/architecture.md's first table."""
  allowed = {}
  with open(os.path.join(repo, "docs", "architecture.md"), encoding="utf-8") as f:
    for line in f:
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if len(cells) != 3 or not cells[0].startswith("`"):
        continue
      folder = cells[0].strip("`")
      allowed[folder] = set(re.findall(r"`([^`]+)`", cells[2]))
  return allowed


def folder_of(path, folders):
  """The table's folder holding `path` (longest match), or None."""
  best = None
  for f in folders:
    if path == f or path.startswith(f + "/"):
      if best is None or len(f) > len(best):
        best = f
  return best


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--repo-root", required=True)
  repo = os.path.abspath(p.parse_args().repo_root)
  allowed = read_table(repo)
  folders = set(allowed)
  assert len(folders) >= 10, "docs/architecture.md: the folder table was not found"
  common = {f for f in folders if f.startswith("common/")}
  errors, checked = [], 0
  for folder in sorted(folders):
    may = set(allowed[folder])
    if "common/*" in may:
      may = (may - {"common/*"}) | common
    may.add(folder)
    for root, _, files in os.walk(os.path.join(repo, folder)):
      for name in files:
        if not name.endswith((".cc", ".h", ".cu", ".cuh")):
          continue
        path = os.path.relpath(os.path.join(root, name), repo)
        if folder_of(path, folders) != folder:
          continue  # a subfolder with a row of its own
        with open(os.path.join(repo, path), encoding="utf-8") as f:
          text = f.read()
        for kind, target in INCLUDE.findall(text):
          checked += 1
          if kind == "<":
            if target.startswith("grpc") and folder not in GRPC_FOLDERS:
              errors.append("%s: <%s> (gRPC belongs in %s)" % (path, target, sorted(GRPC_FOLDERS)))
            if target.startswith("prometheus/") and folder not in PROMETHEUS_FOLDERS:
              errors.append("%s: <%s> (prometheus-cpp belongs in common/telemetry)" % (path, target))
            continue
          if target.startswith("absl/"):
            continue
          if target.startswith("tests/"):
            errors.append("%s: includes the test header %s" % (path, target))
            continue
          # Generated from proto/: kvwire's API and the google.rpc error details it sends.
          generated = target.startswith(("kvwire/v1/", "google/rpc/"))
          owner = "proto" if generated else folder_of(target, folders)
          if owner is None:
            errors.append("%s: includes %s, which is in no folder of the table" % (path, target))
          elif owner not in may:
            errors.append("%s: includes %s (%s may include %s)" % (path, target, folder,
                                                                    sorted(may - {folder})))
  for e in errors:
    print("LAYERING: " + e)
  print("%d includes of %d folders checked, %d outside the layering" % (checked, len(folders),
                                                                        len(errors)))
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
