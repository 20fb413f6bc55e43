#!/usr/bin/env bash
# Configures and builds kvwire into build/ (Release, CUDA when nvcc is found, warnings as
# errors).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${KVWIRE_JOBS:-2}"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVWIRE_WERROR=ON "$@" >/dev/null
cmake --build build -j"$JOBS"
