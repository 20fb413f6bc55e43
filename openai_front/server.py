#!/usr/bin/env python3
"""kvwire's OpenAI-compatible HTTP front: GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (stream true or false: server-sent events ending with
`data: [DONE]`), GET /health (ready: the gRPC target answers its health check) and
GET /health/live. Each request becomes one kvwire.v1.Generation/Generate call to --target (the
router, or a decode node), made with the asyncio API of the kvwire package (clients/python),
so every limit and check of the decode tier applies; its gRPC status becomes OpenAI's error
JSON with the matching HTTP code. docs/openai.md has the fields, the mapping and the figures.

  python3 openai_front/server.py --target localhost:8080 --model ../shared/models/stories260K-hf \
      --listen 127.0.0.1:8000

Needs aiohttp, grpcio, protobuf and jinja2 (Debian: python3-aiohttp python3-grpcio
python3-protobuf python3-jinja2)."""
import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid

from aiohttp import web

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from api import (ApiError, Parsed, chat_logprobs, completion_logprobs, from_grpc,  # noqa: E402
                 parse_chat, parse_completion, token_texts, usage)
from chat_template import ChatTemplate, TemplateError  # noqa: E402

log = logging.getLogger("kvwire-openai")
HEALTH_SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


def import_kvwire(stubs_dir):
  """The kvwire package: this source tree's (clients/python, with the CMake build's stubs in
  build/python) when the front runs from the tree, else the installed one."""
  for path in (stubs_dir, os.path.join(HERE, "..", "clients", "python")):
    path = os.path.abspath(path)
    if os.path.isdir(path) and path not in sys.path:
      sys.path.insert(0, path)
  os.environ.setdefault("KVWIRE_PROTO_DIR", os.path.join(HERE, "..", "proto"))
  import kvwire  # pylint: disable=import-outside-toplevel
  extra = os.path.abspath(os.path.join(stubs_dir, "kvwire"))
  if os.path.isdir(extra) and extra not in kvwire.__path__:
    kvwire.__path__.insert(1, extra)
  return kvwire


class WriteClock:
  """When the write in progress began (None: no write waits): what watch_disconnect reads."""
  __slots__ = ("since",)

  def __init__(self):
    self.since = None

  def stalled_for(self) -> float:
    return 0.0 if self.since is None else time.monotonic() - self.since


def sse(obj) -> bytes:
  return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Front:
  """The handlers and what they share: the gRPC client, the chat template, the bounds."""

  def __init__(self, args, kvwire):
    self.args, self.kvwire = args, kvwire
    self.model_id = args.model_name or (os.path.basename(os.path.normpath(args.model))
                                        if args.model and not args.model.startswith("synthetic:")
                                        else args.model or "kvwire")
    model_dir = args.model if args.model and os.path.isdir(args.model) else ""
    self.template = ChatTemplate.for_model(model_dir, args.chat_template)
    self.created = int(time.time())
    self.client = None
    self.inflight = 0

  async def start(self, _app):
    options = [("grpc.max_receive_message_length", 64 << 20),
               ("grpc.keepalive_time_ms", 30000), ("grpc.keepalive_timeout_ms", 10000)]
    self.client = self.kvwire.AsyncClient(self.args.target, timeout=self.args.timeout_s,
                                          tls_ca=self.args.tls_ca, options=options)

  async def stop(self, _app):
    if self.client is not None:
      await self.client.close()

  # ---- small endpoints ----------------------------------------------------------------------

  async def models(self, request):
    model = {"id": self.model_id, "object": "model", "created": self.created,
             "owned_by": "kvwire"}
    name = request.match_info.get("model")
    if name is not None:
      if name != self.model_id:
        return self.error(ApiError(404, "model '%s' is not served here" % name, param="model",
                                   type_="not_found_error", code="model_not_found"))
      return web.json_response(model)
    return web.json_response({"object": "list", "data": [model]})

  async def live(self, _request):
    return web.json_response({"status": "ok"})

  async def health(self, _request):
    """Ready while the gRPC target (router or decode node) answers SERVING."""
    check = self.client.channel.unary_unary("/grpc.health.v1.Health/Check")
    try:
      reply = await check(b"", timeout=self.args.health_timeout_s)
    except Exception as e:  # grpc.aio.AioRpcError, or the channel closing
      code = getattr(e, "code", lambda: None)()
      return web.json_response({"status": "unavailable", "target": self.args.target,
                                "reason": code.name if code else type(e).__name__},
                               status=503)
    if reply != HEALTH_SERVING:
      return web.json_response({"status": "not serving", "target": self.args.target},
                               status=503)
    return web.json_response({"status": "ok", "target": self.args.target,
                              "model": self.model_id})

  @staticmethod
  def error(e: ApiError):
    return web.json_response(e.body(), status=e.status)

  # ---- generation ---------------------------------------------------------------------------

  async def completions(self, request):
    return await self.generate(request, chat=False)

  async def chat_completions(self, request):
    return await self.generate(request, chat=True)

  def prompt_of(self, parsed: Parsed):
    if not parsed.chat:
      return parsed.prompt
    try:
      text = self.template.render(parsed.messages, parsed.add_generation_prompt)
    except TemplateError as e:
      raise ApiError(400, "messages: the chat template refused them: %s" % e, param="messages")
    # The decode node's tokenizer adds the BOS the model asks for, as transformers' encode does;
    # a template that writes bos_token itself would give two (apply_chat_template tokenizes
    # with add_special_tokens=False for that reason).
    bos = self.template.special_tokens.get("bos_token")
    if bos and text.startswith(bos):
      text = text[len(bos):]
    return text

  async def generate(self, request, chat: bool):
    start = time.monotonic()
    try:
      try:
        raw = await request.json()
      except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "the request body is not JSON: %s" % e)
      parsed = parse_chat(raw, self.model_id) if chat else parse_completion(raw, self.model_id)
      try:
        req = self.client.request(self.prompt_of(parsed),
                                  self.kvwire.GenerateParams(**parsed.params))
      except (ValueError, TypeError) as e:
        raise ApiError(400, "kv_params: %s" % e, param="kv_params")
      if self.inflight >= self.args.max_inflight:
        raise ApiError(429, "the front has %d requests in flight (--max-inflight)" %
                       self.inflight, type_="rate_limit_error", code="rate_limit_exceeded")
    except ApiError as e:
      return self.error(e)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    req.request_id = rid
    self.inflight += 1
    stream = self.client.stream_request(req, timeout=self.args.timeout_s)
    writing = WriteClock()
    watcher = asyncio.ensure_future(
        self.watch_disconnect(request, asyncio.current_task(), writing))
    try:
      if parsed.stream:
        return await self.answer_stream(request, parsed, stream, rid, start, writing)
      return await self.answer_whole(parsed, stream, rid, start)
    finally:
      watcher.cancel()
      self.inflight -= 1
      # Cancels the gRPC call if it still runs (the client left, or a write failed), so the
      # decode node frees the request's KV pages.
      await stream.aclose()

  async def watch_disconnect(self, request, handler, writing):
    """Cancels the handler when its client hangs up or stops reading. A write to a closed
    connection fails anyway, but a request waiting for its first token (or a whole,
    non-streamed answer) writes nothing until then, and aiohttp before 3.9 does not cancel
    handlers itself. A write that waits longer than --send-timeout-s for the client to take
    its bytes is a client that stopped reading (checked here rather than by a timer around
    every write, which would cost a task per token)."""
    while True:
      await asyncio.sleep(self.args.disconnect_poll_s)
      transport = request.transport
      if transport is None or transport.is_closing():
        log.info("client of %s left: cancelling its Generate call", request.path)
        handler.cancel()
        return
      if writing.stalled_for() > self.args.send_timeout_s:
        log.info("client of %s took no bytes for %.0f s (--send-timeout-s): cancelling its "
                 "Generate call", request.path, self.args.send_timeout_s)
        handler.cancel()
        return

  def envelope(self, parsed: Parsed, rid: str, created: int, chunk: bool) -> dict:
    if parsed.chat:
      kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
      kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": self.model_id}

  async def answer_whole(self, parsed: Parsed, stream, rid: str, start: float):
    texts, lps, toks, final, first = [], [], [], None, None
    try:
      async for chunk in stream:
        if chunk.token_ids and first is None:
          first = time.monotonic()
        texts.append(chunk.text)
        if parsed.logprobs:
          toks.extend(token_texts(chunk))
          lps.extend(chunk.logprobs)
        final = chunk.final or final
    except self.kvwire.GenerationError as e:
      return self.error(from_grpc(e.code, e.details, parsed.chat))
    if final is None:
      return self.error(ApiError(502, "the decode tier ended the stream without its final "
                                 "message", type_="server_error"))
    text = "".join(texts)
    ttft = 1e3 * ((first or time.monotonic()) - start)
    body = self.envelope(parsed, rid, int(time.time()), chunk=False)
    if parsed.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": chat_logprobs(toks, lps) if parsed.logprobs else None,
                "finish_reason": final.finish_reason}
    else:
      choice = {"index": 0, "text": text,
                "logprobs": completion_logprobs(toks, lps, 0) if parsed.logprobs else None,
                "finish_reason": final.finish_reason}
    body["choices"] = [choice]
    body["usage"] = usage(final, ttft)
    return web.json_response(body)

  async def answer_stream(self, request, parsed: Parsed, stream, rid: str, start: float,
                          writing: "WriteClock"):
    # The first message is awaited before the response starts, so that a request the decode
    # tier refuses gets its HTTP status (400, 429, 503 ...) rather than an error event.
    iterator = stream.__aiter__()
    try:
      first_chunk = await iterator.__anext__()
    except StopAsyncIteration:
      first_chunk = None
    except self.kvwire.GenerationError as e:
      return self.error(from_grpc(e.code, e.details, parsed.chat))
    first_at = time.monotonic()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Request-Id": rid})
    # The headers and the first event leave in one TCP segment (Linux's TCP_CORK, lifted after
    # the first event): one wake-up of the client for its first token, not two.
    corked = cork(request.transport, True)
    await resp.prepare(request)
    created = int(time.time())

    async def send(obj):
      nonlocal corked
      writing.since = time.monotonic()
      await resp.write(obj if isinstance(obj, bytes) else sse(obj))
      writing.since = None
      if corked:
        corked = cork(request.transport, False)

    async def finish(data: bytes):
      """The last events, [DONE] and the end of the chunked body, in one write."""
      writing.since = time.monotonic()
      await resp.write_eof(data + b"data: [DONE]\n\n")
      writing.since = None

    def event(choice_fields, finish=None, logprobs=None):
      e = self.envelope(parsed, rid, created, chunk=True)
      choice = {"index": 0}
      choice.update(choice_fields)
      choice["logprobs"] = logprobs
      choice["finish_reason"] = finish
      e["choices"] = [choice]
      return e

    # A token's event without logprobs, the hot path, is bytes around its text: the JSON that
    # event() and sse() make, built once per request instead of a dict per token.
    mark = "\x00text\x00"
    quoted_mark = json.dumps(mark).encode()
    before, after = sse(event({"delta": {"content": mark}} if parsed.chat else
                              {"text": mark})).split(quoted_mark)

    def text_event(text):
      return before + json.dumps(text).encode() + after

    offset = 0
    role_sent = False
    chunk = first_chunk
    try:
      while chunk is not None:
        if chunk.token_ids or chunk.text:
          lp = None
          if parsed.logprobs:
            toks = token_texts(chunk)
            lp = chat_logprobs(toks, chunk.logprobs) if parsed.chat else \
                completion_logprobs(toks, chunk.logprobs, offset)
          offset += len(chunk.text)
          if parsed.chat and not role_sent:
            role_sent = True
            await send(event({"delta": {"role": "assistant", "content": chunk.text}},
                             logprobs=lp))
          elif lp is None:
            await send(text_event(chunk.text))
          elif parsed.chat:
            await send(event({"delta": {"content": chunk.text}}, logprobs=lp))
          else:
            await send(event({"text": chunk.text}, logprobs=lp))
        if chunk.final is not None:
          f = chunk.final
          fields = {"delta": {} if role_sent else {"role": "assistant", "content": ""}} \
              if parsed.chat else {"text": ""}
          last = event(fields, finish=f.finish_reason)
          figures = usage(f, 1e3 * (first_at - start))
          if parsed.include_usage:
            last["usage"] = None
            tail = self.envelope(parsed, rid, created, chunk=True)
            tail["choices"] = []
            tail["usage"] = figures
            ending = sse(last) + sse(tail)
          else:
            last["usage"] = figures  # kvwire's figures ride on the last chunk regardless
            ending = sse(last)
          break
        try:
          chunk = await iterator.__anext__()
        except StopAsyncIteration:
          chunk = None
      else:
        raise self.kvwire.GenerationError("INTERNAL", "the stream ended without its final "
                                          "message")
      await finish(ending)
    except self.kvwire.GenerationError as e:
      await finish(sse(from_grpc(e.code, e.details, parsed.chat).body()))
    except ConnectionResetError as e:
      # The client left (one that stopped reading is cancelled by watch_disconnect): the
      # caller's finally cancels the call.
      log.info("%s: stream abandoned (%s)", rid, type(e).__name__)
    finally:
      if corked:
        cork(request.transport, False)
    return resp


def cork(transport, on: bool) -> bool:
  """Sets TCP_CORK on the connection (Linux): while set, writes wait in the kernel to leave
  together. Returns whether the socket is corked now; False where TCP_CORK does not exist."""
  sock = transport.get_extra_info("socket") if transport is not None else None
  option = getattr(socket, "TCP_CORK", None)
  if sock is None or option is None:
    return False
  try:
    sock.setsockopt(socket.IPPROTO_TCP, option, 1 if on else 0)
  except OSError:  # the client left
    return False
  return on


def parse_listen(value):
  host, _, port = value.rpartition(":")
  if not host or not port.isdigit():
    raise argparse.ArgumentTypeError("expected HOST:PORT, got '%s'" % value)
  return host.strip("[]"), int(port)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 8000),
                 help="HOST:PORT of the HTTP listener (port 0: a free port, printed)")
  p.add_argument("--target", default="localhost:8080",
                 help="gRPC target of Generate: the router, a decode node, or "
                      "ipv4:HOST:PORT,HOST:PORT")
  p.add_argument("--model", default="",
                 help="the model folder the decode nodes serve (its tokenizer_config.json "
                      "gives the chat template), or synthetic:NAME")
  p.add_argument("--model-name", default="",
                 help="the model id clients name (default: the folder's name)")
  p.add_argument("--chat-template", default="", help="a Jinja file replacing the model's")
  p.add_argument("--timeout-s", type=float, default=300.0,
                 help="deadline of each Generate call, whole generation included")
  p.add_argument("--send-timeout-s", type=float, default=30.0,
                 help="longest wait for a client to take one streamed chunk")
  p.add_argument("--health-timeout-s", type=float, default=2.0)
  p.add_argument("--disconnect-poll-s", type=float, default=0.2,
                 help="how often a request checks whether its client has left")
  p.add_argument("--max-inflight", type=int, default=1024,
                 help="requests in flight beyond which the front answers 429")
  p.add_argument("--max-body-bytes", type=int, default=4 << 20)
  p.add_argument("--grace-s", type=float, default=20.0,
                 help="SIGTERM: how long requests in flight may finish")
  p.add_argument("--tls-ca", default="", help="CA certificate of the target (enables TLS)")
  p.add_argument("--stubs", default=os.path.join(HERE, "..", "build", "python"),
                 help="the CMake build's kvwire/v1 stubs, when running from the source tree")
  p.add_argument("--access-log", action="store_true", help="one line per request on stderr")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s kvwire-openai %(message)s")

  front = Front(args, import_kvwire(args.stubs))
  app = web.Application(client_max_size=args.max_body_bytes)
  app.on_startup.append(front.start)
  app.on_cleanup.append(front.stop)
  app.router.add_get("/v1/models", front.models)
  app.router.add_get("/v1/models/{model}", front.models)
  app.router.add_post("/v1/completions", front.completions)
  app.router.add_post("/v1/chat/completions", front.chat_completions)
  app.router.add_get("/health", front.health)
  app.router.add_get("/health/live", front.live)

  async def serve():
    import aiohttp  # pylint: disable=import-outside-toplevel
    version = tuple(int(x) for x in aiohttp.__version__.split(".")[:2])
    runner_kwargs = {"access_log": log if args.access_log else None}
    site_kwargs = {}
    if version >= (3, 9):
      # Since 3.9 a handler whose client left is cancelled only when asked (3.8 always
      # does): the cancellation is what ends the gRPC call and frees the KV pages.
      runner_kwargs.update(handler_cancellation=True, shutdown_timeout=args.grace_s)
    else:
      site_kwargs["shutdown_timeout"] = args.grace_s
    runner = web.AppRunner(app, **runner_kwargs)
    await runner.setup()
    site = web.TCPSite(runner, args.listen[0], args.listen[1], **site_kwargs)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # pylint: disable=protected-access
    log.info("listening on http://%s:%d (model %s, target %s, chat template: %s)",
             args.listen[0], port, front.model_id, args.target, front.template.origin)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: requests in flight get %.0f s", args.grace_s)
    await runner.cleanup()

  asyncio.run(serve())
  return 0


if __name__ == "__main__":
  sys.exit(main())
