#!/usr/bin/env bash
# The prefix cache through the local cluster (2 decode and 2 prefill nodes behind the router and
# the OpenAI front): D documents × Q questions, interleaved (every document's first question,
# then every second one, ...), from C clients at once, once with the decode nodes routing
# prefills round robin and once by affinity (DECODE_PREFILL_AFFINITY_TOKENS 0, then 64). The
# table gives, per
# routing, the questions after a document's first that found it cached on their prefill node
# (usage.prompt_tokens_details.cached_tokens > 0), the share of their prompt tokens read from a
# cache, the prefill nodes' peak prefix cache bytes against their bound, and the median time to
# first token the front measured of documents' first questions and of the later ones (and their
# ratio: what a question on a document already asked about costs). A benchmark, not a CI test.
#
#   bash bench/prefix_cluster_bench.sh [--build-dir build] [--documents 4] [--questions 8]
#       [--clients 8] [--document-tokens 300] [--question-tokens 12] [--base-port 18280]
#       [--model ../shared/models/stories260K-hf] [--dir D]
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$REPO/build"
DOCUMENTS=4
QUESTIONS=8
CLIENTS=8
DOC_TOKENS=300
QUESTION_TOKENS=12
BASE_PORT=18280
MODEL="$REPO/../shared/models/stories260K-hf"
DIR=""
usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --build-dir) BUILD=$2; shift 2 ;;
    --documents) DOCUMENTS=$2; shift 2 ;;
    --questions) QUESTIONS=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --document-tokens) DOC_TOKENS=$2; shift 2 ;;
    --question-tokens) QUESTION_TOKENS=$2; shift 2 ;;
    --base-port) BASE_PORT=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "prefix_cluster_bench: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
for n in "$DOCUMENTS" "$QUESTIONS" "$CLIENTS" "$DOC_TOKENS" "$QUESTION_TOKENS" "$BASE_PORT"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "prefix_cluster_bench: '$n' is not a positive integer" >&2; exit 2; }
done
DIR=${DIR:-$(mktemp -d /tmp/kvwire-prefix-XXXX)}
mkdir -p "$DIR"
cluster() { bash "$REPO/deploy/local/cluster.sh" "$@"; }
trap 'cluster stop --dir "$DIR/cluster" >/dev/null 2>&1 || true' EXIT

echo "the prefix cache through the local cluster: $DOCUMENTS documents of $DOC_TOKENS tokens x" \
  "$QUESTIONS questions of $QUESTION_TOKENS, $CLIENTS clients; logs in $DIR"
printf '%-12s %10s %13s %15s %16s %14s %14s %6s\n' routing later_hits cached_share \
  peak_cache_MiB cache_bound_MiB first_ttft_ms later_ttft_ms ratio
for routing in round_robin affinity; do
  tokens=0
  [[ $routing == affinity ]] && tokens=64
  rm -rf "$DIR/cluster"
  cluster start --dir "$DIR/cluster" --base-port "$BASE_PORT" --model "$MODEL" \
    --build-dir "$BUILD" --set DECODE_PREFILL_AFFINITY_TOKENS="$tokens" \
    >"$DIR/$routing.cluster.log" 2>&1
  cluster wait-ready --dir "$DIR/cluster" --timeout 120 >>"$DIR/$routing.cluster.log" 2>&1
  python3 - "$routing" "http://127.0.0.1:$((BASE_PORT + 9))" "$DOCUMENTS" "$QUESTIONS" "$CLIENTS" \
    "$DOC_TOKENS" "$QUESTION_TOKENS" "$((BASE_PORT + 5))" "$((BASE_PORT + 7))" \
    "$REPO/deploy/local/node-flags.env" <<'EOF'
import json, queue, random, re, sys, threading, urllib.request

(routing, front, documents, questions, clients, doc_tokens, question_tokens, m0, m1,
 flags) = sys.argv[1:]
documents, questions, clients = int(documents), int(questions), int(clients)
doc_tokens, question_tokens = int(doc_tokens), int(question_tokens)
model = json.load(urllib.request.urlopen(front + "/v1/models"))["data"][0]["id"]
rng = random.Random(11)
docs = [[1] + [rng.randrange(3, 500) for _ in range(doc_tokens)] for _ in range(documents)]
work = queue.Queue()
for q in range(questions):
  for d in range(documents):
    work.put((d, q, [rng.randrange(3, 500) for _ in range(question_tokens)]))
results, lock = [], threading.Lock()
peak = [0.0, 0.0]

def scrape():
  # The prefill nodes' metrics ports: BASE+5 and BASE+7 (deploy/local/cluster.sh).
  for i, port in enumerate((m0, m1)):
    text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port).read().decode()
    got = re.search(r"^kvwire_prefix_cache_bytes\{[^}]*\} (\S+)", text, re.M)
    if got:
      peak[i] = max(peak[i], float(got.group(1)))

def client():
  while True:
    try:
      d, q, tail = work.get_nowait()
    except queue.Empty:
      return
    body = json.dumps({"model": model, "prompt": docs[d] + tail, "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(front + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    usage = json.load(urllib.request.urlopen(req, timeout=120))["usage"]
    with lock:
      results.append((d, q, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                      usage["kvwire"]["front_ttft_ms"]))
    scrape()

threads = [threading.Thread(target=client) for _ in range(clients)]
for t in threads:
  t.start()
for t in threads:
  t.join()
bound = re.search(r"^PREFILL_PREFIX_CACHE_BYTES=(\d+)MiB", open(flags).read(), re.M)
later = [r for r in results if r[1] > 0]
hits = sum(1 for r in later if r[3] > 0)
share = sum(r[3] for r in later) / max(1, sum(r[2] for r in later))
def median(v):
  v = sorted(v)
  return v[len(v) // 2] if v else float("nan")
first = median([r[4] for r in results if r[1] == 0])
rest = median([r[4] for r in later])
print("%-12s %5d/%-4d %12.1f%% %15.2f %16s %14.1f %14.1f %6.3f" % (
    routing, hits, len(later), 100 * share, max(peak) / 2**20, bound.group(1) if bound else "?",
    first, rest, rest / first))
EOF
  cluster stop --dir "$DIR/cluster" >>"$DIR/$routing.cluster.log" 2>&1
done
