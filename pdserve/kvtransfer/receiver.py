"""The receiving side: reserved blocks waiting for their KV, written as chunks arrive.

    receiver.expect(handle, block_ids, skip_blocks, lease_s)   # at reservation
    receiver.begin(handle, sender_layout)                      # handshake: layouts must match
    receiver.chunk(handle, layer, first_block, keys, values, crc)  # any order, any thread; each
                                                               # renews the lease
    receiver.commit(handle)                                    # every (layer, block) seen?
    ok, reason = await receiver.wait(handle)       # DONE, FAILED, or lease_s passed without a chunk

Chunks are written straight into the reserved blocks of the cache: nothing else reads those
blocks until the transfer is done (they are not offered to prefix hits), so writing from the
transfer's thread while the engine steps is safe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kvtransfer.base import KVLayout, TransferError, TransferState, checksum


@dataclass
class Incoming:
    handle: str
    block_ids: list[int]
    skip_blocks: int  # leading blocks already cached here: not sent
    # time.monotonic(): ``wait_s`` for the transfer to begin; while it runs, ``lease_s`` past its
    # latest chunk (the lease is renewed by progress); once done, ``wait_s`` for its request
    deadline: float
    lease_s: float = 10.0
    wait_s: float = 10.0
    state: TransferState = TransferState.WAITING
    reason: str | None = None  # why it failed
    error: str | None = None
    started: float | None = None
    bytes: int = 0
    seen: dict[int, set[int]] = field(default_factory=dict)  # layer -> block indices received
    done: Future = field(default_factory=Future)

    @property
    def expected_blocks(self) -> int:
        return len(self.block_ids) - self.skip_blocks


class KVReceiver:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout):
        """``kv_cache``: the engine's ``[layers, 2, blocks, kv_heads, block_size * head_dim]`` tensor."""
        self.kv_cache = kv_cache
        self.layout = layout
        self._incoming: dict[str, Incoming] = {}
        self._lock = threading.Lock()
        self._np_dtype = torch.empty(0, dtype=kv_cache.dtype).numpy().dtype

    def expect(self, handle: str, block_ids: list[int], skip_blocks: int, lease_s: float,
               wait_s: float | None = None) -> Incoming:
        """Reserve ``block_ids`` for ``handle``: they wait ``wait_s`` (default ``lease_s``) for the
        transfer to begin (the prompt may queue on a busy prefill worker); then the transfer
        fails once ``lease_s`` pass without a chunk.

        Why a lease renewed by every chunk, not a deadline from the first: chunks come as the
        prefill computes (each layer as it finishes), so a transfer lasts as long as the step
        that computes the prompt, seconds for a long prompt and more on a loaded machine; what
        the lease must catch is a sender that stopped, not one that computes."""
        wait = lease_s if wait_s is None else max(wait_s, lease_s)
        incoming = Incoming(handle, list(block_ids), skip_blocks, time.monotonic() + wait, lease_s, wait)
        if incoming.expected_blocks == 0:  # everything was cached here already
            self._finish(incoming, TransferState.DONE)
        with self._lock:
            self._incoming[handle] = incoming
        return incoming

    def get(self, handle: str) -> Incoming:
        incoming = self._incoming.get(handle)
        if incoming is None:
            raise TransferError("unknown_handle", f"no reservation {handle!r} here (expired or never made)")
        return incoming

    def begin(self, handle: str, layout: KVLayout) -> Incoming:
        incoming = self.get(handle)
        problem = self.layout.mismatch(layout)
        if problem:
            self.fail(handle, "layout_mismatch", problem)
            raise TransferError("layout_mismatch", problem)
        if incoming.state is TransferState.FAILED:
            # A new sender takes over a failed transfer (its first sender died): start afresh.
            incoming.seen.clear()
            incoming.reason = incoming.error = None
            incoming.done = Future()
            incoming.state = TransferState.WAITING
        if incoming.state is TransferState.WAITING:
            incoming.state = TransferState.TRANSFERRING
            incoming.started = time.monotonic()
            incoming.deadline = incoming.started + incoming.lease_s
        return incoming

    def chunk(self, handle: str, layer: int, first_block: int, keys, values, crc: int | None) -> None:
        """Write ``keys``/``values`` (bytes, or tensors from an in-process sender) into the blocks
        ``first_block ...`` (indices into the request's block table) of ``layer``."""
        incoming = self.get(handle)
        if incoming.state is not TransferState.TRANSFERRING:
            raise TransferError("state", f"transfer {handle} is {incoming.state.value}, not transferring")
        per_block = self.kv_cache[0, 0, 0].numel()  # a block's elements (a quantized block's scales included)
        if isinstance(keys, torch.Tensor):
            k_src, v_src = keys.reshape(-1, per_block), values.reshape(-1, per_block)
        else:
            if crc is not None and checksum(keys, values) != crc:
                raise self._failure(handle, "checksum", f"layer {layer}, blocks from {first_block}: checksum mismatch")
            k_src = np.frombuffer(keys, dtype=self._np_dtype).reshape(-1, per_block)
            v_src = np.frombuffer(values, dtype=self._np_dtype).reshape(-1, per_block)
        n = k_src.shape[0]
        if not 0 <= layer < self.layout.num_layers or first_block < incoming.skip_blocks or \
                first_block + n > len(incoming.block_ids) or v_src.shape[0] != n:
            raise self._failure(handle, "range", f"layer {layer} blocks [{first_block}, {first_block + n}) are "
                                                 f"outside the reservation of {len(incoming.block_ids)} blocks")
        cache_k, cache_v = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        for j in range(n):
            block = incoming.block_ids[first_block + j]
            _copy(cache_k[block], k_src[j])
            _copy(cache_v[block], v_src[j])
        incoming.bytes += 2 * n * per_block * self.kv_cache.element_size()
        incoming.seen.setdefault(layer, set()).update(range(first_block, first_block + n))
        incoming.deadline = time.monotonic() + incoming.lease_s  # progress renews the lease

    def commit(self, handle: str) -> None:
        incoming = self.get(handle)
        want = set(range(incoming.skip_blocks, len(incoming.block_ids)))
        missing = [layer for layer in range(self.layout.num_layers) if incoming.seen.get(layer, set()) != want]
        if missing:
            raise self._failure(handle, "incomplete", f"commit with layers {missing[:5]} incomplete")
        incoming.deadline = time.monotonic() + incoming.wait_s  # the KV is here: it waits for its request
        self._finish(incoming, TransferState.DONE)

    def fail(self, handle: str, reason: str, message: str) -> None:
        incoming = self._incoming.get(handle)
        if incoming is not None and incoming.state is not TransferState.DONE:
            incoming.reason, incoming.error = reason, message
            self._finish(incoming, TransferState.FAILED)

    def _failure(self, handle: str, reason: str, message: str) -> TransferError:
        self.fail(handle, reason, message)
        return TransferError(reason, message)

    @staticmethod
    def _finish(incoming: Incoming, state: TransferState) -> None:
        if incoming.state in (TransferState.DONE, TransferState.FAILED):
            return
        incoming.state = state
        if not incoming.done.done():
            incoming.done.set_result(state)

    async def wait(self, handle: str) -> tuple[bool, str | None]:
        """Until the transfer is done, failed, or its lease runs out: (ok, failure reason)."""
        incoming = self.get(handle)
        while not incoming.done.done():
            remaining = incoming.deadline - time.monotonic()  # moves when the transfer begins
            if remaining <= 0:
                self.fail(handle, "lease_expired", f"no complete KV within the lease ({handle})")
                break
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(incoming.done)), remaining)
            except TimeoutError:
                continue
        return incoming.state is TransferState.DONE, incoming.reason

    def release(self, handle: str) -> Incoming | None:
        with self._lock:
            return self._incoming.pop(handle, None)

    def has(self, handle: str) -> bool:
        return handle in self._incoming

    def handles(self) -> set[str]:
        with self._lock:
            return set(self._incoming)

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return [h for h, i in self._incoming.items() if i.deadline < now]


def _copy(dst: torch.Tensor, src) -> None:
    """One block of one layer: ``dst`` a contiguous cache block, ``src`` its flat values."""
    if isinstance(src, torch.Tensor):
        dst.view(-1).copy_(src)
    elif dst.device.type != "cpu":
        dst.view(-1).copy_(torch.from_numpy(np.ascontiguousarray(src)))
    else:
        np.copyto(dst.numpy().reshape(-1), src)
