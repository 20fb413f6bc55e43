#!/usr/bin/env bash
# The main job: builds kvwire, starts a local cluster (nginx router, 2 decode nodes, 2 prefill
# nodes; deploy/local/cluster.sh), and sends Generate calls through the router with the
# Python client: the text streams, then a table shows per request how many bytes of KV cache
# crossed the wire against what the full cache would have needed; then one request through the
# OpenAI-compatible front (POST /v1/completions). Uses the real tiny model in
# ../shared when present (else a synthetic one). The cluster is stopped on exit.
#
# Ports: router 8080 and the defaults listed by `deploy/local/cluster.sh --help`; set
# KVWIRE_BASE_PORT=N (ten ports from N) or the KVWIRE_*_PORT variables if they are taken.
# KVWIRE_SKIP_BUILD=1 reruns it without installing and building again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${KVWIRE_SKIP_BUILD:-0} != 1 ]]; then
  bash scripts/install_deps.sh
  bash scripts/build.sh
fi

PY=/usr/bin/python3
RUN_DIR=build/demo-cluster
CLUSTER=(deploy/local/cluster.sh)
START_ARGS=(--dir "$RUN_DIR")

MODEL=../shared/models/stories260K-hf
DATA=../shared/data/stories/dev.jsonl
if [[ -f $MODEL/config.json ]]; then
  echo "== model: $MODEL (real, stories260K: 5 layers, 4 KV heads of 8 dims, 512-token context)"
else
  MODEL=synthetic:stories
  echo "== ../shared not found: model $MODEL (random weights of the same shape: the text is noise)"
fi
START_ARGS+=(--model "$MODEL")

stop_cluster() {
  if [[ -f $RUN_DIR/nodes ]]; then "${CLUSTER[@]}" stop --dir "$RUN_DIR" >/dev/null || true; fi
}
trap stop_cluster EXIT
echo "== starting the local cluster in $RUN_DIR"
"${CLUSTER[@]}" start "${START_ARGS[@]}"
"${CLUSTER[@]}" wait-ready --dir "$RUN_DIR" --timeout 60
ROUTER=$(awk '$2 == "router" {print $3}' "$RUN_DIR/nodes")
TARGET="$(cat "$RUN_DIR/host"):$ROUTER"

# One short prompt (shorter than the budget: sent whole) and two long ones (353-469 tokens
# from the fidelity set; compressed to 64 tokens per KV head).
SHORT="Once upon a time, there was a little girl named Lily."
if [[ -f $DATA && $MODEL != synthetic:* ]]; then
  mapfile -d '' -t LONG < <("$PY" -c 'import json, sys
for line in list(open(sys.argv[1]))[:2]: print(json.loads(line)["prompt"], end="\0")' "$DATA")
else
  # The synthetic model's tokenizer has one token per byte: about 350 and 280 tokens.
  story="The little dog ran to the park with his ball and played with a big red kite all day. "
  LONG=("$story$story$story$story" "$story$story${story}Then he went home.")
fi

CLIENT=("$PY" tools/kvwire_client.py --target "$TARGET" --max-tokens 40)
echo
echo "== 3 requests through the router ($TARGET), SnapKV, 64 tokens kept per KV head"
"${CLIENT[@]}" --policy snapkv --budget 64 --prompt "$SHORT" --prompt "${LONG[0]}" --prompt "${LONG[1]}"
echo
echo "== the first long prompt again with the full cache, for comparison"
"${CLIENT[@]}" --policy full --prompt "${LONG[0]}"
echo
OPENAI="http://$(cat "$RUN_DIR/host"):$(awk '$2 == "openai" {print $3}' "$RUN_DIR/nodes")"
MODEL_ID=$(curl -s "$OPENAI/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "== the same through the OpenAI-compatible front ($OPENAI/v1): POST /v1/completions,"
echo "   SnapKV at 64 tokens as extra body fields; kvwire's figures are in usage.kvwire"
BODY=$("$PY" -c 'import json, sys
print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2], "max_tokens": 40, "temperature": 0,
                  "kv_policy": "snapkv", "kv_budget": 64}))' "$MODEL_ID" "${LONG[0]}")
echo "\$ curl $OPENAI/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"$MODEL_ID\", \"prompt\": ..., \"kv_policy\": \"snapkv\", \"kv_budget\": 64}'"
curl -s "$OPENAI/v1/completions" -H 'Content-Type: application/json' -d "$BODY" | "$PY" -c '
import json, sys
r = json.load(sys.stdin)
if "error" in r:
  sys.exit("error: %s" % r["error"])
k = r["usage"]["kvwire"]
print("text: %r" % r["choices"][0]["text"])
print("finish_reason %s, prompt %d tokens, completion %d tokens" % (r["choices"][0]["finish_reason"],
      r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]))
print("usage.kvwire: full cache %d bytes, wire %d bytes (%.1fx fewer), transfer %.1f ms, TTFT %.1f ms "
      "(decode node) / %.1f ms (front), policy %s" % (k["full_cache_bytes"], k["wire_bytes"],
      k["compression_ratio"], k["transfer_ms"], k["ttft_ms"], k["front_ttft_ms"], k["policy"]))'
echo "   (any OpenAI client works: openai.OpenAI(base_url=\"$OPENAI/v1\", api_key=\"unused\"))"
echo
echo "== done: logs and traces in $RUN_DIR; the cluster is stopped on exit"
