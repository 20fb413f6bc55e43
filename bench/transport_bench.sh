#!/usr/bin/env bash
# KV transports side by side on one host: one prefill node serving them all (grpc and shm on the
# CPU; grpc, cuda_ipc and nccl with --backend cuda) and a decode node per transport in front of it;
# prompts of each length go to them alternately (grpc, shm, grpc, shm, ...), one at a time, and
# the table
# gives, per transport, setting and length, the medians of the decode node's time from the
# first KV byte to the trailer (transfer_ms, which spans the layers the prefill computes after
# the first), its TTFT, the prefill node's forward time, and TTFT less the forward (beyond_ms:
# what the transfer and the nodes add to compute). A benchmark, not a test.
#
#   bash bench/transport_bench.sh [--build-dir build] [--model synthetic:llama-1b] [--dtype bf16]
#       [--lengths 2048,8192] [--settings full,snapkv:128] [--rounds 2] [--threads 2]
#       [--vocab 32000 (prompt ids are drawn below it)] [--backend cpu|cuda|guarded]
#       [--transports grpc,shm (cpu) | grpc,cuda_ipc (cuda, guarded; or nccl, which on cuda
#        needs a second GPU: NCCL refuses two ranks on one)] [--tokens 8]
#       [--pool-bytes 8GiB (N, NKiB, NMiB or NGiB: each decode node's KV pool; shm keeps it in /dev/shm)]
#
# Every request is greedy and generates --tokens tokens (the first sampled on the prefill node,
# the rest decoded over the cache the transport moved), so the transports must give the same
# tokens: the table's `tokens` column says whether they did (same/DIFF), per length and setting,
# and the run fails when they did not.
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
BACKEND=cpu
TRANSPORTS=""
TOKENS=8
POOL=8GiB
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
    --backend) BACKEND=$2; shift 2 ;;
    --transports) TRANSPORTS=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --pool-bytes) POOL=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "transport_bench: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
case "$BACKEND" in
  cpu) TRANSPORTS=${TRANSPORTS:-grpc,shm} ;;
  # guarded: the device path without a GPU, its IPC (and nccl's links) emulated between the
  # processes.
  cuda|guarded) TRANSPORTS=${TRANSPORTS:-grpc,cuda_ipc} ;;
  *) echo "transport_bench: --backend must be cpu, cuda or guarded, got '$BACKEND'" >&2; exit 2 ;;
esac
IFS=',' read -ra transports <<<"$TRANSPORTS"
if [[ ",$TRANSPORTS," == *,shm,* ]]; then
  # A decode node on shm keeps its whole pool in /dev/shm and refuses to start without room.
  pool=$(python3 -c "import sys; n, u = sys.argv[1], {'KiB': 1 << 10, 'MiB': 1 << 20, 'GiB': 1 << 30}
print(int(n[:-3]) * u[n[-3:]] if n[-3:] in u else int(n))" "$POOL")
  room=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  if [[ -z $room || $room -lt $pool ]]; then
    echo "SKIP: /dev/shm has ${room:-no} bytes free for a $POOL shm pool (--pool-bytes)"
    exit 0
  fi
fi
# A build folder's binaries, or a device bundle's (every binary in one folder).
bin_of() { if [[ -x "$BUILD/$1" ]]; then echo "$BUILD/$1"; else echo "$BUILD/$(basename "$1")"; fi; }
PREFILL=$(bin_of prefill_service/kvwire-prefill)
DECODE=$(bin_of decode_service/kvwire-decode)
BENCH=$(bin_of bench/serving_bench)
for bin in "$PREFILL" "$DECODE" "$BENCH"; do
  [[ -x $bin ]] || { echo "transport_bench: $bin not built (bash scripts/build.sh)" >&2; exit 2; }
done
[[ -n $DIR ]] || DIR=$(mktemp -d /tmp/kvwire-transport-XXXX)
mkdir -p "$DIR"
BASE=${KVWIRE_BASE_PORT:-18600}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_port() {  # port log pid: a node that exits (its device refused, say) fails at once
  for _ in $(seq 1 1200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then
      echo "transport_bench: the node for port $1 exited before it listened; the end of $2:" >&2
      tail -n 5 "$2" >&2
      exit 1
    fi
    sleep 0.1
  done
  echo "transport_bench: nothing listens on port $1 after 120 s; see $2" >&2
  exit 1
}
"$PREFILL" --model "$MODEL" --dtype "$DTYPE" --threads "$THREADS" --workers 1 \
  --backend "$BACKEND" --listen "127.0.0.1:$BASE" --metrics-listen "" --node-name prefill \
  --kv-transport "$TRANSPORTS" --max-deadline-s 3600 >"$DIR/prefill.log" 2>&1 &
PIDS+=($!)
prefill_pid=$!
port=$BASE
for t in "${transports[@]}"; do
  port=$((port + 1))
  "$DECODE" --model "$MODEL" --dtype "$DTYPE" --threads "$THREADS" --listen "127.0.0.1:$port" \
    --backend "$BACKEND" --metrics-listen "" --prefill "ipv4:127.0.0.1:$BASE" \
    --kv-transport "$t" --kv-pool-bytes "$POOL" --max-chunk-bytes 4MiB --node-name "decode-$t" \
    --prefill-attempt-timeout-ms 3600000 >"$DIR/decode-$t.log" 2>&1 &
  PIDS+=($!)
done
wait_port "$BASE" "$DIR/prefill.log" "$prefill_pid"
port=$BASE
for i in "${!transports[@]}"; do
  port=$((port + 1))
  wait_port "$port" "$DIR/decode-${transports[$i]}.log" "${PIDS[$((i + 1))]}"
done

echo "model $MODEL ($DTYPE) on $BACKEND, transports $TRANSPORTS, prompts of $LENGTHS tokens," \
  "settings $SETTINGS, $ROUNDS rounds; logs in $DIR"
raw="$DIR/raw.tsv"
: >"$raw"
failed=0
IFS=',' read -ra lengths <<<"$LENGTHS"
for len in "${lengths[@]}"; do
  for round in $(seq 1 "$ROUNDS"); do
    port=$BASE
    for t in "${transports[@]}"; do
      port=$((port + 1))
      # A failed request is reported and the run goes on: the other transports' rows still
      # make the table. Each row is printed as it comes, for a run cut off by a timeout.
      if ! "$BENCH" --target "127.0.0.1:$port" --ttft-prompt "$len" --vocab "$VOCAB" --requests 1 \
        --ttft-max-tokens "$TOKENS" --settings "$SETTINGS" | awk -v t="$t" -v r="$round" \
        '$2 ~ /^[0-9]+$/ {print t "\t" r "\t" $1 "\t" $2 "\t" $5 "\t" $6 "\t" $7 "\t" $10}' \
        >"$DIR/request.tsv"; then
        echo "transport_bench: $t, $len tokens, round $round: serving_bench failed (see above)" >&2
        failed=1
      fi
      tee -a "$raw" <"$DIR/request.tsv"
    done
  done
done
python3 - "$raw" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = {}
ids = {}
for t, _, setting, length, forward, transfer, ttft, toks in rows:
  by.setdefault((int(length), setting, t), []).append((float(forward), float(transfer), float(ttft)))
  ids.setdefault((int(length), setting), set()).add(toks)
# beyond_ms: TTFT less the forward, per request: what the transfer and the nodes add to compute.
print(f"{'prompt':>7} {'setting':<12} {'transport':<9} {'n':>2} {'forward_ms':>11} "
      f"{'transfer_ms':>12} {'ttft_ms':>9} {'beyond_ms':>10} {'transfer vs grpc':>17} tokens")
for (length, setting, t), v in sorted(by.items()):
  med = [statistics.median(x[i] for x in v) for i in range(3)]
  beyond = statistics.median(x[2] - x[0] for x in v)
  base = by.get((length, setting, "grpc"))
  base_ms = statistics.median(x[1] for x in base) if base else 0
  rel = med[1] / base_ms if base_ms > 0 else float("nan")
  print(f"{length:>7} {setting:<12} {t:<9} {len(v):>2} {med[0]:>11.1f} {med[1]:>12.1f} "
        f"{med[2]:>9.1f} {beyond:>10.1f} {rel:>17.3f} "
        f"{'same' if len(ids[(length, setting)]) == 1 else 'DIFF'}")
# Transports that disagree on a request's tokens fail the run.
sys.exit(1 if any(len(v) > 1 for v in ids.values()) else 0)
PY
exit "$failed"
