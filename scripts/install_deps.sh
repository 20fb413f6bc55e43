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
  nginx prometheus curl openssl clang-format
  clang-16 libclang-rt-16-dev  # libFuzzer with ASan/UBSan for scripts/fuzz.sh
  python3 python3-grpcio python3-protobuf python3-numpy python3-yaml python3-venv
  python3-matplotlib
)
# Installed when the package sources have them (kubectl is not in Debian's own archive);
# the tests that need them skip with a message otherwise.
OPTIONAL=(kubectl)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
optional_missing=()
for p in "${OPTIONAL[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || optional_missing+=("$p")
done
if ((${#missing[@]} + ${#optional_missing[@]})); then
  $SUDO apt-get update -qq
fi
if ((${#missing[@]})); then
  echo "installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
for p in "${optional_missing[@]}"; do
  if apt-cache show "$p" >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$p" \
      >/dev/null || echo "warning: could not install $p; the tests that need it will skip"
  else
    echo "note: $p is not in the package sources; the tests that need it will skip"
  fi
done

# Oracles for the tests (Hugging Face tokenizers); a failure here only skips those checks.
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv >/dev/null 2>&1 || /usr/bin/python3 -m venv .venv
fi
if ! .venv/bin/python -c "import tokenizers" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "tokenizers>=0.19,<1" \
    || echo "warning: could not install the tokenizers oracle; its live check will be skipped"
fi
