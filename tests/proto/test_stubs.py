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


def test_a_newer_generator_of_the_series_is_no_difference_but_a_changed_stub_is():
    """grpcio-tools 1.85.4 writes ``GRPC_GENERATED_VERSION = '1.85.4'`` where the committed stubs (1.85.1)
    say '1.85.1'; the registry moved between two installs of the same commit, and the check failed on it."""
    from pdserve.proto.generate import same_stub

    committed = b"import grpc\n\nGRPC_GENERATED_VERSION = '1.85.1'\nGRPC_VERSION = grpc.__version__\n"
    assert same_stub(committed, committed.replace(b"1.85.1", b"1.85.4"))
    assert not same_stub(committed, committed.replace(b"GRPC_VERSION", b"GRPC_VERSION_"))
