"""The decode worker: the worker base's service (``worker.servicer``), plus receiving a prompt's KV.

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
      no Generate within the lease -> the reservation is released (the sweeper)

    continuation (a decode worker was lost): Generate(prompt, output_token_ids=tokens so far)
    finished -> last message has finish_reason; blocks back to the prefix cache
    caller gone -> the request is aborted; Drain() -> new requests refused, in-flight ones finish

The gRPC server runs on asyncio; the engine steps in its own thread. ``WorkerServer(engine,
config, DecodeServicer)`` (worker/server.py) hosts it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Coroutine

import grpc

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer.base import KVLayout, TransferError
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.worker import convert
from pdserve.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class DecodeServicer(WorkerServicer):
    role = "decode"

    def __init__(self, engine, worker_id, config, address):
        super().__init__(engine, worker_id, config, address)
        self.receiver = KVReceiver(engine.engine.runner.kv_cache, self.layout, engine.engine.kv_groups)
        self._resumed: set[str] = set()
        self.torch_receiving = None  # the torch backend's receiving side, set by on_start
        self.backend_info: dict[str, str] = {}  # what a sender needs beyond kv_address (torch: the store)

    # ---- the worker base's hooks ------------------------------------------------------------------

    def on_start(self) -> None:
        if self.config.kv_backend == "torch":
            self._host_torch_rendezvous()

    def background_tasks(self) -> list[Coroutine]:
        return [self.sweep_expired()]

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.receiver.release(request_id)

    async def _start(self, request: pb.GenerateRequest):
        """A request with a ``kv_handle`` resumes its reservation; any other is the base's."""
        if not request.kv_handle:
            return await super()._start(request)
        handle = request.kv_handle
        self._resumed.add(handle)
        if not self.receiver.has(handle):  # released before the router came back: never lose it
            self.metrics.kv_transfers.labels("recomputed").inc()
            log.warning("request %s: its reservation was released before it resumed; computing the prompt here",
                        handle)
            return await super()._start(request)
        outputs = list(request.output_token_ids)
        emitted = request.emitted_text_len if request.HasField("emitted_text_len") else None
        if request.prefill_here:
            self.receiver.release(handle)
            self.metrics.kv_transfers.labels("prefilled_here").inc()
            return self.engine.resume(handle, False, outputs, emitted,
                                      convert.queue_timeout_from_proto(request.queue_timeout_s))
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

    # ---- remote prefill: the receiving side -----------------------------------------------------

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        await self._refuse_if_draining(context)
        try:
            params = convert.sampling_from_proto(request.sampling)
            got = await self.engine.reserve(request.request_id, list(request.prompt_token_ids), params,
                                            request.cache_salt or None)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, convert.encode_invalid(e))
        if got is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker {self.worker_id}: no KV blocks free")
        block_ids, cached, group_block_ids = got
        lease_s = (request.lease_ms or self.config.kv_lease_ms) / 1000
        self.receiver.expect(request.request_id, block_ids, cached // self.layout.block_size,
                             len(request.prompt_token_ids), lease_s, self.config.kv_reservation_ttl_ms / 1000,
                             group_block_ids)
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
        except grpc.aio.AbortError:  # a chunk that was not a KVChunk message (worker/malformed.py)
            if handle is not None:
                self.receiver.fail(handle, "malformed", "a chunk of the push was not a KVChunk message")
            raise
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

    def _host_torch_rendezvous(self) -> None:
        """The torch backend: a TCPStore here that senders join, and the receiving side of the
        point-to-point groups (their address goes to senders in ``backend_info``)."""
        from pdserve.kvtransfer.torch_backend import TorchReceiving, host_store

        host = self.config.host
        with socket.socket() as s:  # a free port for the TCPStore
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.store = host_store(host, port)  # kept alive with the servicer
        address = f"{host}:{port}"
        cache = self.engine.engine.runner.kv_cache
        self.torch_receiving = TorchReceiving(address, self.layout, cache.dtype, cache.device,
                                              per_block=cache[0, 0, 0].numel())
        self.backend_info = {"store": address}
