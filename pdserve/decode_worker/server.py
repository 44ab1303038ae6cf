"""The decode worker: the engine behind the ``Worker`` gRPC service.

A request's lifecycle through this worker::

    colocated (it prefills its own prompt):
      router --Generate(prompt, sampling)--> AsyncEngine.generate -> prefill chunks, decode steps
        each step's delta --> GenerateResponse on the stream --> router

    disaggregated (the prompt's KV comes from a prefill worker):
      router --Reserve(prompt)--> blocks reserved (a local prefix hit is kept), lease started
      prefill worker --PushKV(layer chunks, commit)--> written into the reserved blocks
      router --Generate(kv_handle, output_token_ids=[first token])--> wait for the transfer:
        landed        -> prompt counted as computed, decoding starts after the first token
        failed/expired -> the prompt is computed here (same output), counted by reason
      no Generate within the lease -> the reservation is released

    continuation (a decode worker was lost): Generate(prompt, output_token_ids=tokens so far)
    finished -> last message has finish_reason; blocks back to the prefix cache
    caller gone -> the request is aborted; Drain() -> new requests refused, in-flight ones finish

The gRPC server runs on asyncio; the engine steps in its own thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
import uuid

import grpc

import pdserve
from pdserve.decode_worker import convert
from pdserve.decode_worker.config import WorkerConfig
from pdserve.decode_worker.metrics import WorkerMetrics
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer.base import KVLayout, TransferError
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def engine_layout(engine: LLMEngine) -> KVLayout:
    cfg = engine.model_config
    kv_dtype = engine.config.dtype if engine.config.kv_cache_dtype == "auto" else engine.config.kv_cache_dtype
    return KVLayout(engine.loaded.fingerprint, kv_dtype, engine.block_size, cfg.num_layers,
                    cfg.num_kv_heads, cfg.head_dim)


class WorkerServicer(pb_grpc.WorkerServicer):
    role = "decode"

    def __init__(self, engine: AsyncEngine, worker_id: str, config: WorkerConfig, address: str):
        self.engine = engine
        self.worker_id = worker_id
        self.config = config
        self.address = address
        self.draining = False
        self.metrics = WorkerMetrics(engine.engine.kv.pool.events)
        self.layout = engine_layout(engine.engine)
        self.receiver = KVReceiver(engine.engine.runner.kv_cache, self.layout)
        self._resumed: set[str] = set()
        self.torch_receiving = None  # set by serve() for the torch backend
        self.backend_info: dict[str, str] = {}

    # ---- generation ---------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        received = time.perf_counter()
        first = last = None
        try:
            stream = await self._start(request)
            async for out in stream:
                if out.new_token_ids:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        self.metrics.ttft.observe(now - received)
                        self.metrics.recent_ttft.observe(now - received)
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
        except TransferError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def _start(self, request: pb.GenerateRequest):
        params = convert.sampling_from_proto(request.sampling)
        outputs = list(request.output_token_ids)
        emitted = request.emitted_text_len if request.HasField("emitted_text_len") else None
        if not request.kv_handle:
            return self.engine.generate(request.request_id, list(request.prompt_token_ids), params,
                                        request.cache_salt or None, output_token_ids=outputs, emitted_text_len=emitted)
        handle = request.kv_handle
        self._resumed.add(handle)
        if not self.receiver.has(handle):  # released before the router came back: never lose it
            self.metrics.kv_transfers.labels("recomputed").inc()
            log.warning("request %s: its reservation was released before it resumed; computing the prompt here",
                        handle)
            return self.engine.generate(request.request_id, list(request.prompt_token_ids), params,
                                        request.cache_salt or None, output_token_ids=outputs, emitted_text_len=emitted)
        if request.prefill_here:
            self.receiver.release(handle)
            self.metrics.kv_transfers.labels("prefilled_here").inc()
            return self.engine.resume(handle, False, outputs, emitted)
        ok, reason = await self.receiver.wait(handle)
        incoming = self.receiver.release(handle)
        self._count_transfer(incoming, ok, reason)
        return self.engine.resume(handle, ok, outputs, emitted)

    def _count_transfer(self, incoming, ok: bool, reason: str | None) -> None:
        m = self.metrics
        m.kv_transfers.labels("ok" if ok else "recomputed").inc()
        if incoming is None:
            return
        if ok:
            m.kv_bytes.inc(incoming.bytes)
            if incoming.started is not None:
                m.kv_transfer_time.observe(time.monotonic() - incoming.started)
        else:
            m.kv_failures.labels(reason or "unknown").inc()
            log.warning("request %s: KV transfer failed (%s: %s); computing the prompt here", incoming.handle,
                        reason, incoming.error)

    def _finished(self, out, received: float, first: float | None, last: float | None) -> None:
        m = self.metrics
        m.requests.labels(out.finish_reason or "unknown").inc()
        m.prompt_tokens.inc(out.num_prompt_tokens)
        m.generation_tokens.inc(out.num_output_tokens)
        if last is not None:
            m.e2e.observe(last - received)
            if out.num_output_tokens > 1 and first is not None and last > first:
                m.tpot.observe((last - first) / (out.num_output_tokens - 1))
                m.recent_tpot.observe((last - first) / (out.num_output_tokens - 1))
        if out.spec_steps:
            m.spec_proposed.inc(out.spec_proposed)
            m.spec_accepted.inc(out.spec_accepted)
            m.spec_acceptance.observe(out.spec_accepted / max(out.spec_proposed, 1))
            m.spec_accepted_length.observe((out.spec_accepted + out.spec_steps) / out.spec_steps)

    # ---- remote prefill: the receiving side -----------------------------------------------------

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        try:
            params = convert.sampling_from_proto(request.sampling)
            got = await self.engine.reserve(request.request_id, list(request.prompt_token_ids), params,
                                            request.cache_salt or None)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, convert.encode_invalid(e))
        if got is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker {self.worker_id}: no KV blocks free")
        block_ids, cached = got
        lease_s = (request.lease_ms or self.config.kv_lease_ms) / 1000
        self.receiver.expect(request.request_id, block_ids, cached // self.layout.block_size,
                             len(request.prompt_token_ids), lease_s, self.config.kv_reservation_ttl_ms / 1000)
        return pb.ReserveResponse(handle=request.request_id, cached_tokens=cached, layout=self.layout.to_proto(pb),
                                  kv_address=self.address, backend=self.config.kv_backend,
                                  backend_info=self.backend_info)

    async def PushKV(self, request_iterator, context) -> pb.PushKVResponse:
        handle = None
        try:
            async for chunk in request_iterator:
                if handle is None:
                    handle = chunk.handle
                    self.receiver.begin(handle, KVLayout.from_proto(chunk.layout), chunk.total_tokens)
                if chunk.commit:
                    self.receiver.commit(handle)
                    return pb.PushKVResponse(ok=True)
                if chunk.peer:  # torch backend: the tensor travels by torch.distributed
                    if self.torch_receiving is None:
                        raise TransferError("backend", "this worker does not receive with the torch backend")
                    keys, values = await asyncio.get_running_loop().run_in_executor(
                        self.torch_receiving.pool, self.torch_receiving.receive, chunk)
                    self.receiver.chunk(handle, chunk.layer, chunk.first_block, keys, values, None)
                else:
                    self.receiver.chunk(handle, chunk.layer, chunk.first_block, chunk.keys, chunk.values,
                                        chunk.checksum)
            if handle is not None:
                self.receiver.fail(handle, "stream_broken", "the stream ended without a commit")
            return pb.PushKVResponse(ok=False, error="the stream ended without a commit")
        except TransferError as e:
            if handle is not None:
                self.receiver.fail(handle, e.reason, str(e))
            return pb.PushKVResponse(ok=False, error=f"{e.reason}: {e}")
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            if handle is not None:
                self.receiver.fail(handle, "stream_broken", "the sender went away mid-transfer")
            raise

    async def sweep_expired(self) -> None:
        """Release reservations nobody resumed within their lease (plus a grace second)."""
        while True:
            await asyncio.sleep(1.0)
            for handle in self.receiver.expired(time.monotonic() - 1.0):
                if handle not in self._resumed:
                    self.receiver.release(handle)
                    self.engine.abort(handle)
                    self.metrics.kv_failures.labels("never_resumed").inc()
                    log.warning("request %s: reservation expired unused; blocks released", handle)
            self._resumed &= self.receiver.handles()

    # ---- the rest of the service -------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
            self.receiver.release(request_id)
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
            worker_id=self.worker_id, role=self.role, num_running=s.num_running,
            num_waiting=s.num_waiting + s.num_waiting_remote_kv, num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks, kv_usage=s.kv_usage,
            generation_tokens_per_s=self.engine.generation_rate(), prompt_tokens_total=s.prompt_tokens,
            generation_tokens_total=s.generation_tokens, waiting_prompt_tokens=s.waiting_prompt_tokens,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, draining=self.draining, timestamp=time.time(),
        )

    async def Info(self, request, context) -> pb.WorkerInfo:
        engine = self.engine.engine
        return pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, model=engine.model_name,
            model_fingerprint=self.layout.model_fingerprint, max_model_len=engine.max_model_len,
            block_size=engine.block_size, version=pdserve.__version__,
        )

    async def Drain(self, request, context) -> pb.DrainResponse:
        self.draining = True
        return pb.DrainResponse(remaining=self.engine.num_active)


def _host_torch_rendezvous(servicer: WorkerServicer, host: str, engine: LLMEngine) -> None:
    import socket

    from pdserve.kvtransfer.torch_backend import TorchReceiving, host_store

    with socket.socket() as s:  # a free port for the TCPStore
        s.bind((host, 0))
        port = s.getsockname()[1]
    servicer.store = host_store(host, port)  # kept alive with the servicer
    address = f"{host}:{port}"
    cache = engine.runner.kv_cache
    servicer.torch_receiving = TorchReceiving(address, servicer.layout, cache.dtype, cache.device,
                                              per_block=cache[0, 0, 0].numel())
    servicer.backend_info = {"store": address}


class WorkerServer:
    """One worker's gRPC server around its engine, started and stopped by whoever hosts it.

    ``serve()`` below runs it as a process until a signal; a Ray Serve replica
    (``pdserve.cluster.ray_app``) starts it in its constructor and drains it when Serve stops the
    replica. ``store``: a started state store to register in (default: the Redis of
    ``config.redis``, or none).
    """

    def __init__(self, engine: LLMEngine, config: WorkerConfig,
                 servicer_cls: type[WorkerServicer] = WorkerServicer):
        self.llm = engine
        self.config = config
        self.servicer_cls = servicer_cls
        self.engine = AsyncEngine(engine)
        self.servicer: WorkerServicer | None = None
        self.registration = None
        self._server = None
        self._sweeper: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.servicer.address

    async def start(self, store=None) -> str:
        """Serve; returns the gRPC address (host:port)."""
        config, role = self.config, self.servicer_cls.role
        self.engine.start()
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 << 20),
                                          ("grpc.max_receive_message_length", 256 << 20)])
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        worker_id = config.worker_id or f"{role}-{config.host}-{port}-{uuid.uuid4().hex[:4]}"
        self.servicer = servicer = self.servicer_cls(self.engine, worker_id, config, f"{config.host}:{port}")
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        if config.kv_backend == "torch" and role == "decode":
            _host_torch_rendezvous(servicer, config.host, self.llm)
        await server.start()
        self._server = server
        self._sweeper = asyncio.create_task(servicer.sweep_expired())
        if config.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(config.metrics_port, addr=config.host, registry=servicer.metrics.registry)
        from pdserve.decode_worker.registration import Registration, register

        if store is not None:
            self.registration = Registration(store, servicer, config.heartbeat_s)
            await self.registration.start()
        elif config.redis:
            self.registration = await register(servicer, config.redis, config.heartbeat_s, config.ttl_s)
        log.info("%s worker %s serving %s on %s", role, worker_id, self.llm.model_name, self.address)
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
        deadline = time.monotonic() + (self.config.grace_s if grace_s is None else grace_s)
        while self.engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.engine.num_active:
            log.warning("worker %s: %d request(s) still running after the grace period; stopping anyway",
                        self.servicer.worker_id, self.engine.num_active)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.registration is not None:
            await self.registration.stop()
        await self._server.stop(grace=1.0)
        self.engine.shutdown()
        log.info("%s worker %s stopped (pid %d)", self.servicer.role, self.servicer.worker_id, os.getpid())
        self.servicer = None


async def serve(engine: LLMEngine, config: WorkerConfig, servicer_cls: type[WorkerServicer] = WorkerServicer) -> None:
    """Serve until SIGTERM/SIGINT, then drain for up to ``grace_s`` and stop."""
    gc.collect()
    gc.freeze()  # the model and the engine live as long as the process: keep them out of full GC passes
    server = WorkerServer(engine, config, servicer_cls)
    address = await server.start()
    print(f"PDSERVE_WORKER_READY {address}", flush=True)  # for launchers waiting on stdout
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
