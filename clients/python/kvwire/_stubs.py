"""Finds the generated kvwire.v1 stubs: inside the installed package, in a kvwire/ folder on
sys.path (build/python from the CMake build), or, failing both, generated now with protoc and
grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc) from the .proto files
(KVWIRE_PROTO_DIR, else the repository's proto/ next to this source tree)."""
import os
import shutil
import subprocess
import sys
import tempfile

_loaded = None


def _generate(proto_dir):
  protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
  if not protoc or not plugin:
    raise ImportError("kvwire: the kvwire.v1 stubs were not built and protoc/grpc_python_plugin "
                      "are not on PATH to make them (pip install ./clients/python, or build "
                      "with CMake and put build/python on sys.path)")
  out = tempfile.mkdtemp(prefix="kvwire-stubs-")
  files = [os.path.join(proto_dir, "kvwire", "v1", f)
           for f in ("generation.proto", "kv.proto", "prefill.proto")]
  subprocess.run([protoc, "-I", proto_dir, "--python_out", out, "--grpc_out", out,
                  "--plugin=protoc-gen-grpc=" + plugin] + files, check=True)
  return os.path.join(out, "kvwire")


def load():
  """(generation_pb2, generation_pb2_grpc)."""
  global _loaded
  if _loaded is None:
    try:
      from kvwire.v1 import generation_pb2, generation_pb2_grpc  # pylint: disable=import-outside-toplevel
    except ImportError:
      here = os.path.dirname(os.path.abspath(__file__))
      proto_dir = os.environ.get("KVWIRE_PROTO_DIR") or os.path.join(here, "..", "..", "..",
                                                                     "proto")
      import kvwire  # pylint: disable=import-outside-toplevel
      kvwire.__path__.append(_generate(os.path.abspath(proto_dir)))
      sys.modules.pop("kvwire.v1", None)
      from kvwire.v1 import generation_pb2, generation_pb2_grpc  # pylint: disable=import-outside-toplevel
    _loaded = (generation_pb2, generation_pb2_grpc)
  return _loaded
