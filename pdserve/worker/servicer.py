"""What every worker serves, whatever its role: the engine behind the ``Worker`` gRPC service.

A request's lifecycle through any worker (a role adds its own RPCs around it)::

    router --Generate(prompt, sampling)--> _start(): AsyncEngine.generate -> prefill chunks, decode steps
      each step's delta --> GenerateResponse on the stream --> router
      (TTFT, ITL measured here as the deltas leave)
    continuation (a decode worker was lost): Generate(prompt, output_token_ids=tokens so far,
      emitted_text_len) -> the prompt and those tokens computed here, then the rest
    finished -> last message has finish_reason; requests, tokens, e2e, TPOT, speculation counted;
      blocks back to the prefix cache
    caller gone -> the request is aborted; Abort(ids) -> the same for the router's ids
    Drain() -> new requests refused (UNAVAILABLE), in-flight ones finish
    Health / Stats (the load snapshot, also what registration heartbeats) / Info: any time
    KVSnapshot -> the cached prefix hashes as of a KV event number (the router's index resyncs)

Roles subclass ``WorkerServicer``: ``decode_worker.server.DecodeServicer`` (Reserve, PushKV and
Generate's resume of a reserved request, through ``_start``), ``prefill_worker.server.PrefillServicer``
(Prefill). An RPC a role does not define answers UNIMPLEMENTED (the generated base class). The
roles never import each other: they meet through ``kvtransfer`` and the protocol.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Coroutine

import grpc

import pdserve
from pdserve import compute_id
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestOutput
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer.base import KVLayout, TransferError
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker import convert
from pdserve.worker.config import WorkerConfig
from pdserve.worker.metrics import WorkerMetrics


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The KV-cache layout an engine holds: what a transfer's two sides must agree on."""
    cfg = engine.model_config
    kv_dtype = engine.config.dtype if engine.config.kv_cache_dtype == "auto" else engine.config.kv_cache_dtype
    groups = engine.kv_groups
    return KVLayout(engine.loaded.fingerprint, kv_dtype, engine.block_size, cfg.num_layers,
                    cfg.num_kv_heads, cfg.head_dim, layer_windows=groups.layer_windows if groups.num_groups > 1 else ())


async def abort_if_timed_out(out: RequestOutput, queue_timeout_s: float, context: grpc.aio.ServicerContext) -> None:
    """A request that ended unstarted at its queue timeout ends its call RESOURCE_EXHAUSTED (the
    router answers 429): requests of a higher class kept going ahead of it in this worker's queue."""
    if out.finish_reason == "queue_timeout":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"request {out.request_id} waited {queue_timeout_s:g} s in this worker's queue without "
                            f"starting (requests of a higher service class went ahead of it)")


def engine_compute(engine: LLMEngine) -> str:
    """What the engine computes on, as routers read it (pdserve/compute_id.py): its GPU, or its CPUs
    and threads (the configured ones, else one per CPU it may use)."""
    if engine.config.device == "cuda":
        import torch

        index = torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return compute_id.cuda_compute(str(uuid) if uuid else str(index))
    return compute_id.cpu_compute(engine.config.num_threads)


class WorkerServicer(pb_grpc.WorkerServicer):
    """The RPCs both roles serve. A role sets ``role``, adds its RPCs, and may override the hooks:
    ``_start`` (how Generate gets its output stream), ``abort``, ``on_start`` and
    ``background_tasks`` (run by ``WorkerServer``)."""

    role = ""  # "decode" | "prefill": in load snapshots, Info, the state store and worker ids

    def __init__(self, engine: AsyncEngine, worker_id: str, config: WorkerConfig, address: str):
        self.engine = engine
        self.worker_id = worker_id
        self.config = config
        self.address = address
        self.draining = False
        self.metrics = WorkerMetrics(engine.engine.kv.pool.events)
        self.layout = engine_layout(engine.engine)
        self.compute = engine_compute(engine.engine)

    @property
    def model_name(self) -> str:
        """The name routers know this worker's model by: --served-model-name, else the engine's."""
        return self.config.served_model_name or self.engine.engine.model_name

    # ---- hooks of a role ------------------------------------------------------------------------

    def on_start(self) -> None:
        """Called once by ``WorkerServer`` before the gRPC server answers (a role's own set-up)."""

    def background_tasks(self) -> list[Coroutine]:
        """Coroutines ``WorkerServer`` runs as tasks while it serves, cancelled when it stops."""
        return []

    async def _start(self, request: pb.GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The engine's output stream for a Generate call: here, the prompt computed on this worker
        (a ``kv_handle`` means nothing to a role that receives no KV)."""
        params = convert.sampling_from_proto(request.sampling)
        emitted = request.emitted_text_len if request.HasField("emitted_text_len") else None
        return self.engine.generate(request.request_id, list(request.prompt_token_ids), params,
                                    request.cache_salt or None, output_token_ids=list(request.output_token_ids),
                                    emitted_text_len=emitted,
                                    start_within_s=convert.queue_timeout_from_proto(request.queue_timeout_s))

    def abort(self, request_id: str) -> None:
        """Abort one request (the router's Abort): its blocks go back to the pool at once."""
        self.engine.abort(request_id)

    # ---- generation ---------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._refuse_if_draining(context)
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
                    await abort_if_timed_out(out, request.queue_timeout_s, context)
                yield convert.output_to_proto(out)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, convert.encode_invalid(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except TransferError as e:  # a role's _start found its KV unusable (decode: a resumed transfer)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def _refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")

    def _finished(self, out: RequestOutput, received: float, first: float | None, last: float | None) -> None:
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

    # ---- the rest of the service -------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        for request_id in request.request_ids:
            self.abort(request_id)
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
            prefill_tokens_per_s=s.prefill_tokens_per_s, decode_step_s=s.decode_step_s,
            decode_step_seqs=s.decode_step_seqs,
        )

    async def Info(self, request, context) -> pb.WorkerInfo:
        engine = self.engine.engine
        return pb.WorkerInfo(
            worker_id=self.worker_id, role=self.role, model=self.model_name,
            model_fingerprint=self.layout.model_fingerprint, max_model_len=engine.max_model_len,
            block_size=engine.block_size, version=pdserve.__version__, compute=self.compute,
        )

    async def KVSnapshot(self, request, context) -> pb.KVSnapshotResponse:
        """Every cached prefix hash, as of an event number: taken on the engine's thread, between
        steps, so the hashes and the number agree (the router's prefix index resyncs from it)."""
        snapshot = await self.engine.call(self.engine.engine.kv.pool.snapshot)
        return pb.KVSnapshotResponse(worker_id=self.worker_id, epoch=snapshot.epoch, seq=snapshot.seq,
                                     block_hashes=b"".join(snapshot.block_hashes))

    async def Drain(self, request, context) -> pb.DrainResponse:
        self.draining = True
        return pb.DrainResponse(remaining=self.engine.num_active)

