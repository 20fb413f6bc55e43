#!/usr/bin/env bash
# The main job: builds kvwire and generates a story with the real tiny model in
# ../shared (or a synthetic model when ../shared is absent), streaming the text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
MODEL=../shared/models/stories260K-hf
if [[ -f "$MODEL/config.json" ]]; then
  echo "== model: $MODEL (real, stories260K)"
else
  MODEL=synthetic:stories
  echo "== ../shared not found: using $MODEL (random weights, so the text is noise)"
fi
build/tools/kvwire generate --model "$MODEL" \
  --prompt "Once upon a time, there was a little girl named Lily." --max-tokens 96
