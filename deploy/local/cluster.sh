#!/usr/bin/env bash
# A local kvwire cluster on loopback: the OpenAI-compatible HTTP front (kvwire-openai)
# calling nginx, the gRPC router, with two decode nodes behind it, two prefill nodes behind those, the decode-to-prefill links in mutual TLS (certificates made
# by scripts/make_certs.sh in the run directory; --insecure: plaintext). Every file it writes
# (certificates, rendered config, logs, traces, pids, nginx temp dirs) lives under the run
# directory.
#
#   deploy/local/cluster.sh start       [--dir DIR] [--base-port N] [--model M] [--build-dir B]
#                                       [--backend B] [--insecure] [--no-openai]
#                                       [--set KEY=VALUE]...
#   deploy/local/cluster.sh wait-ready  [--dir DIR] [--timeout S]
#   deploy/local/cluster.sh status      [--dir DIR]
#   deploy/local/cluster.sh stop        [--dir DIR] [--timeout S]
#
# See deploy/local/README.md. Node flags (policy defaults etc.) come from
# deploy/local/node-flags.env, the file the Kubernetes ConfigMap carries too.
set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true  # '&' in a replacement is literal

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
FLAGS_FILE="$REPO/deploy/local/node-flags.env"
TEMPLATE="$REPO/deploy/router/nginx.conf.template"
SHARED_MODEL="$REPO/../shared/models/stories260K-hf"

usage() {
  cat <<EOF
usage: deploy/local/cluster.sh start|stop|status|wait-ready [options]

commands:
  start       start the OpenAI front, the router, 2 decode and 2 prefill nodes (what already
              runs is kept)
  wait-ready  wait until every node and the router answer grpc.health.v1.Health/Check, and
              the OpenAI front GET /health
  status      print each process, its pid, ports and whether it is alive (exit 3 if any is not)
  stop        SIGTERM the front and the nodes (SIGQUIT nginx), wait, SIGKILL stragglers;
              keeps logs

options:
  --dir DIR        run directory: logs, pids, rendered config, nginx temp (default build/cluster)
  --base-port N    router N, decode-0 N+1, prefill-0 N+2, decode-1 N+3, prefill-1 N+4,
                   metrics N+5..N+8, OpenAI front N+9 (start only; also KVWIRE_BASE_PORT;
                   overrides the port variables below)
  --model M        model folder or synthetic:NAME (default ../shared/models/stories260K-hf
                   when present, else synthetic:stories)
  --build-dir B    where the binaries are (default build)
  --backend B      start: the nodes' kernel backend, cpu (default), cuda, or guarded (the device
                   path without a GPU, its CUDA IPC emulated between the processes); as the
                   manifests' KVWIRE_BACKEND
  --insecure       start: plaintext between decode and prefill nodes, no certificates
                   (default: mutual TLS, with a CA and node certificates that
                   scripts/make_certs.sh makes in DIR/tls, kept across restarts)
  --set KEY=VALUE  start: this value instead of node-flags.env's for one of its keys
                   (e.g. --set DECODE_STREAM_INTERVAL=4); repeatable
  --no-openai      start: no OpenAI-compatible front (openai_front/kvwire-openai of the
                   build, which needs Debian's python3-jinja2 for chat templates)
  --timeout S      wait-ready: seconds to wait (default 60); stop: seconds before SIGKILL
                   (default 30)

environment (start; defaults in brackets):
  KVWIRE_HOST [127.0.0.1]  KVWIRE_ROUTER_PORT [8080]  KVWIRE_OPENAI_PORT [8000]
  KVWIRE_DECODE0_PORT [50051]  KVWIRE_DECODE1_PORT [50061]
  KVWIRE_PREFILL0_PORT [50052]  KVWIRE_PREFILL1_PORT [50062]
  KVWIRE_PREFILL0_METRICS_PORT [9101]  KVWIRE_DECODE0_METRICS_PORT [9102]
  KVWIRE_PREFILL1_METRICS_PORT [9103]  KVWIRE_DECODE1_METRICS_PORT [9104]
  KVWIRE_THREADS [1]  CPU threads per node (4 nodes share this machine)
  KVWIRE_NGINX [nginx on PATH, else /usr/sbin/nginx]  KVWIRE_PYTHON [/usr/bin/python3]
  KVWIRE_BUILD_DIR [build]  KVWIRE_MODEL (as --model)
EOF
}

die() {
  echo "cluster.sh: error: $*" >&2
  exit 1
}
say() { echo "cluster.sh: $*"; }

# ---- options ----------------------------------------------------------------------------

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
CMD=$1
shift
DIR="$REPO/build/cluster"
BUILD_DIR="${KVWIRE_BUILD_DIR:-$REPO/build}"
BASE_PORT="${KVWIRE_BASE_PORT:-}"
MODEL="${KVWIRE_MODEL:-}"
BACKEND=""
TIMEOUT=""
INSECURE=0
OPENAI=1
declare -A OVERRIDES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) DIR=${2:?--dir needs a value}; shift 2 ;;
    --base-port) BASE_PORT=${2:?--base-port needs a value}; shift 2 ;;
    --model) MODEL=${2:?--model needs a value}; shift 2 ;;
    --build-dir) BUILD_DIR=${2:?--build-dir needs a value}; shift 2 ;;
    --backend) BACKEND=${2:?--backend needs a value}; shift 2 ;;
    --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
    --insecure) INSECURE=1; shift ;;
    --no-openai) OPENAI=0; shift ;;
    --set)
      [[ ${2:-} =~ ^([A-Z][A-Z0-9_]*)=([^[:space:]\"\']*)$ ]] ||
        die "--set takes KEY=VALUE (a key of node-flags.env, no quotes or spaces), got '${2:-}'"
      grep -q "^${BASH_REMATCH[1]}=" "$FLAGS_FILE" ||
        die "--set ${BASH_REMATCH[1]}: node-flags.env has no such key"
      OVERRIDES[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done
case $CMD in
  start | stop | status | wait-ready) ;;
  -h | --help | help) usage; exit 0 ;;
  *) usage >&2; die "unknown command '$CMD'" ;;
esac
[[ -z $BASE_PORT || $BASE_PORT =~ ^[0-9]+$ ]] || die "--base-port takes a number, got '$BASE_PORT'"
[[ -z $TIMEOUT || $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout takes whole seconds, got '$TIMEOUT'"
((!INSECURE)) || [[ $CMD == start ]] || die "--insecure is an option of start"
((OPENAI)) || [[ $CMD == start ]] || die "--no-openai is an option of start"
[[ -z $BACKEND ]] || [[ $CMD == start ]] || die "--backend is an option of start"
[[ -z $BACKEND || $BACKEND =~ ^(cpu|cuda|guarded)$ ]] ||
  die "--backend takes cpu, cuda or guarded, got '$BACKEND'"
((${#OVERRIDES[@]} == 0)) || [[ $CMD == start ]] || die "--set is an option of start"

if [[ $CMD == start ]]; then
  mkdir -p "$DIR" 2>/dev/null || die "cannot create the run directory $DIR"
fi
[[ -d $DIR ]] || die "no cluster in $DIR (no such directory)"
DIR=$(cd "$DIR" && pwd)
if [[ -d $BUILD_DIR ]]; then BUILD_DIR=$(cd "$BUILD_DIR" && pwd); fi
PREFILL_BIN="$BUILD_DIR/prefill_service/kvwire-prefill"
DECODE_BIN="$BUILD_DIR/decode_service/kvwire-decode"
OPENAI_BIN="$BUILD_DIR/openai_front/kvwire-openai"
PYTHON="${KVWIRE_PYTHON:-/usr/bin/python3}"
if [[ -n ${KVWIRE_NGINX:-} ]]; then
  NGINX=$(command -v "$KVWIRE_NGINX" || echo "$KVWIRE_NGINX")
else
  NGINX=$(command -v nginx || echo /usr/sbin/nginx)  # /usr/sbin may not be on a user's PATH
fi
NODES_FILE="$DIR/nodes"    # one line per process: NAME KIND PORT METRICS_PORT EXECUTABLE
MODEL_FILE="$DIR/model"
LINKS_FILE="$DIR/links"    # how decode nodes reach prefill nodes: mtls or insecure
TLS_DIR="$DIR/tls"         # scripts/make_certs.sh's CA and prefill/, decode/ identities
# The name the decode nodes check in the prefill certificate: an ipv4: target of several
# addresses has no host name of its own, and make_certs.sh puts localhost in every one.
TLS_SERVER_NAME=localhost

# ---- processes --------------------------------------------------------------------------

# Is `pid` alive and running `exe`? (A zombie has an empty cmdline; nginx rewrites its own to
# "nginx: master process /usr/sbin/nginx ...", which still contains the executable.)
alive() {
  local pid=$1 exe=$2 cmdline
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || return 1
  [[ $cmdline == *"$exe"* ]]
}

pid_of() {  # prints the recorded pid of a process, if any
  local f="$DIR/pids/$1.pid"
  [[ -r $f ]] && cat "$f"
}

port_in_use() { (: <"/dev/tcp/$1/$2") 2>/dev/null; }

# Reads the process table written by start into the arrays NAMES KINDS PORTS METRICS EXES.
load_nodes() {
  [[ -r $NODES_FILE ]] || die "no cluster in $DIR (run: deploy/local/cluster.sh start --dir $DIR)"
  NAMES=() KINDS=() PORTS=() METRICS=() EXES=()
  local name kind port metrics exe
  while read -r name kind port metrics exe; do
    NAMES+=("$name") KINDS+=("$kind") PORTS+=("$port") METRICS+=("$metrics") EXES+=("$exe")
  done <"$NODES_FILE"
  HOST=$(cat "$DIR/host")
  LINKS=insecure  # a run directory from before mutual TLS had no links file
  if [[ -r $LINKS_FILE ]]; then LINKS=$(<"$LINKS_FILE"); fi
}

any_alive() {
  local i pid
  for i in "${!NAMES[@]}"; do
    pid=$(pid_of "${NAMES[$i]}") && alive "$pid" "${EXES[$i]}" && return 0
  done
  return 1
}

log_tail() {
  local log
  for log in "$DIR/logs/$1.log" "$DIR/$1/logs/error.log"; do
    if [[ -s $log ]]; then
      echo "---- last lines of $log" >&2
      tail -n 15 "$log" >&2
    fi
  done
}

# Appends the flags of one role (PREFILL or DECODE) from node-flags.env (with --set's values)
# to the array FLAGS: DECODE_KV_POOL_BYTES=256MiB becomes --kv-pool-bytes=256MiB.
role_flags() {
  local role=$1 line key value n=0
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    [[ $line =~ ^([A-Z][A-Z0-9_]*)=([^[:space:]\"\']*)$ ]] ||
      die "$FLAGS_FILE:$n: expected KEY=VALUE (no quotes, no spaces), got '$line'"
    key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    [[ -v OVERRIDES[$key] ]] && value=${OVERRIDES[$key]}
    [[ $key == "${role}_"* ]] || continue
    key=${key#"${role}_"}
    key=${key,,}
    FLAGS+=("--${key//_/-}=$value")
  done <"$FLAGS_FILE"
}

# Appends to FLAGS what a node of `kind` needs for the decode-to-prefill link: the prefill
# node's server certificate and the CA its clients must be signed by; the decode node's client
# certificate and the CA it checks the prefill nodes with.
tls_flags() {
  local kind=$1
  if [[ $LINKS == mtls ]]; then
    case $kind in
      prefill) FLAGS+=(--tls-cert="$TLS_DIR/prefill/tls.crt" --tls-key="$TLS_DIR/prefill/tls.key"
        --tls-client-ca="$TLS_DIR/prefill/ca.crt") ;;
      decode) FLAGS+=(--prefill-tls-ca="$TLS_DIR/decode/ca.crt"
        --prefill-tls-cert="$TLS_DIR/decode/tls.crt" --prefill-tls-key="$TLS_DIR/decode/tls.key"
        --prefill-tls-server-name="$TLS_SERVER_NAME") ;;
    esac
  elif [[ $kind == prefill ]] && ! loopback "$HOST" && knows_flag "$PREFILL_BIN" insecure; then
    # A prefill node refuses plaintext on a non-loopback address unless told --insecure
    # (binaries that predate that rule have no such flag, and need none).
    FLAGS+=(--insecure)
  fi
}

loopback() { [[ $1 == localhost || $1 == 127.* || $1 == ::1 || $1 == "[::1]" ]]; }

knows_flag() {  # knows_flag BINARY NAME: BINARY --help lists --NAME
  local help
  help=$("$1" --help 2>&1) || true
  [[ $help =~ (^|$'\n')\ +--$2(\ |$'\n'|$) ]]
}

# Starts one process in its own session (so a terminal's hangup or ^C does not reach it;
# stop and the demo's trap end it), output appended to its log.
launch() {
  local name=$1 exe=$2 port=$3 metrics=$4 pid
  shift 4
  if pid=$(pid_of "$name") && alive "$pid" "$exe"; then
    say "$name already running (pid $pid)"
    return
  fi
  local p
  for p in "$port" "$metrics"; do
    [[ $p == - ]] && continue
    port_in_use "$HOST" "$p" &&
      die "port $HOST:$p for $name is already in use (another cluster? stop it, or choose" \
        "ports with --base-port or the KVWIRE_*_PORT variables)"
  done
  local log="$DIR/logs/$name.log"
  local -a cmd=("$exe")
  echo "==== $(date -u +%FT%TZ) ${cmd[*]} $*" >>"$log"
  setsid "${cmd[@]}" "$@" </dev/null >>"$log" 2>&1 &
  echo "$!" >"$DIR/pids/$name.pid"
  say "started $name (pid $!) on $HOST:$port; log $log"
}

# ---- commands ---------------------------------------------------------------------------

nginx_args() {
  NGINX_ARGS=(-p "$DIR/router" -e "$DIR/router/logs/error.log" -c "$DIR/router/nginx.conf")
  # As root, nginx would run its workers as nobody, who may not reach a private run
  # directory; run them as the launching user instead, as they are when it is not root.
  if [[ $(id -u) -eq 0 ]]; then NGINX_ARGS+=(-g "user root;"); fi
}

render_router() {
  local servers="" i
  for i in "${!NAMES[@]}"; do
    [[ ${KINDS[$i]} == decode ]] || continue
    servers+="    server $HOST:${PORTS[$i]} max_fails=1 fail_timeout=2s;"$'\n'
  done
  local conf
  conf=$(<"$TEMPLATE")
  conf=${conf//@PREFIX@/$DIR/router}
  conf=${conf//@LISTEN@/$HOST:$ROUTER_PORT}
  conf=${conf//@DECODE_SERVERS@/${servers%$'\n'}}
  if [[ $conf =~ @[A-Z_]+@ ]]; then die "$TEMPLATE: placeholder ${BASH_REMATCH[0]} not filled"; fi
  mkdir -p "$DIR/router/logs"
  printf '%s\n' "$conf" >"$DIR/router/nginx.conf"
  nginx_args
  if ! "$NGINX" -t -q "${NGINX_ARGS[@]}"; then
    log_tail router
    die "nginx rejects $DIR/router/nginx.conf"
  fi
}

cmd_start() {
  [[ -x $PREFILL_BIN && -x $DECODE_BIN ]] ||
    die "kvwire binaries not found in $BUILD_DIR (prefill_service/kvwire-prefill," \
      "decode_service/kvwire-decode): run 'bash scripts/build.sh'"
  [[ -x $NGINX ]] || die "nginx not found (looked for $NGINX): install Debian's nginx" \
    "('bash scripts/install_deps.sh' does) or set KVWIRE_NGINX"
  [[ -r $FLAGS_FILE ]] || die "missing $FLAGS_FILE"
  if ((OPENAI)) && [[ ! -x $OPENAI_BIN ]]; then
    die "the OpenAI front $OPENAI_BIN is not built: run 'bash scripts/build.sh', or start" \
      "with --no-openai"
  fi
  mkdir -p "$DIR/logs" "$DIR/pids" "$DIR/traces"

  local reuse=0
  if [[ -r $NODES_FILE ]]; then
    load_nodes
    any_alive && reuse=1
  fi
  if ((reuse)); then
    MODEL=$(cat "$MODEL_FILE")
    say "a cluster is running in $DIR: starting only what is missing, on its ports"
    if ((INSECURE)) && [[ $LINKS == mtls ]]; then
      die "the cluster running in $DIR uses mutual TLS between its nodes; stop it before" \
        "starting it with --insecure"
    fi
  else
    HOST=${KVWIRE_HOST:-127.0.0.1}
    local b=$BASE_PORT
    if [[ -n $b ]]; then
      ROUTER_PORT=$b OPENAI_PORT=$((b + 9))
      set -- "$((b + 1))" "$((b + 3))" "$((b + 2))" "$((b + 4))" \
        "$((b + 6))" "$((b + 8))" "$((b + 5))" "$((b + 7))"
    else
      ROUTER_PORT=${KVWIRE_ROUTER_PORT:-8080} OPENAI_PORT=${KVWIRE_OPENAI_PORT:-8000}
      set -- "${KVWIRE_DECODE0_PORT:-50051}" "${KVWIRE_DECODE1_PORT:-50061}" \
        "${KVWIRE_PREFILL0_PORT:-50052}" "${KVWIRE_PREFILL1_PORT:-50062}" \
        "${KVWIRE_DECODE0_METRICS_PORT:-9102}" "${KVWIRE_DECODE1_METRICS_PORT:-9104}" \
        "${KVWIRE_PREFILL0_METRICS_PORT:-9101}" "${KVWIRE_PREFILL1_METRICS_PORT:-9103}"
    fi
    local p
    for p in "$ROUTER_PORT" "$OPENAI_PORT" "$@"; do
      if ! [[ $p =~ ^[0-9]+$ ]] || ((p < 1 || p > 65535)); then die "bad port '$p'"; fi
    done
    if [[ -z $MODEL ]]; then
      if [[ -f $SHARED_MODEL/config.json ]]; then
        MODEL=$(cd "$SHARED_MODEL" && pwd)
      else
        MODEL=synthetic:stories
      fi
    elif [[ $MODEL != synthetic:* ]]; then
      [[ -d $MODEL ]] || die "model folder $MODEL not found"
      MODEL=$(cd "$MODEL" && pwd)
    fi
    {
      echo "prefill-0 prefill $3 $7 $PREFILL_BIN"
      echo "prefill-1 prefill $4 $8 $PREFILL_BIN"
      echo "decode-0 decode $1 $5 $DECODE_BIN"
      echo "decode-1 decode $2 $6 $DECODE_BIN"
      echo "router router $ROUTER_PORT - $NGINX"
      if ((OPENAI)); then echo "openai openai $OPENAI_PORT - $OPENAI_BIN"; fi
    } >"$NODES_FILE"
    echo "$HOST" >"$DIR/host"
    echo "$MODEL" >"$MODEL_FILE"
    if ((INSECURE)); then echo insecure >"$LINKS_FILE"; else echo mtls >"$LINKS_FILE"; fi
    load_nodes
  fi
  if [[ $MODEL == synthetic:* ]]; then
    say "model: $MODEL (${SHARED_MODEL#"$REPO/"} not found: random weights, the text is noise)"
  else
    say "model: $MODEL"
  fi
  if [[ $LINKS == mtls ]]; then
    # Made once, kept across restarts (make_certs.sh keeps usable certificates).
    if ! "$REPO/scripts/make_certs.sh" "$TLS_DIR"; then
      die "no usable certificates in $TLS_DIR (above); fix them, remove the folder, or start" \
        "with --insecure"
    fi
    say "decode -> prefill: mutual TLS (CA and certificates in $TLS_DIR)"
  else
    say "decode -> prefill: plaintext (--insecure): anyone who reaches a prefill port gets K/V data"
  fi

  # The router's config is checked before anything starts, so a bad one starts nothing.
  local i pid router_up=0
  for i in "${!NAMES[@]}"; do
    [[ ${KINDS[$i]} == router ]] || continue
    ROUTER_PORT=${PORTS[$i]}
    if pid=$(pid_of router) && alive "$pid" "$NGINX"; then router_up=1; else render_router; fi
  done

  local prefill_target="ipv4:" threads=${KVWIRE_THREADS:-1}
  for i in "${!NAMES[@]}"; do
    [[ ${KINDS[$i]} == prefill ]] && prefill_target+="$HOST:${PORTS[$i]},"
  done
  prefill_target=${prefill_target%,}
  for i in "${!NAMES[@]}"; do
    local name=${NAMES[$i]} kind=${KINDS[$i]}
    [[ $kind == router || $kind == openai ]] && continue
    FLAGS=()
    role_flags "${kind^^}"
    FLAGS+=(--model="$MODEL" --listen="$HOST:${PORTS[$i]}"
      --metrics-listen="$HOST:${METRICS[$i]}" --node-name="$name" --threads="$threads"
      --trace-file="$DIR/traces/$name.jsonl")
    [[ $kind == decode ]] && FLAGS+=(--prefill="$prefill_target")
    [[ -n $BACKEND ]] && FLAGS+=(--backend="$BACKEND")
    tls_flags "$kind"
    launch "$name" "${EXES[$i]}" "${PORTS[$i]}" "${METRICS[$i]}" "${FLAGS[@]}"
  done
  if ((router_up)); then
    say "router already running (pid $(pid_of router))"
  else
    launch router "$NGINX" "$ROUTER_PORT" - "${NGINX_ARGS[@]}"
  fi
  # The OpenAI front calls Generate through the router, as any client does.
  for i in "${!NAMES[@]}"; do
    [[ ${KINDS[$i]} == openai ]] || continue
    local model_flag=(--model="$MODEL")
    launch openai "${EXES[$i]}" "${PORTS[$i]}" - --listen="$HOST:${PORTS[$i]}" \
      --target="$HOST:$(router_port)" "${model_flag[@]}" --access-log
    say "OpenAI-compatible front at http://$HOST:${PORTS[$i]}/v1"
  done
  say "router (nginx) at $HOST:$ROUTER_PORT; next: deploy/local/cluster.sh wait-ready --dir $DIR"
}

cmd_status() {
  load_nodes
  local i pid state bad=0
  echo "run dir: $DIR"
  echo "model:   $(cat "$MODEL_FILE")"
  if [[ $LINKS == mtls ]]; then
    echo "links:   decode -> prefill in mutual TLS (certificates in $TLS_DIR)"
  else
    echo "links:   decode -> prefill in plaintext (--insecure)"
  fi
  printf '%-10s %-8s %8s %-22s %-8s %s\n' NAME KIND PID ADDRESS METRICS STATE
  for i in "${!NAMES[@]}"; do
    if pid=$(pid_of "${NAMES[$i]}"); then
      if alive "$pid" "${EXES[$i]}"; then state=alive; else state=dead bad=1; fi
    else
      pid=- state=stopped bad=1
    fi
    printf '%-10s %-8s %8s %-22s %-8s %s\n' "${NAMES[$i]}" "${KINDS[$i]}" "$pid" \
      "$HOST:${PORTS[$i]}" "${METRICS[$i]}" "$state"
  done
  return $((bad ? 3 : 0))
}

cmd_wait_ready() {
  load_nodes
  local i pid args=() timeout=${TIMEOUT:-60}
  if ! "$PYTHON" -c "import grpc" 2>/dev/null; then
    die "$PYTHON with grpcio is needed to check health (Debian: python3-grpcio)"
  fi
  local tls=- tls_kinds=""
  if [[ $LINKS == mtls ]]; then
    # The prefill nodes take only clients with a certificate of the cluster's CA: ask them
    # with the decode nodes' own.
    tls="$TLS_DIR/decode" tls_kinds=prefill
  fi
  for i in "${!NAMES[@]}"; do
    pid=$(pid_of "${NAMES[$i]}") || die "${NAMES[$i]} was not started (run start first)"
    local secure=0
    [[ " $tls_kinds " == *" ${KINDS[$i]} "* ]] && secure=1
    [[ ${KINDS[$i]} == openai ]] && secure=http
    args+=("${NAMES[$i]}" "$HOST:${PORTS[$i]}" "$pid" "$secure")
  done
  local not_ready="$DIR/not-ready"
  rm -f "$not_ready"
  if "$PYTHON" - "$timeout" "$not_ready" "$tls" "$TLS_SERVER_NAME" "${args[@]}" <<'PY'; then
"""Polls grpc.health.v1.Health/Check on every node until all answer SERVING, a process
exits, or the time is up. The router is asked last, through nginx, once the decode nodes
behind it answer: asked earlier, nginx would mark them failed for fail_timeout. Nodes marked
secure are asked over mutual TLS with the client identity in the folder `tls`. The OpenAI front
(marked http) is asked last, GET /health, which it answers 200 once the router behind it
answers SERVING."""
import os
import sys
import time
import urllib.error
import urllib.request

import grpc

timeout, report, tls, server_name = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
rest = sys.argv[5:]
pending = {rest[i]: (rest[i + 1], int(rest[i + 2]), rest[i + 3])
           for i in range(0, len(rest), 4)}
credentials = None
if tls != "-":
  def read(name):
    with open(os.path.join(tls, name), "rb") as f:
      return f.read()
  credentials = grpc.ssl_channel_credentials(root_certificates=read("ca.crt"),
                                             private_key=read("tls.key"),
                                             certificate_chain=read("tls.crt"))


def channel_to(target, secure):
  if secure != "1":
    return grpc.insecure_channel(target)
  return grpc.secure_channel(target, credentials,
                             options=[("grpc.ssl_target_name_override", server_name)])

last = {name: "no answer yet" for name in pending}
start = time.monotonic()


def running(pid):
  try:
    with open("/proc/%d/cmdline" % pid, "rb") as f:
      return bool(f.read())  # a zombie's is empty
  except OSError:
    return False


def fail(names, why):
  with open(report, "w") as f:
    f.write("\n".join(names) + "\n")
  sys.exit("cluster.sh: error: " + why)


while pending:
  for name, (target, pid, secure) in list(pending.items()):
    if not running(pid):
      fail([name], "%s (pid %d) exited before it was ready" % (name, pid))
    if name == "router" and len(set(pending) - {"openai"}) > 1:
      continue
    if secure == "http":
      if len(pending) > 1:
        continue
      try:
        with urllib.request.urlopen("http://%s/health" % target, timeout=2.0) as r:
          r.read()
        print("cluster.sh: %-10s ready at http://%s (%.1f s)" % (name, target,
                                                                  time.monotonic() - start))
        del pending[name]
      except (urllib.error.URLError, OSError) as e:
        last[name] = "GET /health: %s" % e
      continue
    with channel_to(target, secure) as channel:
      check = channel.unary_unary("/grpc.health.v1.Health/Check")
      try:
        # HealthCheckRequest{} is empty; HealthCheckResponse{status: SERVING} is 08 01.
        reply = check(b"", timeout=1.0)
        if reply == b"\x08\x01":
          print("cluster.sh: %-10s ready at %s (%.1f s)" % (name, target, time.monotonic() - start))
          del pending[name]
        else:
          last[name] = "health status bytes %r, not SERVING" % reply
      except grpc.RpcError as e:
        last[name] = "%s: %s" % (e.code().name, e.details())
  if pending and time.monotonic() - start > timeout:
    fail(sorted(pending), "not ready after %.0f s: %s" % (timeout, "; ".join(
        "%s at %s: %s" % (n, pending[n][0], last[n]) for n in sorted(pending))))
  if pending:
    time.sleep(0.1)
PY
    say "all ${#NAMES[@]} processes ready; router at $HOST:$(router_port)$(openai_where)"
  else
    local name
    if [[ -r $not_ready ]]; then
      while read -r name; do log_tail "$name"; done <"$not_ready"
    fi
    exit 1
  fi
}

openai_where() {
  local i
  for i in "${!NAMES[@]}"; do
    [[ ${KINDS[$i]} == openai ]] && echo -n ", OpenAI front at http://$HOST:${PORTS[$i]}/v1"
  done
  return 0
}

router_port() {
  local i
  for i in "${!NAMES[@]}"; do [[ ${KINDS[$i]} == router ]] && echo "${PORTS[$i]}"; done
}

# Stops one tier of processes (given as indexes): signal, wait for them to exit; after the
# timeout SIGKILL what is left (with its children: nginx's workers) and wait for that too.
stop_tier() {
  local sig=$1 i pid
  shift
  local -a live=() still=()
  for i in "$@"; do
    pid=""
    if pid=$(pid_of "${NAMES[$i]}") && alive "$pid" "${EXES[$i]}"; then
      kill "-$sig" "$pid" 2>/dev/null || true
      live+=("$i")
    elif [[ -n $pid ]]; then
      say "${NAMES[$i]} (pid $pid) was not running"
    fi
  done
  local deadline=$((SECONDS + ${TIMEOUT:-30})) killed=0 children
  while ((${#live[@]})); do
    still=()
    for i in "${live[@]}"; do
      pid=$(pid_of "${NAMES[$i]}")
      if alive "$pid" "${EXES[$i]}"; then
        still+=("$i")
      elif ((!killed)); then
        say "stopped ${NAMES[$i]} (pid $pid)"
      fi
    done
    live=("${still[@]+"${still[@]}"}")
    ((${#live[@]})) || break
    if ((!killed && SECONDS >= deadline)); then
      for i in "${live[@]}"; do
        pid=$(pid_of "${NAMES[$i]}")
        children=$(ps -o pid= --ppid "$pid" 2>/dev/null || true)
        # shellcheck disable=SC2086  # word splitting of the child pid list is intended
        kill -KILL "$pid" $children 2>/dev/null || true
        say "killed ${NAMES[$i]} (pid $pid): still running after ${TIMEOUT:-30} s"
      done
      killed=1 deadline=$((SECONDS + 5))
    elif ((killed && SECONDS >= deadline)); then
      break  # cmd_stop reports what is left
    fi
    sleep 0.1
  done
}

cmd_stop() {
  load_nodes
  local i openai=() router=() decode=() prefill=()
  for i in "${!NAMES[@]}"; do
    case ${KINDS[$i]} in
      openai) openai+=("$i") ;;
      router) router+=("$i") ;;
      decode) decode+=("$i") ;;
      prefill) prefill+=("$i") ;;
    esac
  done
  # Front to back, so that each tier drains while the one behind it still serves:
  # nginx's graceful shutdown is SIGQUIT; the front and the nodes drain on SIGTERM.
  stop_tier TERM "${openai[@]+"${openai[@]}"}"
  stop_tier QUIT "${router[@]}"
  stop_tier TERM "${decode[@]}"
  stop_tier TERM "${prefill[@]}"
  for i in "${!NAMES[@]}"; do
    if pid=$(pid_of "${NAMES[$i]}") && alive "$pid" "${EXES[$i]}"; then
      die "${NAMES[$i]} (pid $pid) is still running"
    fi
    rm -f "$DIR/pids/${NAMES[$i]}.pid"
  done
  rm -f "$DIR/router/nginx.pid"
  say "cluster in $DIR stopped (logs kept in $DIR/logs and $DIR/router/logs)"
}

case $CMD in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  wait-ready) cmd_wait_ready ;;
esac
