#!/usr/bin/env python3
"""A kvwire client: stream a completion through the router and print what the compressed
KV transfer saved. A command line over the `kvwire` Python package (clients/python: `pip
install ./clients/python`, or used from this source tree as is); it needs grpcio and protobuf
(Debian: python3-grpcio python3-protobuf) and the Python stubs of proto/kvwire/v1, which the
package build makes, the CMake build writes to build/python, or the package makes itself with
protoc and grpc_python_plugin.

  python3 tools/kvwire_client.py --target localhost:8080 --prompt "Once upon a time" \
      --max-tokens 64 --policy snapkv --budget 64

Prints the text as it streams, then the request's figures (full-cache bytes vs bytes on
the wire, TTFT, inter-token latency). --json prints one JSON object per request instead.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def import_kvwire(stubs_dir=None, proto_dir=None):
  """The kvwire package of this source tree (ahead of an installed copy), with the stubs of
  stubs_dir (build/python) when it has them."""
  stubs_dir = os.path.abspath(stubs_dir or os.path.join(HERE, "..", "build", "python"))
  proto_dir = os.path.abspath(proto_dir or os.path.join(HERE, "..", "proto"))
  os.environ.setdefault("KVWIRE_PROTO_DIR", proto_dir)
  for path in (stubs_dir, os.path.join(HERE, "..", "clients", "python")):
    path = os.path.abspath(path)
    if os.path.isdir(path) and path not in sys.path:
      sys.path.insert(0, path)
  import kvwire  # pylint: disable=import-outside-toplevel
  extra = os.path.join(stubs_dir, "kvwire")
  if os.path.isdir(extra) and extra not in kvwire.__path__:
    kvwire.__path__.insert(1, extra)
  return kvwire


def load_stubs(stubs_dir, proto_dir):
  """(generation_pb2, generation_pb2_grpc), for scripts that make their own calls."""
  import_kvwire(stubs_dir, proto_dir)
  from kvwire import _stubs  # pylint: disable=import-outside-toplevel
  return _stubs.load()


def params_from_args(kvwire, args):
  return kvwire.GenerateParams(
      max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
      top_k=args.top_k, seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos,
      logprobs=args.logprobs, policy=args.policy, budget=args.budget or None,
      ratio=args.ratio or None, window=args.window or None, attention_mode=args.attention,
      attention_budget=args.attention_budget or None, request_id=args.request_id)


def generate(client, kvwire, args, prompt, out):
  """Runs one request; returns a dict of its results and figures."""
  if prompt.startswith("ids:"):
    prompt = [int(x) for x in prompt[4:].split(",")]
  req = client.request(prompt, params_from_args(kvwire, args))
  metadata = [("traceparent", args.traceparent)] if args.traceparent else []
  on_text = None
  if out is not None:
    def on_text(text):
      out.write(text)
      out.flush()
  try:
    r = client.generate_request(req, metadata=metadata, on_text=on_text)
  except kvwire.GenerationError as e:
    return {"request_id": req.request_id, "error": e.code, "message": e.details}
  st = r.stats
  return {
      "request_id": r.request_id,
      "text": r.text,
      "token_ids": r.token_ids,
      "finish_reason": "FINISH_REASON_" + r.finish_reason.upper(),
      "prompt_tokens": r.prompt_tokens,
      "completion_tokens": r.completion_tokens,
      "kept_tokens": st.kept_tokens,
      "full_cache_bytes": st.full_cache_bytes,
      "wire_bytes": st.wire_bytes,
      "kv_payload_bytes": st.kv_payload_bytes,
      "transfer_ms": st.transfer_ms,
      "prefill_ms": st.prefill_ms,
      "ttft_ms": st.ttft_ms,
      "mean_itl_ms": st.mean_itl_ms,
      "policy": st.policy,
      "prefill_node": st.prefill_node,
      "decode_node": st.decode_node,
      "client_ttft_ms": r.client_ttft_ms,
  } | ({"logprobs": r.logprobs} if args.logprobs else {})


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="localhost:8080", help="router or decode node host:port")
  p.add_argument("--prompt", action="append", default=[],
                 help="prompt text, or ids:1,2,3 for token ids (repeat for several requests)")
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[])
  p.add_argument("--ignore-eos", action="store_true")
  p.add_argument("--policy", default="", help="compression policy (server default if empty)")
  p.add_argument("--budget", type=int, default=0)
  p.add_argument("--ratio", type=float, default=0.0)
  p.add_argument("--window", type=int, default=0)
  p.add_argument("--attention", default="", help="decode attention: dense, hybrid, quest")
  p.add_argument("--attention-budget", type=int, default=0)
  p.add_argument("--logprobs", action="store_true")
  p.add_argument("--request-id", default="")
  p.add_argument("--traceparent", default="", help="W3C traceparent to continue a trace")
  p.add_argument("--timeout", type=float, default=120.0)
  p.add_argument("--tls-ca", default="", help="CA certificate to trust (enables TLS)")
  p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
  p.add_argument("--proto-dir", default=os.path.join(HERE, "..", "proto"))
  p.add_argument("--stubs", default=os.path.join(HERE, "..", "build", "python"),
                 help="directory with the generated kvwire/v1 Python stubs")
  args = p.parse_args()
  if not args.prompt:
    args.prompt = ["Once upon a time"]

  kvwire = import_kvwire(args.stubs, args.proto_dir)
  client = kvwire.Client(args.target, timeout=args.timeout, tls_ca=args.tls_ca)

  failed = 0
  rows = []
  for prompt in args.prompt:
    if not args.json:
      sys.stdout.write(prompt if not prompt.startswith("ids:") else "")
    res = generate(client, kvwire, args, prompt, None if args.json else sys.stdout)
    rows.append(res)
    if "error" in res:
      failed += 1
      if args.json:
        print(json.dumps(res))
      else:
        print("\nerror: %s: %s" % (res["error"], res["message"]), file=sys.stderr)
      continue
    if args.json:
      print(json.dumps(res))
    else:
      print()
  client.close()
  if not args.json:
    print("\n%-24s %8s %6s %12s %12s %7s %9s %9s  %s" %
          ("request", "prompt", "kept", "full bytes", "wire bytes", "saved", "ttft ms", "itl ms",
           "policy"))
    for r in rows:
      if "error" in r:
        print("%-24s %s" % (r["request_id"][:24], r["error"]))
        continue
      ratio = r["full_cache_bytes"] / r["wire_bytes"] if r["wire_bytes"] else float("nan")
      print("%-24s %8d %6d %12d %12d %6.1fx %9.1f %9.2f  %s" %
            (r["request_id"][:24], r["prompt_tokens"], r["kept_tokens"], r["full_cache_bytes"],
             r["wire_bytes"], ratio, r["ttft_ms"], r["mean_itl_ms"], r["policy"]))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
