#!/usr/bin/env bash
# Builds the tests with a sanitizer and runs them (docs/robustness.md, "Sanitizers"):
#
#   bash scripts/sanitize.sh address [CTEST_ARGS...]   # ASan + UBSan, every test executable
#   bash scripts/sanitize.sh thread  [CTEST_ARGS...]   # TSan, the executables with threads
#
# Each has its own build folder (build-asan, build-tsan; KVWIRE_SANITIZE in CMakeLists.txt)
# with the system compiler, -O1 and line tables. Every report fails the test that made it
# (-fno-sanitize-recover, halt_on_error). `thread` runs the executables whose tests start
# threads: the engines (the decode batch thread, the prefill workers and queue), the two
# services in process with real gRPC servers, the kernels' thread pool and telemetry.
# KVWIRE_SANITIZE_TESTS overrides the executables chosen (a ctest label regex).
set -euo pipefail
cd "$(dirname "$0")/.."

KIND="${1:-}"
shift || true
case "$KIND" in
  address)
    BUILD=build-asan
    LABELS="${KVWIRE_SANITIZE_TESTS:-_test\$}"
    ;;
  thread)
    BUILD=build-tsan
    LABELS="${KVWIRE_SANITIZE_TESTS:-^(engine_test|decode_service_test|prefill_service_test|kernels_test|telemetry_test)\$}"
    ;;
  *)
    echo "usage: scripts/sanitize.sh address|thread [CTEST_ARGS...]" >&2
    exit 2
    ;;
esac

JOBS="${KVWIRE_JOBS:-2}"
cmake -S . -B "$BUILD" -DKVWIRE_SANITIZE="$KIND" -DCMAKE_BUILD_TYPE=Debug >/dev/null
# The executables the label regex picks (ctest knows them only after a build, so they are
# matched here against the kvwire_test() calls instead).
mapfile -t TARGETS < <(grep -oE '^kvwire_test\([a-z_]+' tests/CMakeLists.txt | cut -d'(' -f2 |
                       grep -E "$LABELS")
if ((${#TARGETS[@]} == 0)); then
  echo "sanitize.sh: no test executable matches '$LABELS'" >&2
  exit 2
fi
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"

# Reports name functions and lines with a symbolizer (any llvm-symbolizer; gcc's runtime
# also finds addr2line by itself).
for s in llvm-symbolizer /usr/lib/llvm-16/bin/llvm-symbolizer llvm-symbolizer-16; do
  if path="$(command -v "$s")"; then
    export ASAN_SYMBOLIZER_PATH="$path"
    break
  fi
done
supp="$PWD/tests/sanitizers"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$supp/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1}"

echo "== sanitize.sh $KIND: ${TARGETS[*]}"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" -L "$LABELS" "$@"
