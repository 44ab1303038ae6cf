"""The committed gRPC stubs are exactly what the .proto sources generate."""

from __future__ import annotations

import subprocess
import sys


def test_stubs_match_proto_sources():
    out = subprocess.run([sys.executable, "-m", "pdserve.proto.generate", "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_stubs_import_under_the_package_name():
    from pdserve.proto.v1 import worker_pb2, worker_pb2_grpc

    assert worker_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(worker_pb2_grpc, "WorkerStub")
