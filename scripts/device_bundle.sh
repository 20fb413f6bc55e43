#!/usr/bin/env bash
# Builds kvwire's CUDA test and bench binaries here (Debian, the CUDA toolkit, sm_90 for the
# H100/H200) and packs them for a GPU machine that has the NVIDIA driver, cuBLAS (PyTorch's
# nvidia-cublas wheel) and glibc, but none of Debian's C++ libraries:
#
#   device-bundle.tar.gz
#     bin/      the binaries (list below)
#     lib/      every shared library they load that is not glibc's, the driver or cuBLAS
#               (found with ldd); cuBLAS is 600 MB, the GPU machine has its own
#     shared/   the models and data of ../shared that the tests read
#     manifest  what was built, from which commit, with which flags
#
# scripts/device_run.sh unpacks it on the GPU machine and runs the binaries there
# (README.md, "GPU"). Usage: scripts/device_bundle.sh [extra cmake -D flags]
#   KVWIRE_DEVICE_BUILD  the build folder (default build-device)
#   KVWIRE_CUDA_ARCH     CMAKE_CUDA_ARCHITECTURES (default 90)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVWIRE_DEVICE_BUILD:-$root/build-device}"
arch="${KVWIRE_CUDA_ARCH:-90}"
jobs="${KVWIRE_JOBS:-2}"
out="$root/device-bundle.tar.gz"
# The device tool carries 64 MiB in all: the bundle and the working tree that travels with it
# (tracked and untracked files git does not ignore).
tree=$(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null |
  awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024 - tree - 1024 * 1024))  # a MiB to spare

if [[ ! -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null; then
  echo "device_bundle: no nvcc (the CUDA toolkit); the bundle is a CUDA build" >&2
  exit 1
fi
shared="${KVWIRE_SHARED_DIR:-$root/../shared}"
if [[ ! -d "$shared/models/stories260K-hf" ]]; then
  echo "device_bundle: $shared/models/stories260K-hf not found (set KVWIRE_SHARED_DIR)" >&2
  exit 1
fi

# The GPU machine's CPU is not this one: AVX2 code paths (KVWIRE_NATIVE=OFF), not -march=native.
# -lineinfo: compute-sanitizer and ncu name the source line of a fault or a hot spot.
# Shared libraries: the kernels' device code (FlashInfer's FA2 and FA3 instantiations above all)
# is then in the bundle once, in libkvwire_kernels.so, not in each of its 15 binaries (linked
# statically they packed to 115 MiB, past what the device tool carries).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVWIRE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DKVWIRE_NATIVE=OFF -DKVWIRE_OPENAI_FRONT=OFF \
  -DBUILD_SHARED_LIBS=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
  -DCMAKE_CUDA_FLAGS="-lineinfo" "$@" >/dev/null
tests=(kernels_test model_test engine_test sparse_test compression_test decode_service_test
       prefill_service_test tools_test)
tools=(kvwire kvwire-prefill kvwire-decode engine_bench decode_bench gpu_bench serving_bench)
cmake --build "$build" -j"$jobs" --target "${tests[@]}" "${tools[@]}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/shared/models" "$stage/shared/data"
for t in "${tests[@]}" "${tools[@]}"; do
  f="$(find "$build" -type f -name "$t" -perm -u+x | head -1)"
  [[ -n "$f" ]] || { echo "device_bundle: $t was not built" >&2; exit 1; }
  cp "$f" "$stage/bin/"
done
strip --strip-unneeded "$stage"/bin/*

# Libraries: everything ldd resolves except glibc's own, the driver (libcuda, which must match
# the GPU machine's kernel module) and cuBLAS (found on the GPU machine by device_run.sh).
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libcuda|libcublas|libcublasLt)\.so'
ldd "$stage"/bin/* | awk '/=>/ && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -L "$path" "$stage/lib/$name"
  done
strip --strip-unneeded "$stage"/lib/* 2>/dev/null || true

cp -r "$shared/models/stories260K-hf" "$shared/models/passkey-induction-hf" "$stage/shared/models/"
cp -r "$shared/data/." "$stage/shared/data/"

{
  echo "commit $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "nvcc $("$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  echo "CMAKE_CUDA_ARCHITECTURES $arch, KVWIRE_NATIVE OFF"
  echo "bin: $(cd "$stage/bin" && echo *)"
  echo "lib: $(cd "$stage/lib" && echo *)"
} >"$stage/manifest"

tar -C "$stage" -czf "$out" .
size=$(stat -c %s "$out")
if ((size > limit)); then
  echo "device_bundle: $out is $((size >> 20)) MiB; with the working tree's $((tree >> 20))" \
       "MiB it is over the 64 MiB the device tool carries; bundle fewer binaries" >&2
  exit 1
fi
echo "device_bundle: $out, $((size >> 20)) MiB (the working tree $((tree >> 20)) MiB)"
cat "$stage/manifest"
