#!/usr/bin/env bash
# Bytes made visible as time: a prefill node and a decode node in two network namespaces joined
# by a veth pair whose link `tc` shapes (netem: a rate and a little latency each way), a
# synthetic model whose KV is large beside its compute (the regime of a GPU prefill node), and
# serving_bench in the decode node's namespace printing TTFT and request throughput for each
# compression setting and KV format, at each link rate. A benchmark, not a test: it needs root
# (network namespaces, tc) and iproute2.
#
#   sudo bench/network_bench.sh [--build-dir build] [--rates 1gbit,10gbit] [--delay 0.1ms]
#       [--burst 4mb (the token bucket's, where the kernel has no netem)]
#       [--model SPEC] [--dtype bf16] [--prompt-tokens 512] [--max-tokens 4] [--requests 16]
#       [--concurrency 2] [--settings full,full@fp8,snapkv:64,snapkv:64@int4,...] [--threads 1]
#
# Every process it starts and the namespaces are removed on exit; logs go to --dir.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$REPO/build"
RATES="1gbit,10gbit"
DELAY="0.1ms"
BURST="4mb"
# 8 layers of 8 KV heads of 128 over a 256-wide residual and a 256-wide MLP: 32 KiB of bf16 KV
# per token for about 20 MFLOP of projections, so a prompt's KV is tens of MB while a CPU
# computes it in about a second.
MODEL="synthetic:tiny,layers=8,hidden=256,heads=8,kv_heads=8,head_dim=128,ffn=256,vocab=512,context=4096"
DTYPE="bf16"
PROMPT_TOKENS=512
MAX_TOKENS=4
REQUESTS=16
CONCURRENCY=2
THREADS=1
SETTINGS="full,full@bf16,full@fp8,full@int4,snapkv:64,snapkv:64@fp8,snapkv:64@int8,snapkv:64@int4"
DIR=""

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) BUILD=$2; shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --burst) BURST=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --prompt-tokens) PROMPT_TOKENS=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --settings) SETTINGS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "network_bench: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done

if [[ $(id -u) -ne 0 ]]; then
  echo "network_bench: needs root for network namespaces and tc (run it with sudo)" >&2
  exit 2
fi
for tool in ip tc; do
  command -v "$tool" >/dev/null || { echo "network_bench: $tool not found (Debian: iproute2)" >&2; exit 2; }
done
PREFILL="$BUILD/prefill_service/kvwire-prefill"
DECODE="$BUILD/decode_service/kvwire-decode"
BENCH="$BUILD/bench/serving_bench"
for bin in "$PREFILL" "$DECODE" "$BENCH"; do
  [[ -x "$bin" ]] || { echo "network_bench: $bin is not built (cmake --build $BUILD)" >&2; exit 2; }
done
DIR=${DIR:-$(mktemp -d /tmp/kvwire-netbench-XXXXXX)}
mkdir -p "$DIR"

# Names unique to this run, so that two runs (or a stale one) never collide.
TAG=$$
NS_P="kvw-p-$TAG"
NS_D="kvw-d-$TAG"
DEV_P="kvwp$TAG"
DEV_D="kvwd$TAG"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  ip netns del "$NS_P" 2>/dev/null || true
  ip netns del "$NS_D" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$NS_P"
ip netns add "$NS_D"
ip link add "$DEV_P" type veth peer name "$DEV_D"
ip link set "$DEV_P" netns "$NS_P"
ip link set "$DEV_D" netns "$NS_D"
ip -n "$NS_P" addr add 10.231.0.1/24 dev "$DEV_P"
ip -n "$NS_D" addr add 10.231.0.2/24 dev "$DEV_D"
for ns in "$NS_P" "$NS_D"; do ip -n "$ns" link set lo up; done
ip -n "$NS_P" link set "$DEV_P" up
ip -n "$NS_D" link set "$DEV_D" up

# Waits until a node answers its health check (serving_bench fails fast otherwise).
wait_port() {  # ns host port log
  for _ in $(seq 1 600); do
    if ip netns exec "$1" bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "network_bench: nothing listens on $2:$3 in $1 after 60 s; see $4" >&2
  exit 1
}

ip netns exec "$NS_P" "$PREFILL" --model "$MODEL" --dtype "$DTYPE" --threads "$THREADS" \
  --listen 10.231.0.1:50052 --metrics-listen "" --insecure --node-name prefill-bench \
  >"$DIR/prefill.log" 2>&1 &
PIDS+=($!)
ip netns exec "$NS_D" "$DECODE" --model "$MODEL" --dtype "$DTYPE" --threads "$THREADS" \
  --listen 127.0.0.1:50051 --metrics-listen "" --prefill ipv4:10.231.0.1:50052 \
  --kv-pool-bytes 4GiB --max-chunk-bytes 4MiB --node-name decode-bench \
  >"$DIR/decode.log" 2>&1 &
PIDS+=($!)
wait_port "$NS_P" 10.231.0.1 50052 "$DIR/prefill.log"
wait_port "$NS_D" 127.0.0.1 50051 "$DIR/decode.log"

echo "model $MODEL ($DTYPE), prompts of $PROMPT_TOKENS tokens, $MAX_TOKENS generated," \
  "$REQUESTS requests, $CONCURRENCY at once; logs in $DIR"
IFS=',' read -ra rates <<<"$RATES"
for rate in "${rates[@]}"; do
  shaped="$rate, $DELAY each way (netem)"
  for end in "$NS_P $DEV_P" "$NS_D $DEV_D"; do
    read -r ns dev <<<"$end"
    if ! tc -n "$ns" qdisc replace dev "$dev" root netem delay "$DELAY" rate "$rate" limit 100000 \
        2>/dev/null; then
      # Kernels without sch_netem: the rate alone, by a token bucket whose burst holds ~4 ms.
      tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$BURST" latency 50ms
      shaped="$rate (tbf, burst $BURST; no added latency: this kernel has no netem)"
    fi
  done
  echo
  echo "== link $shaped"
  ip netns exec "$NS_D" "$BENCH" --target 127.0.0.1:50051 \
    --concurrency "$CONCURRENCY" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
    --settings "$SETTINGS" --prompt-tokens "$PROMPT_TOKENS"
done
