#!/usr/bin/env bash
# The peer benchmark: kvwire against llama.cpp on the same weights, token ids and threads
# (bench/peers/peer_bench.py says what it measures; docs/benchmarks.md has the figures).
#
#   bash bench/peers/run.sh [--runs 5] [--skip-1b] [--kvwire build/tools/kvwire] ...
#
# The first run builds llama.cpp from source, through llama-cpp-python with native CPU flags,
# into a cached environment (build/peers/venv, about 20 minutes on 2 cores), and writes the
# models under build/peers/models (about 4 GB). Not run by CI: with llama.cpp's four
# configurations a run took 5.5 minutes on a 2-core Zen 5 at --runs 3, and 8.5-9 at the default
# of 5 rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."
LLAMA_CPP_PYTHON_VERSION=0.3.36
GGUF_VERSION=0.19.0
VENV=build/peers/venv
JOBS="${KVWIRE_JOBS:-2}"

venv_ok() {
  [[ -x $VENV/bin/python ]] && "$VENV/bin/python" - <<PY >/dev/null 2>&1
import llama_cpp, gguf, numpy
from importlib import metadata
assert llama_cpp.__version__ == "$LLAMA_CPP_PYTHON_VERSION"
assert metadata.version("gguf") == "$GGUF_VERSION"
PY
}
if ! venv_ok; then
  echo "building llama.cpp ($LLAMA_CPP_PYTHON_VERSION, native flags, $JOBS jobs) into $VENV..." >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q numpy "gguf==$GGUF_VERSION"
  # From source, so that ggml is compiled for this CPU (a wheel would be generic).
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    "$VENV/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  venv_ok || { echo "run.sh: $VENV is not usable after the install" >&2; exit 1; }
fi

KVWIRE=build/tools/kvwire
for ((i = 1; i <= $#; i++)); do
  [[ ${!i} == --kvwire ]] && { j=$((i + 1)); KVWIRE=${!j}; }
done
[[ -x $KVWIRE ]] || { echo "build first: bash scripts/build.sh" >&2; exit 1; }
if [[ $KVWIRE == build/tools/kvwire ]] &&
  ! grep -qs '^CMAKE_BUILD_TYPE:STRING=Release$' build/CMakeCache.txt; then
  echo "run.sh: build/ is not a Release build; the figures would not mean much" >&2
  exit 1
fi
exec "$VENV/bin/python" bench/peers/peer_bench.py "$@"
