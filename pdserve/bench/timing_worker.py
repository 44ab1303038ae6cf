"""A timing-only worker, for router and harness benchmarks: NOT A MODEL.

It serves the ``Worker`` gRPC service and answers ``Generate`` with made-up tokens at a set
rate per stream, stamping each message with the time it was sent (``text`` is
``"<t=SECONDS>"``, ``time.time()``), so a client on the same machine can measure what the
path in between (the router) adds. It never touches a model, a tokenizer or a KV cache.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import grpc

import pdserve
from pdserve.configs import doc
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimingWorkerConfig:
    host: str = doc("127.0.0.1", "address to serve gRPC on")
    port: int = doc(0, "gRPC port (0: any free port)")
    tokens_per_s: float = doc(50.0, "tokens each stream emits per second")
    first_token_s: float = doc(0.0, "delay before a stream's first token (a stand-in for prefill)")
    default_max_tokens: int = doc(16, "tokens per request when the request sets no max_tokens")
    model: str = doc("timing-only-mock", "the model name this worker reports")
    max_model_len: int = doc(8192, "the context length this worker reports")


def stamp(t: float) -> str:
    return f"<t={t:.6f}>"


def parse_stamps(text: str) -> list[float]:
    return [float(x) for x in text.replace(">", "").split("<t=")[1:]]


class TimingWorker(pb_grpc.WorkerServicer):
    def __init__(self, config: TimingWorkerConfig, worker_id: str):
        self.config = config
        self.worker_id = worker_id
        self.active = 0
        self.sent = 0

    async def Generate(self, request: pb.GenerateRequest, context):
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else self.config.default_max_tokens
        gap = 1.0 / self.config.tokens_per_s
        self.active += 1
        try:
            start = time.monotonic() + self.config.first_token_s
            for i in range(n):
                await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
                last = i == n - 1
                self.sent += 1
                yield pb.GenerateResponse(
                    request_id=request.request_id, token_ids=[1000 + i % 1000], text=stamp(time.time()),
                    finished=last, finish_reason="length" if last else "",
                    num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=i + 1)
        finally:
            self.active -= 1

    async def Abort(self, request, context):
        return pb.AbortResponse(aborted=0)

    async def Health(self, request, context):
        return pb.HealthResponse(ok=True, status="serving")

    async def Stats(self, request, context):
        return pb.LoadSnapshot(worker_id=self.worker_id, role="decode", num_running=self.active,
                               generation_tokens_total=self.sent, timestamp=time.time())

    async def Info(self, request, context):
        return pb.WorkerInfo(worker_id=self.worker_id, role="decode", model=self.config.model,
                             model_fingerprint="timing-only", max_model_len=self.config.max_model_len,
                             block_size=16, version=pdserve.__version__)

    async def Drain(self, request, context):
        return pb.DrainResponse(remaining=self.active)


async def serve(config: TimingWorkerConfig) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    worker = TimingWorker(config, f"timing-only-{port}")
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    await server.start()
    print(f"PDSERVE_WORKER_READY {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
