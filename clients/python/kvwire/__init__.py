"""kvwire's Python client: `Client` (blocking) and `AsyncClient` (asyncio) call
kvwire.v1.Generation/Generate on a router or a decode node, stream the text, and return typed
results with what the compressed KV transfer saved (`Stats`).

    from kvwire import Client
    with Client("localhost:8080") as c:
      r = c.generate("Once upon a time", max_tokens=32, policy="snapkv", budget=64)
      print(r.text, r.stats.full_cache_bytes / r.stats.wire_bytes)

The gRPC stubs (`kvwire.v1`) are generated from proto/ when the package is built; run from the
source tree, they are found in any `kvwire/` folder on sys.path (the CMake build writes them to
build/python) or generated on first use with protoc (`kvwire._stubs`).
"""
import pkgutil

# The generated kvwire.v1 may live in another kvwire/ folder on sys.path (build/python).
__path__ = pkgutil.extend_path(__path__, __name__)  # noqa: F821

from kvwire.results import Chunk, Final, GenerationError, Result, Stats  # noqa: E402
from kvwire.request import GenerateParams, build_request  # noqa: E402
from kvwire.client import Client  # noqa: E402
from kvwire.aio import AsyncClient  # noqa: E402

__all__ = ["AsyncClient", "Chunk", "Client", "Final", "GenerateParams", "GenerationError",
           "Result", "Stats", "build_request"]
__version__ = "0.1.0"
