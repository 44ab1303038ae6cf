"""A KV receiver that keeps nothing, in a process of its own: what `pdserve profile` ships KV to when it
measures what shipping costs the *sending* side's engine steps.

A prefill worker ships each layer's KV while its engine computes the next ones; the sender's work
(the serialisation copy, the checksum, gRPC's framing and socket writes) runs on the worker's cores
beside the engine and slows its steps where they share them. Measured in one process with a real
decode worker (as the transfer *times* are), the receiver's work would slow them too; here the
receiver is another process, on other cores where there are any, as a decode worker would be.

The sink checks each chunk's checksum (as a decode worker does) and answers a commit with ok; it
writes nothing anywhere. Run: ``python -m pdserve.bench.kv_sink`` prints ``kv sink listening on
127.0.0.1:PORT`` once it serves, and serves until its parent closes its stdin (or SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys

import grpc

from pdserve.kvtransfer.base import checksum
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

READY = "kv sink listening on "
START_TIMEOUT_S = 60.0  # for it to serve (an import of grpc and a bind: about a second here)
MAX_MESSAGE_BYTES = 256 << 20  # as the senders' channels allow (kvtransfer/grpc_backend.py)


class SinkServicer(pb_grpc.WorkerServicer):
    """PushKV only: chunks checked (the senders' ``checksum``) and dropped; the other methods stay
    unimplemented (UNIMPLEMENTED)."""

    async def PushKV(self, request_iterator, context) -> pb.PushKVResponse:
        async for chunk in request_iterator:
            if chunk.commit:
                return pb.PushKVResponse(ok=True)
            if checksum(chunk.keys, chunk.values) != chunk.checksum:
                return pb.PushKVResponse(ok=False, error=f"checksum: layer {chunk.layer} block {chunk.first_block}")
        return pb.PushKVResponse(ok=False, error="the stream ended without a commit")


async def serve(host: str, port: int) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    pb_grpc.add_WorkerServicer_to_server(SinkServicer(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"{READY}{host}:{bound}", flush=True)
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(4096) else None)
    await stop.wait()
    await server.stop(0)


class Sink:
    """The sink in a child process: ``with Sink() as address: ...`` (``host:port``), stopped on leaving.
    ``avoid``: CPUs it keeps off where others are left (the engine's, so that its work does not slow the
    steps measured, as a decode worker on cores of its own would not)."""

    def __init__(self, avoid: set[int] = frozenset()):
        self.avoid = set(avoid)

    def __enter__(self) -> str:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.kv_sink"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        others = set(range(os.cpu_count() or 1)) - self.avoid
        if others:
            with contextlib.suppress(OSError):  # none of them allowed here: it stays where it started
                os.sched_setaffinity(self.proc.pid, others)
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""  # (a line, or "" where it exited)
        if not line.startswith(READY):
            self.__exit__(None, None, None)
            raise RuntimeError(f"the KV sink did not start within {START_TIMEOUT_S:g} s "
                               f"(exit code {self.proc.returncode}, said {line!r})")
        return line[len(READY):].strip()

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()  # its signal to stop
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.kv_sink", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free one, printed)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
