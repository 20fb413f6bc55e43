#!/usr/bin/env bash
# Builds kvwire and runs every test: `bash scripts/test.sh`; then the unit and service tests
# again under ASan+UBSan and the threaded ones under TSan (scripts/sanitize.sh;
# KVWIRE_SANITIZE=0 skips them), and a short run of every fuzz target (scripts/fuzz.sh;
# KVWIRE_FUZZ_SECONDS per target, 15 by default, 0 skips it).
# Tests that need ../shared (models, data) skip with a message when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's wall time, printed as it ends and again at the end, so that a CI log says where
# its minutes went (CI must stay well inside its limit on two cores).
phases=""
timed() {  # timed NAME COMMAND...
  local name=$1 start=$SECONDS
  shift
  "$@"
  local secs=$((SECONDS - start))
  phases+="${phases:+, }$name $secs s"
  echo "test.sh: $name took $secs s"
}

timed install_deps bash scripts/install_deps.sh
timed build bash scripts/build.sh

# Regenerate the tokenizer oracle cases with the live Hugging Face tokenizers library, so
# the C++ tokenizer is checked against it, not only against the committed copy.
if .venv/bin/python -c "import tokenizers" >/dev/null 2>&1; then
  mkdir -p build/oracle
  .venv/bin/python tests/data/tokenizers/make_fixtures.py --cases-only --out build/oracle \
    && export KVWIRE_TOKENIZER_CASES="$PWD/build/oracle/cases.jsonl"
fi

timed ctest ctest --test-dir build --output-on-failure -j"${KVWIRE_JOBS:-2}" "$@"

# The same tests built with sanitizers (docs/robustness.md, "Sanitizers"): every gtest
# executable under ASan and UBSan, the threaded ones under TSan.
if [[ "${KVWIRE_SANITIZE:-1}" != 0 ]]; then
  timed asan bash scripts/sanitize.sh address
  timed tsan bash scripts/sanitize.sh thread
else
  echo "test.sh: sanitizer runs skipped (KVWIRE_SANITIZE=0)"
fi

# Coverage-guided fuzzing of the decoders of outside input (docs/fuzzing.md): its own
# instrumented build in build-fuzz, then each target briefly over its committed corpus.
fuzz_seconds="${KVWIRE_FUZZ_SECONDS:-15}"
if ((fuzz_seconds > 0)); then
  timed fuzz bash scripts/fuzz.sh "$fuzz_seconds"
else
  echo "test.sh: fuzzing skipped (KVWIRE_FUZZ_SECONDS=0)"
fi
echo "test.sh: phases: $phases, $SECONDS s in all"
