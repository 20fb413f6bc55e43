#!/usr/bin/env bash
# guidellm (the load tool vLLM's docs recommend; pinned, 0.8.1) against the local cluster's
# OpenAI front, as a user would point it at a vLLM server: completions and chat, streamed and
# not, synthetic prompts, then its multi-turn synthetic scenario (each turn's prompt carries the
# conversation so far). The table gives, per run, the requests that succeeded and failed and the
# median TTFT and inter-token latency guidellm measured, then the multi-turn run turn by turn
# (requests that found a cached prefix, mean prompt and cached tokens); the run fails when any
# request failed.
# A benchmark, not a CI test (it installs guidellm from PyPI into a venv of its own).
#
#   bash bench/guidellm_bench.sh [--build-dir build] [--model ../shared/models/stories260K-hf]
#       [--requests 40] [--streams 4] [--turns 3] [--base-port 18180] [--venv build/guidellm-venv]
#       [--dir D (logs and guidellm's JSON; a new temporary directory by default)]
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$REPO/build"
MODEL="$REPO/../shared/models/stories260K-hf"
REQUESTS=40
STREAMS=4
TURNS=3
BASE_PORT=18180
VENV=""
DIR=""
GUIDELLM_VERSION=0.8.1

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --build-dir) BUILD=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --streams) STREAMS=$2; shift 2 ;;
    --turns) TURNS=$2; shift 2 ;;
    --base-port) BASE_PORT=$2; shift 2 ;;
    --venv) VENV=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "guidellm_bench: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
for n in "$REQUESTS" "$STREAMS" "$TURNS" "$BASE_PORT"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "guidellm_bench: '$n' is not a positive integer" >&2; exit 2; }
done
[[ -d "$MODEL" && -f "$MODEL/tokenizer.json" ]] || {
  echo "guidellm_bench: --model must be a model folder with tokenizer.json (guidellm counts" \
    "tokens with it); got '$MODEL'" >&2
  exit 2
}
VENV=${VENV:-$BUILD/guidellm-venv}
DIR=${DIR:-$(mktemp -d /tmp/kvwire-guidellm-XXXX)}
mkdir -p "$DIR"

if ! "$VENV/bin/guidellm" --version 2>/dev/null | grep -q "$GUIDELLM_VERSION"; then
  echo "guidellm_bench: installing guidellm $GUIDELLM_VERSION into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "guidellm==$GUIDELLM_VERSION" >"$DIR/pip.log" 2>&1 || {
    echo "guidellm_bench: pip install guidellm==$GUIDELLM_VERSION failed ($DIR/pip.log)" >&2
    exit 1
  }
fi

cluster() { bash "$REPO/deploy/local/cluster.sh" "$@" --dir "$DIR/cluster"; }
trap 'cluster stop >/dev/null 2>&1 || true' EXIT
cluster start --base-port "$BASE_PORT" --model "$MODEL" --build-dir "$BUILD" >"$DIR/cluster.log" 2>&1
cluster wait-ready --timeout 120 >>"$DIR/cluster.log" 2>&1
FRONT="http://127.0.0.1:$((BASE_PORT + 9))"
SERVED=$(curl -sf "$FRONT/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')

# run NAME FORMAT STREAM DATA: one guidellm benchmark of REQUESTS requests, STREAMS at a time.
run() {
  local name=$1 format=$2 stream=$3 data=$4
  "$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$FRONT,model=$SERVED,request_format=$format,stream=$stream" \
    --profile "kind=concurrent,streams=$STREAMS" \
    --data "$data" \
    --tokenizer "kind=hf_auto,model=$MODEL" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --output "kind=json,path=$DIR/$name.json" \
    --disable-console-interactive >"$DIR/$name.log" 2>&1 || {
    echo "guidellm_bench: guidellm failed on $name ($DIR/$name.log)" >&2
    return 1
  }
}

synthetic="kind=synthetic_text,prompt_tokens=64,output_tokens=16"
names=()
for format in /v1/completions /v1/chat/completions; do
  for stream in true false; do
    name="$([[ $format == */chat/* ]] && echo chat || echo completions)-$([[ $stream == true ]] && echo streamed || echo whole)"
    run "$name" "$format" "$stream" "$synthetic"
    names+=("$name")
  done
done
# The prefill nodes' prefix cache counters (metrics ports BASE+5 and BASE+7), before and after
# the multi-turn run: the share of its prompt tokens read from a cache.
prefix_tokens() {
  local hit=0 miss=0 port text
  for port in $((BASE_PORT + 5)) $((BASE_PORT + 7)); do
    text=$(curl -sf "http://127.0.0.1:$port/metrics")
    hit=$((hit + $(awk '/^kvwire_prefix_cache_hit_tokens_total/ {printf "%d", $2}' <<<"$text")))
    miss=$((miss + $(awk '/^kvwire_prefix_cache_miss_tokens_total/ {printf "%d", $2}' <<<"$text")))
  done
  echo "$hit $miss"
}
read -r hit0 miss0 < <(prefix_tokens)
run multiturn /v1/chat/completions true \
  "kind=synthetic_text,prompt_tokens=48,output_tokens=16,turns=$TURNS,prefix_tokens=16,prefix_count=2"
names+=(multiturn)
read -r hit1 miss1 < <(prefix_tokens)

echo "guidellm $GUIDELLM_VERSION against $FRONT ($SERVED), $REQUESTS requests per run," \
  "$STREAMS at a time; logs and JSON in $DIR"
echo "multiturn: $((hit1 - hit0)) of $((hit1 - hit0 + miss1 - miss0)) prompt tokens read from the" \
  "prefill nodes' prefix caches"
python3 - "$DIR" "${names[@]}" <<'EOF'
import json, sys

folder, names = sys.argv[1], sys.argv[2:]
print(f"{'run':<26}{'ok':>5}{'failed':>8}{'incomplete':>12}{'prompt p50':>12}"
      f"{'ttft_ms p50':>13}{'itl_ms p50':>12}")
bad = 0
for name in names:
    bench = json.load(open(f"{folder}/{name}.json"))["benchmarks"][0]["metrics"]
    totals = bench["request_totals"]
    prompt = bench["prompt_token_count"]["successful"].get("median")
    # Not streamed, the first token comes with the last: guidellm has no TTFT of its own then.
    ttft = bench["time_to_first_token_ms"]["successful"].get("median") if "whole" not in name else None
    itl = bench["inter_token_latency_ms"]["successful"].get("median")
    show = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"
    print(f"{name:<26}{totals['successful']:>5}{totals['errored']:>8}{totals['incomplete']:>12}"
          f"{show(prompt):>12}{show(ttft):>13}{show(itl if ttft is not None else None):>12}")
    bad += totals["errored"] + totals["incomplete"] + (totals["successful"] == 0)

# The multi-turn run turn by turn: guidellm keeps each request's turn and the usage the front
# returned (usage.prompt_tokens_details.cached_tokens, vLLM's field).
turns = {}
for r in json.load(open(f"{folder}/multiturn.json"))["benchmarks"][0]["requests"]["successful"]:
    t = turns.setdefault(r["info"]["turn_index"], [0, 0, 0, 0])
    cached = r["input_metrics"].get("cached_tokens") or 0
    t[0] += 1
    t[1] += cached > 0
    t[2] += r["input_metrics"]["text_tokens"]
    t[3] += cached
print(f"\n{'multiturn turn':<16}{'requests':>9}{'hit':>6}{'prompt tokens':>15}{'cached tokens':>15}")
for turn in sorted(turns):
    n, hit, prompt, cached = turns[turn]
    print(f"{turn + 1:<16}{n:>9}{hit:>6}{prompt / n:>15.1f}{cached / n:>15.1f}")
sys.exit(1 if bad else 0)
EOF
