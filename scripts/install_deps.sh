#!/usr/bin/env bash
# Installs everything kvwire builds and tests with: Debian packages, plus the PyPI packages
# the tests use as independent oracles (in .venv). Idempotent and quiet; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev prometheus-cpp-dev nlohmann-json3-dev
  libopenblas-dev zlib1g-dev
  nginx prometheus kubectl curl
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-numpy python3-venv
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  echo "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# Oracles for the tests (Hugging Face tokenizers); a failure here only skips those checks.
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv >/dev/null 2>&1 || /usr/bin/python3 -m venv .venv
fi
if ! .venv/bin/python -c "import tokenizers" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "tokenizers>=0.19,<1" \
    || echo "warning: could not install the tokenizers oracle; its live check will be skipped"
fi
