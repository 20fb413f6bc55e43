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
  libcpp-httplib-dev libpython3-dev python3-jinja2  # the OpenAI front: HTTP, chat templates
  python3-aiohttp  # bench/openai_vs_grpc.py's HTTP client
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

# Oracles for the tests, from PyPI into .venv: Hugging Face tokenizers, transformers (its
# apply_chat_template; without torch) with the jinja2 it needs, and the openai client. The
# environment sees Debian's packages (--system-site-packages: grpcio, protobuf, numpy, aiohttp),
# so the tests that drive the cluster from it use the same gRPC as the rest. A .venv made before
# that (without system packages, or by another Python) is made again. A failure here only
# skips the checks that need the package.
venv_ok() {
  [[ -x .venv/bin/python ]] && grep -qs '^include-system-site-packages = true' .venv/pyvenv.cfg &&
    .venv/bin/python -c "import grpc, aiohttp" >/dev/null 2>&1
}
if ! venv_ok; then
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
pip_install() {  # pip_install WHAT IMPORT_CHECK REQUIREMENT...
  local what=$1 check=$2
  shift 2
  if ! .venv/bin/python -c "$check" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" ||
      echo "warning: could not install $what; the checks that need it will be skipped"
  fi
}
pip_install "the tokenizers oracle" "import tokenizers" "tokenizers>=0.19,<1"
pip_install "the transformers oracle" \
  "import jinja2, transformers; assert tuple(map(int, jinja2.__version__.split('.')[:3])) >= (3, 1, 6)" \
  "transformers>=4.43" "jinja2>=3.1.6"
pip_install "the openai client" "import openai" "openai>=1.40"
# FlashInfer's headers, for the CUDA backend's decode attention (kernels/cuda/flashinfer_decode.cu
# instantiates its templates ahead of time; CMake finds them in .venv). Only the wheel's files
# are needed, not its Python dependencies (PyTorch): installed without them, and never imported.
FLASHINFER_VERSION=0.7.2.post1
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  pip_install "FlashInfer $FLASHINFER_VERSION (headers)" \
    "import importlib.metadata as m; assert m.version('flashinfer-python') == '$FLASHINFER_VERSION'" \
    --no-deps "flashinfer-python==$FLASHINFER_VERSION"
fi
# The project's own client package (clients/python; its stubs are generated from proto/ at
# build time), so that `import kvwire` works in .venv. Reinstalled when proto/ or the package
# changed since the last time.
stamp=$(cat proto/kvwire/v1/*.proto clients/python/pyproject.toml clients/python/setup.py \
  clients/python/kvwire/*.py | sha256sum | cut -c1-16)
if [[ $(cat .venv/.kvwire-client 2>/dev/null) != "$stamp" ]]; then
  if .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation ./clients/python; then
    echo "$stamp" >.venv/.kvwire-client
  else
    echo "warning: could not install clients/python into .venv"
  fi
fi
