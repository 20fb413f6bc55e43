#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ into build-fuzz (clang-16, ASan and UBSan, with
# KVWIRE_FUZZ=ON) and runs each for a bounded time over a scratch copy of its committed seed
# corpus (fuzz/corpus/<target>/; the committed corpus is never grown here):
#
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# SECONDS_PER_TARGET defaults to $KVWIRE_FUZZ_SECONDS, else 60; TARGETs default to all eight,
# run $KVWIRE_JOBS (2) at a time.
# Prints each target's final libFuzzer line (executions, cov, ft, exec/s). Exits nonzero when
# a target finds a crash, a sanitizer report, a leak, an input slower than 10 s or one that
# needs more than 2 GiB; the input libFuzzer kept is named in the output
# (build-fuzz/artifacts/<target>/crash-..., reproduce with: build-fuzz/fuzz/<target> FILE).
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET="${1:-${KVWIRE_FUZZ_SECONDS:-60}}"
shift || true
TARGETS=("$@")
if ((${#TARGETS[@]} == 0)); then
  TARGETS=(kv_stream_fuzz safetensors_fuzz model_config_fuzz tokenizer_load_fuzz
           tokenizer_encode_fuzz generate_request_fuzz prefill_request_fuzz openai_body_fuzz)
fi
CC_BIN="${KVWIRE_FUZZ_CC:-clang-16}"
CXX_BIN="${KVWIRE_FUZZ_CXX:-clang++-16}"
BUILD=build-fuzz

# libFuzzer's runtime comes with clang (Debian: clang-16 and libclang-rt-16-dev, which
# scripts/install_deps.sh installs); without it this fails, it does not skip.
if ! command -v "$CXX_BIN" >/dev/null; then
  echo "fuzz.sh: $CXX_BIN not found; scripts/install_deps.sh installs clang-16" >&2
  exit 1
fi
probe_dir="$(mktemp -d)"
trap 'rm -rf "$probe_dir"' EXIT
printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' \
  >"$probe_dir/probe.cc"
if ! "$CXX_BIN" -fsanitize=fuzzer,address,undefined "$probe_dir/probe.cc" -o "$probe_dir/probe" \
  >"$probe_dir/log" 2>&1; then
  cat "$probe_dir/log" >&2
  echo "fuzz.sh: $CXX_BIN cannot link libFuzzer with ASan/UBSan; install libclang-rt-16-dev" \
    "(scripts/install_deps.sh does)" >&2
  exit 1
fi

# Sanitizer reports name functions and lines when an llvm-symbolizer (any version) is found;
# the runtime does not look for one under a versioned name by itself.
for s in /usr/lib/llvm-16/bin/llvm-symbolizer llvm-symbolizer-16 llvm-symbolizer \
         llvm-symbolizer-15 llvm-symbolizer-14; do
  if path="$(command -v "$s")"; then
    export ASAN_SYMBOLIZER_PATH="$path"
    break
  fi
done
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
[[ -n "${ASAN_SYMBOLIZER_PATH:-}" ]] ||
  echo "fuzz.sh: no llvm-symbolizer found; sanitizer stacks will show addresses only" >&2

JOBS="${KVWIRE_JOBS:-2}"
CC="$CC_BIN" CXX="$CXX_BIN" cmake -S . -B "$BUILD" -DKVWIRE_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug \
  >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"

# One target a core at a time (each libFuzzer run is one process): the report of each goes to
# its own file and is printed in the targets' order once all have run.
run_target() {  # run_target TARGET: its report on stdout; nonzero when it failed
  local t=$1
  local work="$BUILD/corpus-run/$t" artifacts="$BUILD/artifacts/$t"
  rm -rf "$work"
  mkdir -p "$work" "$artifacts"
  cp -r "fuzz/corpus/$t/." "$work/"
  local args=(-max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -timeout=10
              -print_final_stats=1 -artifact_prefix="$artifacts/")
  local dict="fuzz/dict/${t%_fuzz}.dict"
  [[ "$t" == tokenizer_load_fuzz ]] && dict=fuzz/dict/tokenizer.dict
  [[ "$t" == *_request_fuzz ]] && dict=fuzz/dict/request.dict
  [[ -f "$dict" ]] && args+=(-dict="$dict")
  local log="$BUILD/artifacts/$t.log"
  echo "== $t: ${SECONDS_PER_TARGET}s over $(ls "$work" | wc -l) seeds"
  local rc=0
  "$BUILD/fuzz/$t" "${args[@]}" "$work" >"$log" 2>&1 || rc=$?
  if ((rc == 0)); then
    grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 | sed "s/^/$t: /"
  else
    tail -n 80 "$log"
    echo "$t: FAILED (exit $rc); the input is named above ('Test unit written to'), log: $log"
  fi
  return "$rc"
}

mkdir -p "$BUILD/artifacts"
for t in "${TARGETS[@]}"; do
  rm -f "$BUILD/artifacts/$t.report" "$BUILD/artifacts/$t.failed"
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  { run_target "$t" >"$BUILD/artifacts/$t.report" 2>&1 || touch "$BUILD/artifacts/$t.failed"; } &
done
wait
failed=()
for t in "${TARGETS[@]}"; do
  cat "$BUILD/artifacts/$t.report"
  [[ -e "$BUILD/artifacts/$t.failed" ]] && failed+=("$t")
done
if ((${#failed[@]})); then
  echo "fuzz.sh: ${#failed[@]} target(s) failed: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: ${#TARGETS[@]} target(s), ${SECONDS_PER_TARGET}s each, no crash"
