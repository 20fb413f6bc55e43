"""The blocking client."""
import time
from typing import Iterator, Optional, Sequence, Tuple

import grpc

from kvwire import _stubs
from kvwire.request import GenerateParams, Prompt, build_request
from kvwire.results import Chunk, Collector, GenerationError, Result, chunk_from_proto

Metadata = Sequence[Tuple[str, str]]


def make_credentials(tls_ca: str = "", tls_cert: str = "", tls_key: str = ""):
  """TLS channel credentials from PEM files (tls_ca alone: server authentication)."""

  def read(path):
    if not path:
      return None
    with open(path, "rb") as f:
      return f.read()

  return grpc.ssl_channel_credentials(root_certificates=read(tls_ca), private_key=read(tls_key),
                                      certificate_chain=read(tls_cert))


class Client:
  """Generate calls over one channel to `target` (a router or a decode node, host:port or any
  gRPC target). `timeout` (seconds) bounds every call unless the call gives its own."""

  def __init__(self, target: str, *, timeout: float = 120.0, tls_ca: str = "",
               tls_cert: str = "", tls_key: str = "", options: Sequence = ()):
    self.pb, pb_grpc = _stubs.load()
    if tls_ca or tls_cert:
      self.channel = grpc.secure_channel(target, make_credentials(tls_ca, tls_cert, tls_key),
                                         options=list(options))
    else:
      self.channel = grpc.insecure_channel(target, options=list(options))
    self.stub = pb_grpc.GenerationStub(self.channel)
    self.timeout = timeout

  def close(self):
    self.channel.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def request(self, prompt: Prompt, params: Optional[GenerateParams] = None, **kwargs):
    """The GenerateRequest message for these values (GenerateParams fields as keywords)."""
    return build_request(self.pb, prompt, params or GenerateParams(**kwargs))

  def stream_request(self, req, *, timeout: Optional[float] = None,
                     metadata: Metadata = ()) -> Iterator[Chunk]:
    """Streams the chunks of a prepared GenerateRequest; closing the iterator early cancels
    the call (the decode node frees its KV pages)."""
    call = self.stub.Generate(req, timeout=timeout or self.timeout, metadata=list(metadata))
    try:
      for r in call:
        yield chunk_from_proto(r)
    except grpc.RpcError as e:
      raise GenerationError(e.code().name, e.details() or "", req.request_id) from None
    finally:
      call.cancel()  # no-op when the call has ended

  def stream(self, prompt: Prompt, params: Optional[GenerateParams] = None, *,
             timeout: Optional[float] = None, metadata: Metadata = (),
             **kwargs) -> Iterator[Chunk]:
    return self.stream_request(self.request(prompt, params, **kwargs), timeout=timeout,
                               metadata=metadata)

  def generate_request(self, req, *, timeout: Optional[float] = None, metadata: Metadata = (),
                       on_text=None) -> Result:
    """Runs a prepared GenerateRequest to its end; `on_text(str)` sees the text as it comes."""
    c = Collector(req.request_id, time.monotonic())
    for chunk in self.stream_request(req, timeout=timeout, metadata=metadata):
      c.add(chunk, time.monotonic())
      if on_text is not None and chunk.text:
        on_text(chunk.text)
    return c.result(time.monotonic())

  def generate(self, prompt: Prompt, params: Optional[GenerateParams] = None, *,
               timeout: Optional[float] = None, metadata: Metadata = (), on_text=None,
               **kwargs) -> Result:
    return self.generate_request(self.request(prompt, params, **kwargs), timeout=timeout,
                                 metadata=metadata, on_text=on_text)
