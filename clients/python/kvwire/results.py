"""Typed results of a Generate call."""
import dataclasses
from typing import List, Optional


@dataclasses.dataclass
class Stats:
  """What the request cost and saved, measured by the decode node (proto RequestStats)."""
  prompt_tokens: int = 0
  kept_tokens: int = 0           # prompt tokens kept per KV head (first compressed layer)
  full_cache_bytes: int = 0      # K/V of every prompt token: an uncompressed transfer
  wire_bytes: int = 0            # bytes of KV messages actually received
  kv_payload_bytes: int = 0      # positions, K and V (wire bytes less framing)
  transfer_ms: float = 0.0       # first KV byte to trailer
  prefill_ms: float = 0.0
  queue_ms: float = 0.0
  ttft_ms: float = 0.0           # request arrival to first token, on the decode node
  mean_itl_ms: float = 0.0
  policy: str = ""
  prefill_node: str = ""
  decode_node: str = ""
  attention: str = ""
  prefill_attempts: int = 0

  @property
  def compression_ratio(self) -> float:
    """Full-cache bytes / wire bytes: how many times fewer bytes crossed the network."""
    return self.full_cache_bytes / self.wire_bytes if self.wire_bytes else float("nan")

  @classmethod
  def from_proto(cls, st) -> "Stats":
    return cls(**{f.name: getattr(st, f.name) for f in dataclasses.fields(cls)})

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["compression_ratio"] = self.compression_ratio if self.wire_bytes else None
    return d


@dataclasses.dataclass
class Final:
  """The last message's contents."""
  finish_reason: str             # "length" or "stop"
  prompt_tokens: int
  completion_tokens: int
  stats: Stats


@dataclasses.dataclass
class Chunk:
  """One streamed message: new tokens (one, or several under the decode node's
  --stream-interval or when the reader is behind), their text (never half a UTF-8 character),
  their log-probabilities and each token's own text (with logprobs=True; "" for a token that
  ends inside a UTF-8 character), and on the last message `final`."""
  token_ids: List[int]
  text: str
  logprobs: List[float]
  final: Optional[Final] = None
  token_texts: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Result:
  """A whole generation."""
  request_id: str
  text: str
  token_ids: List[int]
  logprobs: List[float]
  finish_reason: str
  prompt_tokens: int
  completion_tokens: int
  stats: Stats
  client_ttft_ms: float          # call start to the first token, seen by this client
  token_texts: List[str] = dataclasses.field(default_factory=list)  # with logprobs=True


class GenerationError(Exception):
  """A Generate call that failed: `code` is the gRPC status name (INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ...)."""

  def __init__(self, code: str, details: str, request_id: str = ""):
    super().__init__("%s: %s" % (code, details))
    self.code = code
    self.details = details
    self.request_id = request_id


FINISH_REASONS = {1: "length", 2: "stop"}


def chunk_from_proto(r) -> Chunk:
  final = None
  if r.HasField("final"):
    f = r.final
    final = Final(finish_reason=FINISH_REASONS.get(f.finish_reason, "unspecified"),
                  prompt_tokens=f.usage.prompt_tokens,
                  completion_tokens=f.usage.completion_tokens, stats=Stats.from_proto(f.stats))
  return Chunk(token_ids=list(r.token_ids), text=r.text, logprobs=list(r.logprobs), final=final,
               token_texts=list(r.token_texts))


class Collector:
  """Folds chunks into a Result."""

  def __init__(self, request_id: str, start: float):
    self.request_id, self.start = request_id, start
    self.first = None
    self.text, self.ids, self.logprobs, self.token_texts, self.final = [], [], [], [], None

  def add(self, chunk: Chunk, now: float):
    if chunk.token_ids and self.first is None:
      self.first = now
    self.ids.extend(chunk.token_ids)
    self.text.append(chunk.text)
    self.logprobs.extend(chunk.logprobs)
    self.token_texts.extend(chunk.token_texts)
    if chunk.final is not None:
      self.final = chunk.final

  def result(self, now: float) -> Result:
    if self.final is None:
      raise GenerationError("INTERNAL", "the stream ended without its final message",
                            self.request_id)
    f = self.final
    return Result(request_id=self.request_id, text="".join(self.text), token_ids=self.ids,
                  logprobs=self.logprobs, finish_reason=f.finish_reason,
                  prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                  stats=f.stats, client_ttft_ms=1e3 * ((self.first or now) - self.start),
                  token_texts=self.token_texts)
