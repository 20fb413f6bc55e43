#!/usr/bin/env bash
# The serving benchmark: starts the local cluster (nginx router, 2 decode + 2 prefill nodes),
# drives it through the router with N concurrent clients for each compression setting in one
# run (requests/s, TTFT and inter-token latency percentiles, full-cache vs wire bytes), then
# checks layer-wise streaming on a model with a long prompt: time to first token through the
# pair against the prefill node's own forward time.
#
#   bash bench/run_serving_bench.sh [--concurrency 8] [--requests 64]
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=8
REQUESTS=64
while [[ $# -gt 0 ]]; do
  case $1 in
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
BENCH=build/bench/serving_bench
[[ -x $BENCH ]] || { echo "build first: bash scripts/build.sh" >&2; exit 1; }
RUN=$(mktemp -d /tmp/kvwire-bench-XXXX)
BASE=${KVWIRE_BASE_PORT:-18400}
stop() { deploy/local/cluster.sh stop --dir "$RUN/cluster" >/dev/null 2>&1 || true; }
trap stop EXIT

DATA=../shared/data/stories/dev.jsonl
MODEL=../shared/models/stories260K-hf
[[ -f $MODEL/config.json ]] || { MODEL=synthetic:stories; DATA=; }
echo "== throughput and latency through the router: $MODEL, $CONCURRENCY clients, $REQUESTS requests per setting"
deploy/local/cluster.sh start --dir "$RUN/cluster" --base-port "$BASE" --model "$MODEL" >/dev/null
deploy/local/cluster.sh wait-ready --dir "$RUN/cluster" >/dev/null
"$BENCH" --target "127.0.0.1:$BASE" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
  --max-tokens 32 ${DATA:+--data "$DATA"} --settings full,snapkv:64,snapkv_pp:64,chunkkv:64,snapkv:32
stop

# Long prompts need a model with a long context: 8 layers of hidden 1024 (92M parameters).
LONG="synthetic:llama-1b,layers=8,hidden=1024,heads=16,kv_heads=4,head_dim=64,ffn=2816,vocab=2048,dtype=f32,context=8192"
echo
echo "== layer-wise streaming: TTFT through the pair vs the prefill node's forward time, 2048-token prompts"
deploy/local/cluster.sh start --dir "$RUN/cluster" --base-port "$BASE" --model "$LONG" >/dev/null
deploy/local/cluster.sh wait-ready --dir "$RUN/cluster" --timeout 120 >/dev/null
"$BENCH" --target "127.0.0.1:$BASE" --ttft-prompt 2048 --vocab 2048 --requests 3 --settings full,snapkv:256
