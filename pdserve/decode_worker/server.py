"""The decode worker: the engine behind the ``Worker`` gRPC service.

Lifecycle of a request through this worker (colocated serving: it prefills its own prompts)::

    router --Generate(prompt ids, sampling)--> handler: validate, AsyncEngine.generate()
        engine loop thread: queue -> scheduled -> prefill chunks + decode steps
        each step's delta --> GenerateResponse on the stream --> router
    finished (stop / length)  -> last message has finish_reason, blocks back to the prefix cache
    caller gone (cancelled)   -> the handler's iteration stops -> the engine aborts the request
    Drain()                   -> new Generate calls refused (UNAVAILABLE), in-flight ones finish

The gRPC server runs on asyncio; the engine steps in its own thread, so serving never blocks
on a forward pass.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass

import grpc

import pdserve
from pdserve.configs import doc
from pdserve.decode_worker import convert
from pdserve.decode_worker.metrics import WorkerMetrics
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """A worker process's own knobs (the engine's are EngineConfig's)."""

    host: str = doc("127.0.0.1", "address to serve gRPC on")
    port: int = doc(50051, "gRPC port (0: any free port)")
    worker_id: str = doc("", "name in load snapshots and logs (default: role-host-port)")
    metrics_port: int | None = doc(None, "serve Prometheus metrics over HTTP on this port (default: off)")
    grace_s: float = doc(30.0, "on SIGTERM, how long in-flight requests may take to finish")


class WorkerServicer(pb_grpc.WorkerServicer):
    role = "decode"

    def __init__(self, engine: AsyncEngine, worker_id: str, metrics: WorkerMetrics | None = None):
        self.engine = engine
        self.worker_id = worker_id
        self.draining = False
        self.metrics = metrics or WorkerMetrics()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        received = time.perf_counter()
        first = last = None
        try:
            params = convert.sampling_from_proto(request.sampling)
            stream = self.engine.generate(request.request_id, list(request.prompt_token_ids), params,
                                          request.cache_salt or None)
            async for out in stream:
                if out.new_token_ids:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        self.metrics.ttft.observe(now - received)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if out.finished:
                    self._finished(out, received, first, last)
                yield convert.output_to_proto(out)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, convert.encode_invalid(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))

    def _finished(self, out, received: float, first: float | None, last: float | None) -> None:
        m = self.metrics
        m.requests.labels(out.finish_reason or "unknown").inc()
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.generation_tokens.inc(out.num_output_tokens)
        if last is not None:
            m.e2e.observe(last - received)
            if out.num_output_tokens > 1:
                m.tpot.observe((last - first) / (out.num_output_tokens - 1))

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return pb.AbortResponse(aborted=len(request.request_ids))

    async def Health(self, request, context) -> pb.HealthResponse:
        if self.engine.error is not None:
            return pb.HealthResponse(ok=False, status=f"engine failed: {self.engine.error!r}")
        return pb.HealthResponse(ok=True, status="draining" if self.draining else "serving")

    async def Stats(self, request, context) -> pb.LoadSnapshot:
        return self.snapshot()

    def snapshot(self) -> pb.LoadSnapshot:
        s = self.engine.stats()
        return pb.LoadSnapshot(
            worker_id=self.worker_id, role=self.role, num_running=s.num_running, num_waiting=s.num_waiting,
            num_kv_blocks=s.num_kv_blocks, num_free_kv_blocks=s.num_free_kv_blocks, kv_usage=s.kv_usage,
            generation_tokens_per_s=self.engine.generation_rate(), prompt_tokens_total=s.prompt_tokens,
            generation_tokens_total=s.generation_tokens, waiting_prompt_tokens=s.waiting_prompt_tokens,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, draining=self.draining, timestamp=time.time(),
        )

    async def Info(self, request, context) -> pb.WorkerInfo:
        engine = self.engine.engine
        return pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, model=engine.model_name,
            model_fingerprint=engine.model_config.fingerprint(), max_model_len=engine.max_model_len,
            block_size=engine.block_size, version=pdserve.__version__,
        )

    async def Drain(self, request, context) -> pb.DrainResponse:
        self.draining = True
        return pb.DrainResponse(remaining=self.engine.num_active)


async def serve(engine: LLMEngine, config: WorkerConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain for up to ``grace_s`` and stop."""
    gc.collect()
    gc.freeze()  # the model and the engine live as long as the process: keep them out of full GC passes
    async_engine = AsyncEngine(engine)
    async_engine.start()
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.max_receive_message_length", 64 << 20)])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    worker_id = config.worker_id or f"decode-{config.host}-{port}-{uuid.uuid4().hex[:4]}"
    servicer = WorkerServicer(async_engine, worker_id)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    await server.start()
    if config.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(config.metrics_port, addr=config.host, registry=servicer.metrics.registry)
    log.info("decode worker %s serving %s on %s:%d", worker_id, engine.model_name, config.host, port)
    print(f"PDSERVE_WORKER_READY {config.host}:{port}", flush=True)  # for launchers waiting on stdout
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    servicer.draining = True
    deadline = time.monotonic() + config.grace_s
    while async_engine.num_active and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await server.stop(grace=1.0)
    async_engine.shutdown()
    log.info("decode worker %s stopped (pid %d)", worker_id, os.getpid())
