#!/usr/bin/env bash
# Runs the binaries of device-bundle.tar.gz (scripts/device_bundle.sh) on a GPU machine, from
# the repository root of a copy of this checkout:
#
#   scripts/device_run.sh env                 the machine: GPU, driver, CPU, libraries found
#   scripts/device_run.sh tests [gtest args]  every bundled test binary (the CUDA cases run)
#   scripts/device_run.sh BINARY [args]       one bundled binary (kvwire, decode_bench, ...)
#
# It unpacks the bundle once into $KVWIRE_DEVICE_DIR (default /tmp/kvwire-device), finds cuBLAS
# (PyTorch's nvidia-cublas wheel, or a CUDA toolkit), and sets LD_LIBRARY_PATH,
# KVWIRE_SHARED_DIR (the bundled models and data) and KVWIRE_SOURCE_DIR (this checkout).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bundle="${KVWIRE_DEVICE_BUNDLE:-$root/device-bundle.tar.gz}"
dir="${KVWIRE_DEVICE_DIR:-/tmp/kvwire-device}"

if [[ $# -eq 0 ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
if [[ ! -f "$dir/manifest" ]]; then
  [[ -f "$bundle" ]] || { echo "device_run: $bundle not found (scripts/device_bundle.sh)" >&2; exit 1; }
  mkdir -p "$dir"
  tar -C "$dir" -xzf "$bundle"
fi

has_cublas() { compgen -G "$1/libcublasLt.so.13*" >/dev/null && compgen -G "$1/libcublas.so.13*" >/dev/null; }
cublas=""
# The toolkit's, then PyTorch's wheels' (CUDA 13's put every library in nvidia/cu13/lib, CUDA
# 12's in nvidia/cublas/lib), then a search of the disk (bounded: every second here is device
# time).
wheels="$(python3 -c 'import nvidia, os
for p in nvidia.__path__:
    print(os.path.join(p, "cu13", "lib")); print(os.path.join(p, "cublas", "lib"))' 2>/dev/null)"
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib $wheels; do
  if [[ -n "$d" ]] && has_cublas "$d"; then cublas="$d"; break; fi
done
if [[ -z "$cublas" ]]; then
  for d in $(timeout 60 find / -xdev \( -path /proc -o -path /sys -o -path "$dir" \) -prune -o \
               -name 'libcublasLt.so.13*' -printf '%h\n' 2>/dev/null | sort -u); do
    if has_cublas "$d"; then cublas="$d"; break; fi
  done
fi
if [[ -z "$cublas" ]]; then
  echo "device_run: no libcublas.so.13 / libcublasLt.so.13 on this machine (CUDA 13's cuBLAS)" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$dir/lib:$cublas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVWIRE_SHARED_DIR="$dir/shared"
export KVWIRE_SOURCE_DIR="$root"
export PATH="$dir/bin:$PATH"

cmd="$1"
shift
case "$cmd" in
  env)
    cat "$dir/manifest"
    echo "cuBLAS from $cublas"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv,noheader || true
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(nproc) threads)," \
         "avx2 $(grep -qw avx2 /proc/cpuinfo && echo yes || echo no)"
    missing=$(ldd "$dir"/bin/* | grep 'not found' | sort -u || true)
    if [[ -n "$missing" ]]; then
      echo "missing libraries:"
      echo "$missing"
      exit 1
    fi
    echo "every bundled binary's libraries resolve"
    ;;
  tests)
    status=0
    for t in "$dir"/bin/*_test; do
      echo "=== $(basename "$t")"
      "$t" --gtest_brief=1 "$@" || status=1
    done
    exit $status
    ;;
  *)
    [[ -x "$dir/bin/$cmd" ]] || { echo "device_run: no bundled binary '$cmd' ($(ls "$dir/bin" | tr '\n' ' '))" >&2; exit 2; }
    exec "$dir/bin/$cmd" "$@"
    ;;
esac
