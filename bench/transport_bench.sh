#!/usr/bin/env bash
# KV transports side by side on one host: one prefill node serving grpc and shm
# (--kv-transport grpc,shm) and two decode nodes in front of it, one asking for each; prompts of
# each length go to them alternately (grpc, shm, grpc, shm, ...), one at a time, and the table
# gives, per transport, setting and length, the medians of the decode node's time from the
# first KV byte to the trailer (transfer_ms, which spans the layers the prefill computes after
# the first), its TTFT, and the prefill node's forward time. A benchmark, not a test.
#
#   bash bench/transport_bench.sh [--build-dir build] [--model synthetic:llama-1b] [--dtype bf16]
#       [--lengths 2048,8192] [--settings full,snapkv:128] [--rounds 2] [--threads 2]
#       [--vocab 32000 (prompt ids are drawn below it)]
#
# Logs and the raw lines go to --dir (a new temporary directory by default).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$REPO/build"
MODEL="synthetic:llama-1b"
DTYPE="bf16"
LENGTHS="2048,8192"
SETTINGS="full,snapkv:128"
ROUNDS=2
THREADS=2
VOCAB=32000
DIR=""
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) BUILD=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --lengths) LENGTHS=$2; shift 2 ;;
    --settings) SETTINGS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "transport_bench: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
PREFILL="$BUILD/prefill_service/kvwire-prefill"
DECODE="$BUILD/decode_service/kvwire-decode"
BENCH="$BUILD/bench/serving_bench"
for bin in "$PREFILL" "$DECODE" "$BENCH"; do
  [[ -x $bin ]] || { echo "transport_bench: $bin not built (bash scripts/build.sh)" >&2; exit 2; }
done
[[ -n $DIR ]] || DIR=$(mktemp -d /tmp/kvwire-transport-XXXX)
mkdir -p "$DIR"
BASE=${KVWIRE_BASE_PORT:-18600}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_port() {  # port log
  for _ in $(seq 1 1200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "transport_bench: nothing listens on port $1 after 120 s; see $2" >&2
  exit 1
}
"$PREFILL" --model "$MODEL" --dtype "$DTYPE" --threads "$THREADS" --workers 1 \
  --listen "127.0.0.1:$BASE" --metrics-listen "" --node-name prefill --kv-transport grpc,shm \
  --max-deadline-s 3600 >"$DIR/prefill.log" 2>&1 &
PIDS+=($!)
port=$BASE
for t in grpc shm; do
  port=$((port + 1))
  "$DECODE" --model "$MODEL" --dtype "$DTYPE" --threads "$THREADS" --listen "127.0.0.1:$port" \
    --metrics-listen "" --prefill "ipv4:127.0.0.1:$BASE" --kv-transport "$t" \
    --kv-pool-bytes 8GiB --max-chunk-bytes 4MiB --node-name "decode-$t" \
    --prefill-attempt-timeout-ms 3600000 >"$DIR/decode-$t.log" 2>&1 &
  PIDS+=($!)
done
wait_port "$BASE" "$DIR/prefill.log"
wait_port $((BASE + 1)) "$DIR/decode-grpc.log"
wait_port $((BASE + 2)) "$DIR/decode-shm.log"

echo "model $MODEL ($DTYPE), prompts of $LENGTHS tokens, settings $SETTINGS, $ROUNDS rounds;" \
  "logs in $DIR"
raw="$DIR/raw.tsv"
: >"$raw"
IFS=',' read -ra lengths <<<"$LENGTHS"
for len in "${lengths[@]}"; do
  for round in $(seq 1 "$ROUNDS"); do
    for t in grpc shm; do
      port=$((BASE + 1))
      [[ $t == shm ]] && port=$((BASE + 2))
      "$BENCH" --target "127.0.0.1:$port" --ttft-prompt "$len" --vocab "$VOCAB" --requests 1 \
        --settings "$SETTINGS" | awk -v t="$t" -v r="$round" \
        '$2 ~ /^[0-9]+$/ {print t "\t" r "\t" $1 "\t" $2 "\t" $3 "\t" $4 "\t" $5}' >>"$raw"
    done
  done
done
python3 - "$raw" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = {}
for t, _, setting, length, forward, transfer, ttft in rows:
  by.setdefault((int(length), setting, t), []).append((float(forward), float(transfer), float(ttft)))
print(f"{'prompt':>7} {'setting':<12} {'transport':<9} {'n':>2} {'forward_ms':>11} "
      f"{'transfer_ms':>12} {'ttft_ms':>9} {'transfer vs grpc':>17}")
for (length, setting, t), v in sorted(by.items()):
  med = [statistics.median(x[i] for x in v) for i in range(3)]
  base = by.get((length, setting, "grpc"))
  rel = med[1] / statistics.median(x[1] for x in base) if base else float("nan")
  print(f"{length:>7} {setting:<12} {t:<9} {len(v):>2} {med[0]:>11.1f} {med[1]:>12.1f} "
        f"{med[2]:>9.1f} {rel:>17.3f}")
PY
