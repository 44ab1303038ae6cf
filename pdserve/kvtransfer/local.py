"""The local backend: sender and receiver in one process (engine-level tests, single-process
setups). Chunks are tensors copied straight into the receiver's blocks; no bytes, no checksum."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from pdserve.kvtransfer.base import KVLayout, SenderContext, TransferError
from pdserve.kvtransfer.receiver import KVReceiver


class LocalHub:
    """Where in-process receivers are found by address (``local://NAME``)."""

    def __init__(self) -> None:
        self.receivers: dict[str, KVReceiver] = {}

    def register(self, address: str, receiver: KVReceiver) -> None:
        self.receivers[address] = receiver


class LocalSender:
    def __init__(self, hub: LocalHub):
        self.hub = hub

    @classmethod
    def create(cls, context: SenderContext) -> LocalSender:
        if context.local_hub is None:
            raise TransferError("backend", "the local backend sends only to receivers in this process (no hub here)")
        return cls(context.local_hub)

    def open(self, destination, layout: KVLayout, total_tokens: int) -> LocalSession:
        return LocalSession(self.hub.receivers[destination.kv_address], destination.handle, layout, total_tokens)


class LocalSession:
    def __init__(self, receiver: KVReceiver, handle: str, layout: KVLayout, total_tokens: int):
        self.receiver = receiver
        self.handle = handle
        self.done: Future = Future()
        self.sent_bytes = 0
        self.started = time.monotonic()
        try:
            receiver.begin(handle, layout, total_tokens)
        except TransferError as e:
            self.done.set_result((False, str(e)))

    def send_layer(self, layer: int, first_block: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.done.done():
            return
        try:
            self.receiver.chunk(self.handle, layer, first_block, keys, values, None)
            self.sent_bytes += 2 * keys.numel() * keys.element_size()
        except TransferError as e:
            self.done.set_result((False, str(e)))

    def commit(self) -> None:
        if self.done.done():
            return
        try:
            self.receiver.commit(self.handle)
            self.done.set_result((True, None))
        except TransferError as e:
            self.done.set_result((False, str(e)))

    def abort(self, reason: str) -> None:
        self.receiver.fail(self.handle, "aborted", reason)
        if not self.done.done():
            self.done.set_result((False, reason))
