"""The asyncio client (grpc.aio)."""
import time
from typing import AsyncIterator, Optional, Sequence

import grpc
from grpc import aio

from kvwire import _stubs
from kvwire.client import Metadata, make_credentials
from kvwire.request import GenerateParams, Prompt, build_request
from kvwire.results import Chunk, Collector, GenerationError, Result, chunk_from_proto


class AsyncClient:
  """Client's asyncio twin. Create it inside the event loop that uses it."""

  def __init__(self, target: str, *, timeout: float = 120.0, tls_ca: str = "",
               tls_cert: str = "", tls_key: str = "", options: Sequence = ()):
    self.pb, pb_grpc = _stubs.load()
    if tls_ca or tls_cert:
      self.channel = aio.secure_channel(target, make_credentials(tls_ca, tls_cert, tls_key),
                                        options=list(options))
    else:
      self.channel = aio.insecure_channel(target, options=list(options))
    self.stub = pb_grpc.GenerationStub(self.channel)
    self.timeout = timeout

  async def close(self):
    await self.channel.close()

  async def __aenter__(self):
    return self

  async def __aexit__(self, *exc):
    await self.close()

  def request(self, prompt: Prompt, params: Optional[GenerateParams] = None, **kwargs):
    return build_request(self.pb, prompt, params or GenerateParams(**kwargs))

  async def stream_request(self, req, *, timeout: Optional[float] = None,
                           metadata: Metadata = ()) -> AsyncIterator[Chunk]:
    """Streams the chunks of a prepared GenerateRequest. Leaving early (break, aclose, or the
    consuming task cancelled) cancels the call, so the decode node frees its KV pages."""
    call = self.stub.Generate(req, timeout=timeout or self.timeout, metadata=list(metadata))
    try:
      async for r in call:
        yield chunk_from_proto(r)
    except grpc.RpcError as e:  # aio.AioRpcError
      raise GenerationError(e.code().name, e.details() or "", req.request_id) from None
    finally:
      if not call.done():
        call.cancel()

  def stream(self, prompt: Prompt, params: Optional[GenerateParams] = None, *,
             timeout: Optional[float] = None, metadata: Metadata = (),
             **kwargs) -> AsyncIterator[Chunk]:
    return self.stream_request(self.request(prompt, params, **kwargs), timeout=timeout,
                               metadata=metadata)

  async def generate_request(self, req, *, timeout: Optional[float] = None,
                             metadata: Metadata = ()) -> Result:
    c = Collector(req.request_id, time.monotonic())
    stream = self.stream_request(req, timeout=timeout, metadata=metadata)
    try:
      async for chunk in stream:
        c.add(chunk, time.monotonic())
    finally:
      await stream.aclose()
    return c.result(time.monotonic())

  async def generate(self, prompt: Prompt, params: Optional[GenerateParams] = None, *,
                     timeout: Optional[float] = None, metadata: Metadata = (),
                     **kwargs) -> Result:
    return await self.generate_request(self.request(prompt, params, **kwargs), timeout=timeout,
                                       metadata=metadata)
