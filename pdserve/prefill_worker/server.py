"""The prefill worker: prompts in, first tokens back, KV out to decode workers.

A request's lifecycle through this worker::

    router --Prefill(prompt, sampling, destination = a decode worker's reservation)-->
      layouts compared first (a mismatch is refused, naming both sides' values)
      the engine queues the prompt to hand it off after one token: chunked prefill in batches under the
      token budget, its own prefix cache (a repeated prefix is not recomputed)
      during each step of the prefill, after each layer: the blocks that step completed beyond
        the destination's cached prefix --> the export thread --> KV transfer session (grpc:
        PushKV chunks), so the transfer overlaps every chunk's compute
      first token sampled (the request's own sampling and seed) --> PrefillResponse(first) at once
      after the last layer: commit --> PrefillResponse(transfer_done, ok | error)
    caller gone -> the prefill is aborted and the transfer with it

The worker also serves what every worker serves (``worker.servicer``: health, load snapshot,
drain, abort, and colocated ``Generate`` if asked). It receives no KV: ``Reserve`` and ``PushKV``
answer UNIMPLEMENTED. ``WorkerServer(engine, config, PrefillServicer)`` (worker/server.py) hosts it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer.base import KVLayout, KVSender, SenderContext, TransferError, sender_class
from pdserve.kvtransfer.faults import KVFaults
from pdserve.prefill_worker.export import Export, KVExporter
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.worker import convert
from pdserve.worker.servicer import WorkerServicer, abort_if_timed_out

log = logging.getLogger(__name__)


class PrefillServicer(WorkerServicer):
    role = "prefill"

    def __init__(self, engine, worker_id, config, address):
        super().__init__(engine, worker_id, config, address)
        llm = engine.engine
        self.exporter = KVExporter(llm.runner, llm.block_size, llm.model_config.num_layers)
        self.sender_context = SenderContext(asyncio.get_running_loop(), worker_id, KVFaults.parse(config.kv_fault))
        self.senders: dict[str, KVSender] = {}  # by backend name, each made when a destination first asks for it

    def _sender(self, backend: str) -> KVSender:
        """The sender of the destination's backend, from the kvtransfer registry (ValueError or
        TransferError when this worker cannot send with it)."""
        name = backend or "grpc"
        if name not in self.senders:
            self.senders[name] = sender_class(name).create(self.sender_context)
        return self.senders[name]

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        await self._refuse_if_draining(context)
        received = time.perf_counter()
        dest = request.destination
        problem = KVLayout.from_proto(dest.layout).mismatch(self.layout)  # the destination receives
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused at the handshake: {problem}")
        try:
            sender = self._sender(dest.backend)
        except (ValueError, TransferError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot send to this destination: {e}")
        try:
            params = convert.sampling_from_proto(request.sampling)
            queue_timeout_s = convert.queue_timeout_from_proto(request.queue_timeout_s)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, convert.encode_invalid(e))
        prompt = list(request.prompt_token_ids)
        # The request's own parameters (its stop strings, min_tokens, max_tokens), handed on to
        # the decode worker after the first token unless that token already ends it. (An async
        # generator: the engine validates the request on the first iteration, below.)
        stream = self.engine.generate(request.request_id, prompt, params, request.cache_salt or None,
                                      handoff_after=1, start_within_s=queue_timeout_s)
        session = sender.open(dest, self.layout, len(prompt))
        skip = dest.cached_tokens // self.layout.block_size
        self.exporter.add(request.request_id, Export(session, skip, len(prompt)))
        try:
            async for out in _invalid_as_status(stream, context):
                await abort_if_timed_out(out, request.queue_timeout_s, context)
                if out.finished:
                    self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
                    self.metrics.recent_ttft.observe(time.perf_counter() - received)  # the prompt's own part
                    yield pb.PrefillResponse(first=convert.output_to_proto(out))
            ok, error = await asyncio.wrap_future(session.done)
            self.metrics.kv_sent.labels("ok" if ok else "failed").inc()
            self.metrics.kv_sent_bytes.inc(session.sent_bytes)
            if not ok:
                log.warning("request %s: KV transfer to %s failed: %s", request.request_id, dest.kv_address, error)
            yield pb.PrefillResponse(transfer_done=True, transfer_ok=ok, transfer_error=error or "")
        finally:
            self.exporter.cancel(request.request_id, "the prefill request ended before its KV was sent")


async def _invalid_as_status(stream, context):
    """The engine's outputs; a request it refuses ends the call with INVALID_ARGUMENT naming the field."""
    try:
        async for out in stream:
            yield out
    except InvalidRequestError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, convert.encode_invalid(e))
