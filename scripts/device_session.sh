#!/usr/bin/env bash
# The device check: everything a lent GPU can tell us, in one call of the device tool, within a
# deadline (default 400 s, KVWIRE_SESSION_DEADLINE), each phase under its own timeout:
#
#   env        nvidia-smi -q, the bundle's manifest, every bundled library resolves
#   ops        every backend op test on cuda (gtest JSON); failures rerun with
#              CUDA_LAUNCH_BLOCKING=1 so the error names the launch that faulted; ops_gemv,
#              the MatMul tests with bf16 products of up to 16 rows on kvwire's GEMV;
#              ops_topk_cub, the TopK and Sample tests on CUB's sorts (KVWIRE_CUDA_TOPK=cub)
#   engine     the engine on cuda against the reference and the CPU engine (DeviceEngine.*)
#   pair       both nodes on cuda through gRPC (ServicePairOnDevice.*)
#   oracle     PyTorch on the same device (scripts/device_oracle.py): ceilings, SDPA, and
#              transformers' stories260K greedy ids against kvwire's on cuda
#   gpu_bench  decode at batch 1/8/32 (each step a CUDA graph, and op by op) and prefill at
#              2K/16K against the measured ceilings, on the 1B shape, after its projections
#              alone through kvwire's GEMV beside cuBLAS; gpu_bench_gemv, decode at batch
#              2/8/16 with bf16 products on the GEMV (KVWIRE_CUDA_BF16_GEMV_ROWS=16);
#              gpu_bench_8b, the last phase, on the 8B shape
#   decode     decode_bench, long context, batch 8: dense, compressed, hybrid, RocketKV, Quest
#              (decode attention and the page ranking through FlashInfer where they serve)
#   decode_native  the same on kvwire's own kernels (KVWIRE_CUDA_ATTENTION=native);
#              decode_topk_cub, the page rankings on CUB's sort (KVWIRE_CUDA_TOPK=cub)
#   copies     kvwire timing's copy ledger: a compressing prefill, a sparse decode step
#   cuda_ipc   two processes on the GPU: a prefill node writing into a decode node's pool pages
#              (bench/transport_bench.sh, grpc vs cuda_ipc alternated, tokens compared), at 2K
#              and 16K tokens: TTFT through the pair beside the prefill forward alone
#   memcheck   compute-sanitizer memcheck over the op tests (the MatMul ones again with bf16
#              products on the GEMV) and the coded caches' kernels; racecheck over
#              coded_decode.cu's shared memory
#
# Logs, gtest JSON and bench output go to $OUT/logs.tar.gz, the summary to $OUT/summary.tsv
# (phase, status, seconds, detail), printed last. The device tool brings back at most 8 files.
#
# Usage (on the GPU machine, in a copy of this checkout with device-bundle.tar.gz beside it):
#   bash scripts/device_session.sh
# Dry run on any machine, on the guarded backend with tiny sizes, from a build folder (CI):
#   bash scripts/device_session.sh --dry-run [BUILD_DIR]
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dry=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry=1
  build="${2:-$root/build}"
elif [[ $# -gt 0 ]]; then
  sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The summary and the logs go to $OUT as each phase ends: a call cut off by the device tool's
# own limit still brings back what finished.
summary="$out/summary.tsv"
printf 'phase\tstatus\tseconds\tdetail\n' >"$summary"
deadline=$((SECONDS + ${KVWIRE_SESSION_DEADLINE:-400}))

if ((dry)); then
  backend=guarded
  bin="$build"
  find_bin() { find "$bin" -type f -name "$1" -perm -u+x | head -1; }
  export KVWIRE_SHARED_DIR="${KVWIRE_SHARED_DIR:-$root/../shared}"
  shared="$KVWIRE_SHARED_DIR"
else
  backend=cuda
  # device_run.sh unpacks the bundle and sets the libraries' path; its env check comes first.
  bash "$root/scripts/device_run.sh" env >"$work/env.log" 2>&1
  env_rc=$?
  dir="${KVWIRE_DEVICE_DIR:-/tmp/kvwire-device}"
  cublas="$(sed -n 's/^cuBLAS from //p' "$work/env.log")"
  export LD_LIBRARY_PATH="$dir/lib${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KVWIRE_SHARED_DIR="$dir/shared" KVWIRE_SOURCE_DIR="$root"
  # NCCL for the nccl transport's link test (it only loads there: one GPU holds one rank): the
  # copy PyTorch's wheel ships, where the toolkit's is not on the path.
  if [[ -z "${KVWIRE_NCCL_LIBRARY:-}" ]]; then
    nccl="$(python3 -c 'import glob, nvidia.nccl as n; print((glob.glob(n.__path__[0] + "/lib/libnccl.so*") or [""])[0])' 2>/dev/null || true)"
    [[ -n "$nccl" ]] && export KVWIRE_NCCL_LIBRARY="$nccl"
  fi
  shared="$KVWIRE_SHARED_DIR"
  find_bin() { [[ -x "$dir/bin/$1" ]] && echo "$dir/bin/$1"; }
fi

# phase NAME TIMEOUT_S DETAIL_FN CMD...: runs CMD into NAME.log under the smaller of its timeout
# and what is left of the deadline, and records a row. DETAIL_FN prints the row's detail.
phase() {
  local name=$1 limit=$2 detail_fn=$3
  shift 3
  local left=$((deadline - SECONDS))
  # A phase left under a third of its time would only record a timeout.
  if ((left < 10 || left < limit / 3)); then
    printf '%s\tskip\t0\t%d s of the session deadline left, of the %d s it takes\n' \
      "$name" "$((left > 0 ? left : 0))" "$limit" >>"$summary"
    return 1
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc
  local cmd="$*"
  echo "=== $name (up to ${limit} s): ${cmd:0:240}" | tee -a "$work/session.log"
  timeout -k 5 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  local status=pass
  if ((rc == 124 || rc == 137)); then
    status=timeout
  elif ((rc != 0)); then
    status=FAIL
  fi
  printf '%s\t%s\t%d\t%s\n' "$name" "$status" $((SECONDS - t0)) \
    "$($detail_fn "$work/$name.log" "$rc" | tr '\t\n' '  ' | cut -c1-400)" >>"$summary"
  tail -n 40 "$work/$name.log" >>"$work/session.log"
  tar -C "$work" -czf "$out/logs.tar.gz" . 2>/dev/null
  return $rc
}

# A gtest log's failed cases, one per line: "Backends/BackendOpsTest.X/cuda" from
# "[  FAILED  ] Backends/BackendOpsTest.X/cuda, where GetParam() = ... (12 ms)".
failed_cases() {
  grep '^\[  FAILED  \] .*\.' "$1" | grep -v 'listed below' | sed 's/^\[  FAILED  \] //;s/[, ].*//' |
    sort -u
}
# Details: a gtest log's counts and failed cases; a bench's last lines.
gtest_detail() {
  local passed failed skipped
  passed=$(grep -c '^\[       OK \]' "$1")
  failed=$(failed_cases "$1" | tr '\n' ' ')
  skipped=$(grep -c '^\[  SKIPPED \]' "$1")
  echo "passed $passed, skipped $skipped${failed:+, failed: $failed} (exit $2)"
}
tail_detail() { tail -n "${3:-3}" "$1" | sed 's/  */ /g'; echo " (exit $2)"; }
env_detail() { grep -E '^commit|NVIDIA|resolve|missing|not found|GPU' "$1" | head -5; echo "(exit $2)"; }

if ((dry)); then
  printf 'env\tskip\t0\tdry run on %s: no GPU\n' "$backend" >>"$summary"
else
  {
    nvidia-smi -q || echo "nvidia-smi failed"
  } >"$work/nvidia-smi.txt" 2>&1
  printf 'env\t%s\t0\t%s\n' "$([[ $env_rc == 0 ]] && echo pass || echo FAIL)" \
    "$(env_detail "$work/env.log" "$env_rc" | tr '\n' ' ')" >>"$summary"
fi

kernels_test="$(find_bin kernels_test)"
model_test="$(find_bin model_test)"
pair_test="$(find_bin decode_service_test)"
kvwire="$(find_bin kvwire)"
ops_filter="Backends/BackendOpsTest.*/$backend"

# rerun_blocking NAME RC LIMIT FILTER CMD...: after gtest phase NAME failed with RC, its failed
# cases again with CUDA_LAUNCH_BLOCKING=1, so the error names the launch that faulted (all of
# FILTER where the binary died before naming one, a crash); not after a timeout, which the
# slower rerun would only repeat.
rerun_blocking() {
  local name=$1 rc=$2 limit=$3 filter=$4
  shift 4
  ((rc != 0 && rc != 124 && rc != 137)) && [[ "$backend" == cuda && -s "$work/$name.log" ]] ||
    return 0
  local failed
  failed=$(failed_cases "$work/$name.log" | tr '\n' ':')
  failed="${failed%:}"
  phase "${name}_blocking" "$limit" gtest_detail env CUDA_LAUNCH_BLOCKING=1 "$@" \
    --gtest_filter="${failed:-$filter}"
}

phase ops 90 gtest_detail "$kernels_test" --gtest_filter="$ops_filter" \
  --gtest_output="json:$work/ops.json"
rerun_blocking ops $? 60 "$ops_filter" "$kernels_test"
# The decode GEMV against bf16 W for 2 to 16 rows of x, which the switch otherwise leaves to
# cuBLAS: the MatMul op tests with the backend sending those products to it.
gemv_filter="Backends/BackendOpsTest.MatMul/$backend:Backends/BackendOpsTest.Bf16WeightsMultiplyXRoundedToBf16/$backend"
phase ops_gemv 30 gtest_detail env KVWIRE_CUDA_BF16_GEMV_ROWS=16 "$kernels_test" \
  --gtest_filter="$gemv_filter:BackendFactory.CudaRefusesABf16GemvRowCountOutOfRange"
rerun_blocking ops_gemv $? 30 "$gemv_filter" env KVWIRE_CUDA_BF16_GEMV_ROWS=16 "$kernels_test"
# TopK and sampling with every call on CUB's segmented sort, which FlashInfer's top-k otherwise
# takes the decode step's page rankings and a top-k's candidates from (the ops phase runs
# those), and the variable's refusal.
topk_filter="Backends/BackendOpsTest.TopK*/$backend:Backends/BackendOpsTest.HbwSelect/$backend"
topk_filter+=":Backends/BackendOpsTest.Sample*/$backend"
phase ops_topk_cub 30 gtest_detail env KVWIRE_CUDA_TOPK=cub "$kernels_test" \
  --gtest_filter="$topk_filter:BackendFactory.CudaRefusesAnUnknownTopKKernel"
rerun_blocking ops_topk_cub $? 30 "$topk_filter" env KVWIRE_CUDA_TOPK=cub "$kernels_test"
# Coded caches (fp8, int8, int4): the device kernels against the reference, and the groups the
# device codes byte for byte the host's (on guarded, and on cuda where a GPU is present); a
# batch mixing the formats through coded_decode.cu at the models' head dims and groups.
coded_filter="Formats/CodedCacheTest.DeviceKernelsReadAndCodeAsTheHost/*:CodedDecodeBatch.*"
phase coded 60 gtest_detail "$model_test" --gtest_filter="$coded_filter" \
  --gtest_output="json:$work/coded.json"
phase engine 90 gtest_detail "$model_test" --gtest_filter="Backends/DeviceEngine.*/$backend" \
  --gtest_output="json:$work/engine.json"
phase pair 90 gtest_detail "$pair_test" \
  --gtest_filter="Backends/ServicePairOnDevice.*/$backend" --gtest_output="json:$work/pair.json"

if ((dry)); then
  printf 'oracle\tskip\t0\tdry run: PyTorch runs on the device machine only\n' >>"$summary"
  printf 'gpu_bench\tskip\t0\tdry run: gpu_bench measures a GPU\n' >>"$summary"
  decode_args=(--backend guarded --batch 2 --ctx 256 --kept 64 --t 32 --steps 2
               --model "synthetic:attn-8kv,layers=2" --kv-formats fp8,int4)
else
  oracle_detail() { cat "$1" | grep -P '^\w+\t' | awk -F'\t' '{printf "%s: %s; ", $1, $2}'; echo "(exit $2)"; }
  phase oracle 100 oracle_detail python3 "$root/scripts/device_oracle.py" --shared "$shared" \
    --kvwire "$kvwire" --backend cuda --json "$out/oracle.json"
  grep -P '^\w+\t(pass|FAIL|skip)\t' "$work/oracle.log" |
    awk -F'\t' '{printf "oracle.%s\t%s\t0\t%s\n", $1, $2, $3}' >>"$summary"
  bench_detail() { tail_detail "$1" "$2" 22; }
  phase gpu_bench 120 bench_detail "$(find_bin gpu_bench)" --runs 3
  # Decode steps with bf16 products of up to 16 rows on kvwire's GEMV rather than cuBLAS (what
  # the projection table above compares product by product), for the switch.
  phase gpu_bench_gemv 60 bench_detail env KVWIRE_CUDA_BF16_GEMV_ROWS=16 "$(find_bin gpu_bench)" \
    --batches 2,8,16 --prefill "" --graphs on --runs 3 --projections off
  decode_args=(--backend cuda --batch 8 --ctx 32768 --kept 2048 --t 1024 --steps 8
               --threads 16 --kv-formats fp8,int8,int4)
fi
decode_detail() { tail_detail "$1" "$2" 14; }
phase decode 150 decode_detail "$(find_bin decode_bench)" "${decode_args[@]}"
# The same with kvwire's own attention kernels in place of FlashInfer's, side by side.
phase decode_native 120 decode_detail env KVWIRE_CUDA_ATTENTION=native \
  "$(find_bin decode_bench)" "${decode_args[@]}"
# The page rankings on CUB's segmented sort rather than FlashInfer's top-k (attention as in
# decode; the coded formats' dense modes left out, which rank nothing): decode_bench's
# selection column, which waits for the device before and after it, is the ranking's part.
sparse_args=()
for ((i = 0; i < ${#decode_args[@]}; i++)); do
  [[ "${decode_args[i]}" == --kv-formats ]] && { ((i++)); continue; }
  sparse_args+=("${decode_args[i]}")
done
phase decode_topk_cub 90 decode_detail env KVWIRE_CUDA_TOPK=cub \
  "$(find_bin decode_bench)" "${sparse_args[@]}"

# What crosses between host and device in a compressing prefill and a sparse decode step
# (kvwire timing's copy ledger): the kept rows and the sampled tokens only.
if ((dry)); then
  copies_model="synthetic:tiny" copies_len=300 copies_budget=64
else
  copies_model="synthetic:llama-1b" copies_len=2048 copies_budget=128
fi
copies_ids=$(seq 0 $((copies_len - 1)) | awk '{printf "%s%d", (NR > 1 ? "," : ""), 3 + ($1 * 37) % 250}')
copies_detail() {
  python3 -c 'import json, sys
j = json.loads(next(l for l in open(sys.argv[1]) if l.startswith("{")))
c = j["copies"]
print("prefill to_host %d B (%d calls), decode step to_host %.0f B (%.1f calls), to_device %.0f B"
      % (c["prefill"]["to_host_bytes"], c["prefill"]["to_host_calls"],
         c["decode_step"]["to_host_bytes"], c["decode_step"]["to_host_calls"],
         c["decode_step"]["to_device_bytes"]))' "$1" 2>/dev/null || tail_detail "$1" "$2" 2
  echo " (exit $2)"
}
phase copies 120 copies_detail "$(find_bin kvwire)" timing --backend "$backend" \
  --model "$copies_model" --prompt-ids "$copies_ids" --decode 8 --policy snapkv \
  --budget "$copies_budget" --attention hybrid --attention-budget 64

# cuda_ipc between two processes (CUDA refuses a process its own IPC handle, so the op and pair
# tests emulate it on guarded): tokens equal to grpc's, TTFT and transfer side by side.
if ((dry)); then
  printf 'cuda_ipc\tskip\t0\tdry run: CUDA IPC needs a GPU and two processes\n' >>"$summary"
else
  ipc_detail() {
    grep -E '^ +[0-9]+ ' "$1" | awk '{printf "%s %s %s ttft %s fwd %s %s; ", $1, $2, $3, $7, $5, $10}'
    echo "(exit $2)"
  }
  phase cuda_ipc 100 ipc_detail bash "$root/bench/transport_bench.sh" --build-dir "$dir/bin" \
    --backend cuda --model synthetic:llama-1b --lengths 2048,16384 --settings full,snapkv:128 \
    --rounds 1 --threads 8 --dir "$work/transport"
fi

if ((dry)); then
  printf 'memcheck\tskip\t0\tdry run: compute-sanitizer needs a GPU\n' >>"$summary"
elif command -v compute-sanitizer >/dev/null; then
  memcheck_detail() { grep -E 'ERROR SUMMARY|Program hit' "$1" | sort | uniq -c | head -3; echo "(exit $2)"; }
  phase memcheck 150 memcheck_detail compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$kernels_test" --gtest_filter="$ops_filter" --gtest_brief=1
  phase memcheck_gemv 60 memcheck_detail env KVWIRE_CUDA_BF16_GEMV_ROWS=16 compute-sanitizer \
    --tool memcheck --error-exitcode 1 "$kernels_test" --gtest_filter="$gemv_filter" --gtest_brief=1
  phase memcheck_coded 90 memcheck_detail compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$model_test" --gtest_filter="Formats/CodedCacheTest.DeviceKernelsReadAndCodeAsTheHost/*_bf16_d64:CodedDecodeBatch.*" \
    --gtest_brief=1
  # coded_decode.cu's blocks share their folded queries, weights and sums through shared memory.
  phase racecheck_coded 60 memcheck_detail compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$model_test" --gtest_filter="CodedDecodeBatch.*" --gtest_brief=1
else
  printf 'memcheck\tskip\t0\tcompute-sanitizer not found\n' >>"$summary"
fi

# The 8B shape (16 GB of bf16 weights, generated on the host's 16 threads), last: what comes
# before checks correctness and must not be cut by the deadline for it.
if ((dry)); then
  printf 'gpu_bench_8b\tskip\t0\tdry run: gpu_bench measures a GPU\n' >>"$summary"
else
  phase gpu_bench_8b 150 bench_detail "$(find_bin gpu_bench)" --model synthetic:llama-8b --runs 2
fi

tar -C "$work" -czf "$out/logs.tar.gz" . 2>/dev/null
echo
column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary"
# Exit 1 when a check failed or timed out; skipped phases are not failures.
! awk -F'\t' 'NR > 1 && ($2 == "FAIL" || $2 == "timeout") {bad = 1} END {exit !bad}' "$summary"
