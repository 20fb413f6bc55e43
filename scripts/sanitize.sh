#!/usr/bin/env bash
# Builds the tests with a sanitizer and runs them (docs/robustness.md, "Sanitizers"):
#
#   bash scripts/sanitize.sh address [CTEST_ARGS...]   # ASan + UBSan, every test executable
#   bash scripts/sanitize.sh thread  [CTEST_ARGS...]   # TSan, the executables with threads
#
# Each has its own build folder (build-asan, build-tsan; KVWIRE_SANITIZE in CMakeLists.txt)
# with line tables: `address` at -O1 with the system compiler, for AVX2 (not -march=native);
# `thread` at -O2 with clang-16 (its ignorelist leaves gRPC's headers uninstrumented:
# tests/sanitizers/tsan_ignore.txt). Every report fails the test that made it
# (-fno-sanitize-recover, halt_on_error). `thread` runs
# the executables whose tests start threads of our own: the engines (the decode batch
# thread and its prefill retries, the prefill workers and queue, with fake transports), the
# kernels' thread pool and telemetry. The two services in process with real gRPC servers
# are not in its default set: Debian's gRPC is not built with TSan, and its handoffs
# between threads still show as races in the standard library code its headers call out
# of line (docs/robustness.md, "Sanitizers"); KVWIRE_SANITIZE_TESTS=decode_service_test
# runs them anyway.
# KVWIRE_SANITIZE_TESTS overrides the executables chosen (a ctest label regex).
set -euo pipefail
cd "$(dirname "$0")/.."

KIND="${1:-}"
shift || true
EXCLUDE=()
case "$KIND" in
  address)
    BUILD=build-asan
    LABELS="${KVWIRE_SANITIZE_TESTS:-_test\$}"
    ;;
  thread)
    BUILD=build-tsan
    LABELS="${KVWIRE_SANITIZE_TESTS:-^(engine_test|kernels_test|telemetry_test)\$}"
    # The passkey pair test checks answers over 150 prompts and adds no concurrency of its
    # own; under TSan it takes many minutes.
    EXCLUDE=(-E '^PasskeyPairTest\.')
    export CC="${KVWIRE_TSAN_CC:-clang-16}" CXX="${KVWIRE_TSAN_CXX:-clang++-16}"
    ;;
  *)
    echo "usage: scripts/sanitize.sh address|thread [CTEST_ARGS...]" >&2
    exit 2
    ;;
esac

JOBS="${KVWIRE_JOBS:-2}"
# `address` targets plain AVX2 (KVWIRE_NATIVE=OFF), so the kernels' AVX2 paths are tested
# too where the Release build takes AVX-512 (kernels/gemm_few_rows.cc).
native=ON
[[ "$KIND" == address ]] && native=OFF
cmake -S . -B "$BUILD" -DKVWIRE_SANITIZE="$KIND" -DKVWIRE_NATIVE="$native" \
  -DCMAKE_BUILD_TYPE=Debug >/dev/null
# The executables the label regex picks (ctest knows them only after a build, so they are
# matched here against the kvwire_test() calls instead).
mapfile -t TARGETS < <(grep -oE '^kvwire_test\([a-z_]+' tests/CMakeLists.txt | cut -d'(' -f2 |
                       grep -E "$LABELS")
if ((${#TARGETS[@]} == 0)); then
  echo "sanitize.sh: no test executable matches '$LABELS'" >&2
  exit 2
fi
build_start=$SECONDS
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"
echo "sanitize.sh: the $KIND build took $((SECONDS - build_start)) s"

# Reports name functions and lines: gcc's runtime (address) symbolizes by itself; clang's
# (thread) needs an external symbolizer, and Debian's clang-16 ships none, so binutils'
# addr2line, which it also speaks to.
symbolizer=""
for s in llvm-symbolizer-16 llvm-symbolizer addr2line; do
  if symbolizer="$(command -v "$s")"; then break; fi
done
supp="$PWD/tests/sanitizers"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$supp/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# ignore_noninstrumented_modules: the memcpy, epoll and the like that Debian's uninstrumented
# gRPC and Abseil call are their business (TSan cannot see the locks around them).
export TSAN_OPTIONS="${TSAN_OPTIONS:-ignore_noninstrumented_modules=1:halt_on_error=1:second_deadlock_stack=1${symbolizer:+:external_symbolizer_path=$symbolizer}}"

echo "== sanitize.sh $KIND: ${TARGETS[*]}"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" -L "$LABELS" "${EXCLUDE[@]}" "$@"
