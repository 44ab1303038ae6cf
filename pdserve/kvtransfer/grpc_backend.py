"""The grpc backend: a client stream of KVChunk messages to the decode worker's PushKV.

One chunk per layer and prefill step, or per group of blocks of about 1 MiB for long chunks: the
blocks' keys then values, in the cache's own layout (the only copy is the serialisation into the
message). Sessions are fed from the prefill worker's export thread; the stream runs on the
worker's event loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import grpc
import torch

from pdserve import cluster_token
from pdserve.kvtransfer.base import KVLayout, SenderContext, checksum, tensor_bytes
from pdserve.kvtransfer.faults import KVFaults
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20  # loopback gRPC streams fastest with messages of about 1 MiB
_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


class GrpcSender:
    def __init__(self, loop: asyncio.AbstractEventLoop, faults: KVFaults = KVFaults(), timeout_s: float = 120.0):
        """``timeout_s``: how long the receiver may take to answer once the commit is sent. The
        stream itself has no deadline: it lasts as long as the prompt's prefill (chunks go out as
        each step computes them), minutes for a long prompt on a loaded machine; a receiver that
        stops reading fails the transfer by its lease, a sender that stops by the receiver's."""
        self.loop = loop
        self.faults = faults
        self.timeout_s = timeout_s
        self._stubs: dict[str, pb_grpc.WorkerStub] = {}  # used from the event loop only

    @classmethod
    def create(cls, context: SenderContext) -> GrpcSender:
        return cls(context.loop, context.faults)

    def stub(self, address: str) -> pb_grpc.WorkerStub:
        if address not in self._stubs:
            self._stubs[address] = pb_grpc.WorkerStub(cluster_token.channel(address, options=_OPTIONS))
        return self._stubs[address]

    def open(self, destination: pb.ReserveResponse, layout: KVLayout, total_tokens: int) -> GrpcSession:
        return GrpcSession(self, destination, layout, total_tokens)


class GrpcSession:
    def __init__(self, sender: GrpcSender, destination: pb.ReserveResponse, layout: KVLayout, total_tokens: int):
        self.sender = sender
        self.handle = destination.handle
        self.address = destination.kv_address
        self.header = layout.to_proto(pb)
        self.total_tokens = total_tokens
        self.done: Future = Future()  # resolves to (ok, error)
        self.sent_bytes = 0
        self.started = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first = True
        self._call = None
        self._overdue = False  # the receiver did not answer within timeout_s of the commit
        asyncio.run_coroutine_threadsafe(self._run(), sender.loop)

    # ---- engine thread --------------------------------------------------------------------

    def send_layer(self, layer: int, first_block: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One message per group of blocks of about ``CHUNK_BYTES`` (one per layer for short prompts)."""
        faults = self.sender.faults
        if faults.drop_layer == layer:
            return
        per_block = 2 * keys[0].numel() * keys.element_size()
        step = max(1, CHUNK_BYTES // per_block)
        for start in range(0, keys.shape[0], step):
            k, v = tensor_bytes(keys[start : start + step]), tensor_bytes(values[start : start + step])
            msg = pb.KVChunk(handle=self.handle, layer=layer, first_block=first_block + start,
                             num_blocks=min(step, keys.shape[0] - start), keys=bytes(k), values=bytes(v),
                             checksum=checksum(k, v))
            if faults.corrupt_layer == layer and start == 0:
                msg.keys = bytes([msg.keys[0] ^ 0xFF]) + msg.keys[1:]
            self.sent_bytes += len(msg.keys) + len(msg.values)
            self._put(msg)

    def commit(self) -> None:
        if self.sender.faults.stall_s:
            self._put(("sleep", self.sender.faults.stall_s))
        self._put(pb.KVChunk(handle=self.handle, commit=True))
        self._put(None)

    def abort(self, reason: str) -> None:
        self._put(("abort", reason))

    def _put(self, item) -> None:
        self.sender.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    # ---- event loop -----------------------------------------------------------------------

    async def _messages(self):
        while True:
            item = await self._queue.get()
            if item is None:  # everything sent: the answer is due within timeout_s
                self.sender.loop.call_later(self.sender.timeout_s, self._answer_overdue)
                return
            if isinstance(item, tuple):
                kind, arg = item
                if kind == "sleep":
                    await asyncio.sleep(arg)
                    continue
                raise _Aborted(arg)
            if self._first:
                item.layout.CopyFrom(self.header)
                item.total_tokens = self.total_tokens
                item.handle = self.handle
                self._first = False
            yield item

    def _answer_overdue(self) -> None:
        if self._call is not None and not self._call.done():
            self._overdue = True
            self._call.cancel()

    async def _run(self) -> None:
        try:
            self._call = self.sender.stub(self.address).PushKV(self._messages())
            response = await self._call
            result = (response.ok, response.error or None)
        except _Aborted as e:
            result = (False, f"aborted by the sender: {e}")
        except grpc.aio.AioRpcError as e:
            result = (False, f"{e.code().name}: {e.details()}")
        except asyncio.CancelledError:
            if not self._overdue:  # the worker is shutting down
                self._resolve((False, "cancelled"))
                raise
            result = (False, "cancelled")
        except Exception as e:  # never leave the future unresolved
            result = (False, repr(e))
        if self._overdue:
            result = (False, f"DEADLINE_EXCEEDED: no answer {self.sender.timeout_s:g} s after the commit")
        self._resolve(result)

    def _resolve(self, result: tuple[bool, str | None]) -> None:
        if not self.done.done():
            self.done.set_result(result)


class _Aborted(Exception):
    pass
