#!/usr/bin/env python3
"""A kvwire client: stream a completion through the router and print what the compressed
KV transfer saved. This is the example to copy: it needs grpcio and protobuf (Debian:
python3-grpcio python3-protobuf) and the Python stubs of proto/kvwire/v1, which the build
writes to build/python (or which it makes itself with protoc and grpc_python_plugin).

  python3 tools/kvwire_client.py --target localhost:8080 --prompt "Once upon a time" \
      --max-tokens 64 --policy snapkv --budget 64

Prints the text as it streams, then the request's figures (full-cache bytes vs bytes on
the wire, TTFT, inter-token latency). --json prints one JSON object per request instead.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import uuid


def load_stubs(stubs_dir, proto_dir):
  """Imports the kvwire/v1 stubs: from stubs_dir (the build generates them there), or
  generated now with protoc and grpc_python_plugin (Debian: protobuf-compiler,
  protobuf-compiler-grpc) from the .proto files."""
  if not os.path.exists(os.path.join(stubs_dir, "kvwire", "v1", "generation_pb2.py")):
    import shutil
    import subprocess
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if not protoc or not plugin:
      raise RuntimeError("no stubs in %s and no protoc/grpc_python_plugin to make them" % stubs_dir)
    stubs_dir = tempfile.mkdtemp(prefix="kvwire-stubs-")
    files = [os.path.join(proto_dir, "kvwire", "v1", f)
             for f in ("generation.proto", "kv.proto", "prefill.proto")]
    subprocess.run([protoc, "-I", proto_dir, "--python_out", stubs_dir, "--grpc_out", stubs_dir,
                    "--plugin=protoc-gen-grpc=" + plugin] + files, check=True)
  sys.path.insert(0, stubs_dir)
  from kvwire.v1 import generation_pb2, generation_pb2_grpc  # pylint: disable=import-error
  return generation_pb2, generation_pb2_grpc


def build_request(pb, args, prompt):
  req = pb.GenerateRequest(request_id=args.request_id or str(uuid.uuid4()),
                           return_logprobs=args.logprobs)
  if prompt.startswith("ids:"):
    req.prompt_ids.ids.extend(int(x) for x in prompt[4:].split(","))
  else:
    req.prompt = prompt
  s = req.sampling
  s.max_tokens = args.max_tokens
  s.temperature = args.temperature
  s.top_p = args.top_p
  s.top_k = args.top_k
  s.seed = args.seed
  s.stop.extend(args.stop)
  s.ignore_eos = args.ignore_eos
  if args.policy:
    req.compression.policy = args.policy
  if args.budget:
    req.compression.budget = args.budget
  if args.ratio:
    req.compression.ratio = args.ratio
  if args.window:
    req.compression.window = args.window
  if args.attention:
    req.attention.mode = args.attention
  if args.attention_budget:
    req.attention.token_budget = args.attention_budget
  return req


def generate(stub, pb, args, prompt, out):
  """Runs one request; returns a dict of its results and figures."""
  import grpc
  req = build_request(pb, args, prompt)
  metadata = []
  if args.traceparent:
    metadata.append(("traceparent", args.traceparent))
  start = time.monotonic()
  first = None
  text, ids, final = [], [], None
  try:
    for r in stub.Generate(req, timeout=args.timeout, metadata=metadata):
      if r.token_ids and first is None:
        first = time.monotonic()
      ids.extend(r.token_ids)
      text.append(r.text)
      if out is not None and r.text:
        out.write(r.text)
        out.flush()
      if r.HasField("final"):
        final = r.final
  except grpc.RpcError as e:  # pylint: disable=no-member
    return {"request_id": req.request_id, "error": e.code().name, "message": e.details()}
  st = final.stats
  return {
      "request_id": req.request_id,
      "text": "".join(text),
      "token_ids": list(ids),
      "finish_reason": pb.FinishReason.Name(final.finish_reason),
      "prompt_tokens": final.usage.prompt_tokens,
      "completion_tokens": final.usage.completion_tokens,
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
      "client_ttft_ms": 1e3 * ((first or time.monotonic()) - start),
  }


def main():
  here = os.path.dirname(os.path.abspath(__file__))
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
  p.add_argument("--proto-dir", default=os.path.join(here, "..", "proto"))
  p.add_argument("--stubs", default=os.path.join(here, "..", "build", "python"),
                 help="directory with the generated kvwire/v1 Python stubs")
  args = p.parse_args()
  if not args.prompt:
    args.prompt = ["Once upon a time"]

  import grpc
  pb, pb_grpc = load_stubs(os.path.abspath(args.stubs), os.path.abspath(args.proto_dir))
  if args.tls_ca:
    with open(args.tls_ca, "rb") as f:
      channel = grpc.secure_channel(args.target, grpc.ssl_channel_credentials(f.read()))
  else:
    channel = grpc.insecure_channel(args.target)
  stub = pb_grpc.GenerationStub(channel)

  failed = 0
  rows = []
  for prompt in args.prompt:
    if not args.json:
      sys.stdout.write(prompt if not prompt.startswith("ids:") else "")
    res = generate(stub, pb, args, prompt, None if args.json else sys.stdout)
    rows.append(res)
    if "error" in res:
      failed += 1
      print(("" if args.json else "\n") + json.dumps(res) if args.json else
            "\nerror: %s: %s" % (res["error"], res["message"]), file=sys.stdout if args.json else sys.stderr)
      continue
    if args.json:
      print(json.dumps(res))
    else:
      print()
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
