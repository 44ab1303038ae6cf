"""A worker's gRPC server around its engine, for either role, and the worker as a process.

    WorkerServer(engine, config, DecodeServicer | PrefillServicer)
      start(store): engine thread started -> gRPC port bound -> servicer built, its on_start()
        -> server answering -> the servicer's background tasks -> metrics port -> registered in
        the state store (``store``, or the Redis of ``config.redis``, or none) -> address
      stop(grace_s): draining (said in the store at once) -> in-flight requests finish, up to
        grace_s -> background tasks cancelled -> deregistered -> server and engine stopped

``serve()`` runs one as a process until SIGTERM/SIGINT and prints ``PDSERVE_WORKER_READY
host:port`` once it answers (the process launcher waits on that line); a Ray Serve replica
(``cluster/ray_app.py``) hosts a ``WorkerServer`` in its constructor instead. The gRPC server runs
on asyncio; the engine steps in its own thread (``engine.AsyncEngine``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable

import grpc

from pdserve.cluster_token import server_credentials, server_interceptors
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.state.store import StateStore
from pdserve.worker.config import WorkerConfig
from pdserve.worker.malformed import MalformedMessages
from pdserve.worker.registration import Registration, register
from pdserve.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # a KV chunk (grpc backend) is far below it; gRPC's 4 MiB default is not


class WorkerServer:
    """One worker's gRPC server around its engine, started and stopped by whoever hosts it.

    ``engine``: the engine, or a factory that builds it (``start`` loads it in the engine's loop
    thread: on CPU the thread that steps the model must be the one that loaded it, see
    ``AsyncEngine``). ``servicer_cls``: the role (``DecodeServicer`` or ``PrefillServicer``), built
    once the port is bound (its address is part of what it announces).
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], config: WorkerConfig,
                 servicer_cls: type[WorkerServicer]):
        self.config = config
        self.servicer_cls = servicer_cls
        self.engine = AsyncEngine(engine)
        self.servicer: WorkerServicer | None = None
        self.registration: Registration | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        return self.servicer.address

    async def start(self, store: StateStore | None = None) -> str:
        """Serve; returns the gRPC address (host:port). ``store``: a state store to register in
        (default: the Redis of ``config.redis``, or none)."""
        config, role = self.config, self.servicer_cls.role
        await self.engine.start_async()  # a factory builds the engine in its loop thread (AsyncEngine)
        # the cluster token, if any, then bytes that are not the method's message (INVALID_ARGUMENT)
        server = grpc.aio.server(interceptors=[*server_interceptors(config.host), MalformedMessages()],
                                 options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        credentials = server_credentials()  # TLS when the environment gives a certificate and key
        if credentials is None:
            port = server.add_insecure_port(f"{config.host}:{config.port}")
        else:
            port = server.add_secure_port(f"{config.host}:{config.port}", credentials)
        worker_id = config.worker_id or f"{role}-{config.host}-{port}-{uuid.uuid4().hex[:4]}"
        self.servicer = servicer = self.servicer_cls(self.engine, worker_id, config, f"{config.host}:{port}")
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        servicer.on_start()
        await server.start()
        self._server = server
        self._tasks = [asyncio.create_task(coro) for coro in servicer.background_tasks()]
        if config.metrics_port is not None:
            from prometheus_client import start_http_server

            httpd, _ = start_http_server(config.metrics_port, addr=config.host, registry=servicer.metrics.registry)
            self.metrics_port = httpd.server_port  # the port bound: --metrics-port 0 takes a free one
        if store is not None:
            self.registration = Registration(store, servicer, config.heartbeat_s)
            await self.registration.start()
        elif config.redis:
            self.registration = await register(servicer, config.redis, config.heartbeat_s, config.ttl_s)
        log.info("%s worker %s serving %s on %s", role, worker_id, self.engine.engine.model_name, self.address)
        return self.address

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new requests (and say so in the store at once), let in-flight ones finish
        for up to ``grace_s`` (default ``config.grace_s``), deregister, stop."""
        if self.servicer is None:
            return
        self.servicer.draining = True
        if self.registration is not None:
            try:
                await self.registration.beat()  # routers see "draining" now, not at the next heartbeat
            except Exception:
                log.exception("could not announce the drain in the state store")
        await self._finish_in_flight(self.config.grace_s if grace_s is None else grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.registration is not None:
            await self.registration.stop()
        await self._server.stop(grace=1.0)
        self.engine.shutdown()
        log.info("%s worker %s stopped (pid %d)", self.servicer.role, self.servicer.worker_id, os.getpid())
        self.servicer = None

    async def _finish_in_flight(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.engine.num_active:
            log.warning("worker %s: %d request(s) still running after the grace period; stopping anyway",
                        self.servicer.worker_id, self.engine.num_active)


async def serve(engine: LLMEngine | Callable[[], LLMEngine], config: WorkerConfig,
                servicer_cls: type[WorkerServicer]) -> None:
    """Serve until SIGTERM/SIGINT, then drain for up to ``grace_s`` and stop. ``engine``: as
    ``WorkerServer``'s (a factory: the engine is loaded in the thread that steps it)."""
    server = WorkerServer(engine, config, servicer_cls)
    address = await server.start()
    gc.collect()
    gc.freeze()  # the model and the engine live as long as the process: keep them out of full GC passes
    ready = f"PDSERVE_WORKER_READY {address}"
    if server.metrics_port is not None:
        ready += f" metrics={server.metrics_port}"
    print(ready, flush=True)  # for launchers waiting on stdout
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
