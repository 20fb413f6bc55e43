#!/usr/bin/env python3
"""Runs a test script under the project's .venv Python (where scripts/install_deps.sh puts the
PyPI oracles: openai, transformers), and prints SKIP when there is no such environment.

  run_in_venv.py --venv-python .venv/bin/python -- test.py [its arguments]"""
import os
import sys


def main():
  args = sys.argv[1:]
  if len(args) < 4 or args[0] != "--venv-python" or args[2] != "--":
    sys.exit(__doc__)
  venv, script = args[1], args[3:]
  if not os.access(venv, os.X_OK):
    print("SKIP: %s does not exist: run scripts/install_deps.sh (it makes .venv with the "
          "openai and transformers packages)" % venv)
    return 0
  os.execv(venv, [venv] + script)
  return 1


if __name__ == "__main__":
  sys.exit(main())
