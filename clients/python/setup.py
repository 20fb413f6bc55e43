"""Builds the kvwire package with its gRPC stubs generated from proto/kvwire/v1 (the package's
own kvwire.v1 subpackage: protoc names the modules after the .proto paths, so the stubs'
`from kvwire.v1 import kv_pb2` resolves inside this package). Everything else is in
pyproject.toml."""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("generation.proto", "kv.proto", "prefill.proto")


def proto_dir():
  d = os.environ.get("KVWIRE_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
  if not os.path.exists(os.path.join(d, "kvwire", "v1", "generation.proto")):
    sys.exit("kvwire: no kvwire/v1/generation.proto under %s (build from the repository, or set "
             "KVWIRE_PROTO_DIR)" % os.path.abspath(d))
  return os.path.abspath(d)


def protoc_command():
  """protoc + grpc_python_plugin from PATH (Debian's match Debian's protobuf runtime), else
  grpcio-tools' bundled protoc."""
  protoc = os.environ.get("KVWIRE_PROTOC") or shutil.which("protoc")
  plugin = shutil.which("grpc_python_plugin")
  if protoc and plugin:
    return [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]
  try:
    import grpc_tools  # pylint: disable=import-outside-toplevel,unused-import
    return [sys.executable, "-m", "grpc_tools.protoc"]
  except ImportError:
    sys.exit("kvwire: generating the gRPC stubs needs protoc and grpc_python_plugin on PATH "
             "(Debian: apt-get install protobuf-compiler protobuf-compiler-grpc) or grpcio-tools")


class BuildPyWithStubs(build_py):
  """build_py, then protoc into the build tree's kvwire/v1."""

  def run(self):
    super().run()
    src = proto_dir()
    out = os.path.join(self.build_lib)
    os.makedirs(os.path.join(out, "kvwire", "v1"), exist_ok=True)
    cmd = protoc_command() + ["-I", src, "--python_out", out, "--grpc_python_out", out]
    cmd += [os.path.join(src, "kvwire", "v1", p) for p in PROTOS]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "kvwire", "v1", "__init__.py"), "w") as f:
      f.write('"""Generated from proto/kvwire/v1 when the package was built."""\n')


setup(cmdclass={"build_py": BuildPyWithStubs})
