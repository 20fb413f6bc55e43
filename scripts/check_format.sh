#!/usr/bin/env bash
# Fails when a tracked C++/CUDA file differs from what clang-format (the repository's
# .clang-format: Google base, 100 columns) makes of it; prints the offending files.
# Fix with: git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check_format: clang-format is not installed (scripts/install_deps.sh installs it)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "check_format: ${#bad[@]} file(s) not formatted with $(clang-format --version | head -1):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "run: git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
