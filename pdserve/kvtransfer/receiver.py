"""The receiving side: reserved blocks waiting for their KV, written as chunks arrive.

    receiver.expect(handle, block_ids, skip_blocks, num_tokens, lease_s)  # at reservation
                                                   # (block tables per layer group: group_block_ids)
    receiver.begin(handle, sender_layout, total_tokens)  # handshake: layouts, token counts must match
    receiver.chunk(handle, layer, first_block, keys, values, crc)  # any order, any thread; each block
                                                                   # once; each renews the lease
    receiver.commit(handle)                                        # every (layer, block) seen?
    ok, reason = await receiver.wait(handle)       # DONE, FAILED, or lease_s passed without a chunk

Chunks are written straight into the reserved blocks of the cache: nothing else reads those
blocks until the transfer is done (they are not offered to prefix hits), so writing from the
transfer's thread while the engine steps is safe.

A cache with layer groups (kv_cache_manager.KVGroups: a sliding-window model) has a block table
per group: layer ``l`` is written into slot ``layer_slot[l]`` of the cache at its group's blocks,
and a windowed layer expects only the blocks from ``layout.first_block(l, num_tokens)`` on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.kv_cache_manager import KVGroups
from pdserve.kvtransfer.base import KVLayout, TransferError, TransferState, checksum


@dataclass
class Incoming:
    handle: str
    block_ids: list[int]
    skip_blocks: int  # leading blocks already cached here: not sent
    num_tokens: int  # prompt tokens the reservation holds: the sender's header must say the same
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
    tables: list[list[int]] = field(default_factory=list)  # per layer group; [block_ids] with one group


class KVReceiver:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, groups: KVGroups | None = None):
        """``kv_cache``: the engine's ``[layer slots, 2, blocks, kv_heads, block_size * head_dim]``
        tensor; ``groups``: its layer groups (None: one, a slot per layer)."""
        self.kv_cache = kv_cache
        self.layout = layout
        self.groups = groups or KVGroups.one(layout.num_layers)
        self._incoming: dict[str, Incoming] = {}
        self._lock = threading.Lock()
        # Chunks are bytes in the cache's own layout, whatever its dtype (numpy has no bfloat16):
        # on the CPU they are copied into a byte view of the cache.
        self._cache_bytes = kv_cache.view(torch.uint8).numpy() if kv_cache.device.type == "cpu" else None
        self._block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()

    def expect(self, handle: str, block_ids: list[int], skip_blocks: int, num_tokens: int, lease_s: float,
               wait_s: float | None = None, group_block_ids: list[list[int]] | None = None) -> Incoming:
        """Reserve ``block_ids`` (a prompt of ``num_tokens``) for ``handle``: they wait ``wait_s``
        (default ``lease_s``) for the transfer to begin (the prompt may queue on a busy prefill
        worker); then the transfer fails once ``lease_s`` pass without a chunk.

        Why a lease renewed by every chunk, not a deadline from the first: chunks come as the
        prefill computes (each layer of each step), so a transfer lasts as long as the prompt's
        prefill, tens of seconds for a long prompt or on a loaded machine; what the lease must
        catch is a sender that stopped, not one that computes."""
        wait = lease_s if wait_s is None else max(wait_s, lease_s)
        incoming = Incoming(handle, list(block_ids), skip_blocks, num_tokens, time.monotonic() + wait, lease_s, wait)
        incoming.tables = [list(t) for t in group_block_ids] if group_block_ids else [incoming.block_ids]
        if not any(self._wanted(incoming, layer) for layer in range(self.layout.num_layers)):  # all cached here
            self._finish(incoming, TransferState.DONE)
        with self._lock:
            self._incoming[handle] = incoming
        return incoming

    def get(self, handle: str) -> Incoming:
        incoming = self._incoming.get(handle)
        if incoming is None:
            raise TransferError("unknown_handle", f"no reservation {handle!r} here (expired or never made)")
        return incoming

    def begin(self, handle: str, layout: KVLayout, total_tokens: int) -> Incoming:
        """The handshake (the first chunk's header): the layouts must be equal, and the sender's
        prompt as long as the reserved one."""
        incoming = self.get(handle)
        problem = self.layout.mismatch(layout)
        if problem:
            raise self._failure(handle, "layout_mismatch", problem)
        if total_tokens != incoming.num_tokens:
            raise self._failure(handle, "token_count", f"the sender's KV covers {total_tokens} tokens, the "
                                                       f"reservation {handle!r} holds {incoming.num_tokens}")
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
        if crc is not None and not isinstance(keys, torch.Tensor) and checksum(keys, values) != crc:
            raise self._failure(handle, "checksum", f"layer {layer}, blocks from {first_block}: checksum mismatch")
        n = self._check_range(incoming, layer, first_block, keys, values)
        blocks = incoming.tables[self.groups.layer_group[layer]][first_block : first_block + n]
        slot = self.groups.layer_slot[layer]
        if n:  # a chunk of no blocks (a header alone) writes nothing, and renews the lease
            self._write(slot, 0, blocks, keys)
            self._write(slot, 1, blocks, values)
        incoming.bytes += 2 * n * self._block_bytes
        incoming.seen.setdefault(layer, set()).update(range(first_block, first_block + n))
        incoming.deadline = time.monotonic() + incoming.lease_s  # progress renews the lease

    def _check_range(self, incoming: Incoming, layer: int, first_block: int, keys, values) -> int:
        """The chunk's number of blocks, once it is known to fall inside the reservation, in
        whole blocks, each block of each layer once (a block sent twice is a sender's bug: the
        first copy may have been partly filled)."""
        nk, nv = _nbytes(keys), _nbytes(values)
        n = nk // self._block_bytes
        problem = None
        if nk != nv or nk % self._block_bytes:
            problem = f"keys ({nk} bytes) and values ({nv} bytes) are not the same whole number of blocks"
        elif not 0 <= layer < self.layout.num_layers or not set(range(first_block, first_block + n)) <= \
                (wanted := self._wanted(incoming, layer)):
            span = f"[{min(wanted)}, {max(wanted) + 1})" if 0 <= layer < self.layout.num_layers and wanted else "none"
            problem = f"layer {layer} blocks [{first_block}, {first_block + n}) are outside the reservation " \
                      f"(blocks {span} of layer {layer}; {self.layout.num_layers} layers)"
        elif incoming.seen.get(layer, set()).intersection(range(first_block, first_block + n)):
            problem = f"layer {layer}: blocks of [{first_block}, {first_block + n}) were sent twice"
        if problem:
            raise self._failure(incoming.handle, "range", problem)
        return n

    def _wanted(self, incoming: Incoming, layer: int) -> set[int]:
        """The block indices of ``layer`` the transfer must bring: from the first not cached here
        (and, for a windowed layer, not before its window) to the end of the prompt."""
        first = max(incoming.skip_blocks, self.layout.first_block(layer, incoming.num_tokens))
        return set(range(first, len(incoming.block_ids)))

    def _write(self, slot: int, kv: int, blocks: list[int], data) -> None:
        """One chunk's keys (``kv`` 0) or values (1) into ``blocks`` of the cache's layer ``slot``."""
        if self._cache_bytes is not None and not isinstance(data, torch.Tensor):
            rows = np.frombuffer(data, dtype=np.uint8).reshape(len(blocks), -1)
            self._cache_bytes[slot, kv].reshape(self.kv_cache.shape[2], -1)[blocks] = rows
            return
        dst = self.kv_cache[slot, kv].view(torch.uint8).view(self.kv_cache.shape[2], -1)
        if isinstance(data, torch.Tensor):
            src = data.contiguous().view(torch.uint8)
        else:  # torch.tensor copies: a tensor over the message's read-only bytes is refused
            src = torch.tensor(np.frombuffer(data, dtype=np.uint8))
        index = torch.tensor(blocks, dtype=torch.long, device=dst.device)
        dst.index_copy_(0, index, src.to(dst.device).view(len(blocks), -1))

    def commit(self, handle: str) -> None:
        incoming = self.get(handle)
        missing = [layer for layer in range(self.layout.num_layers)
                   if incoming.seen.get(layer, set()) != self._wanted(incoming, layer)]
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


def _nbytes(data) -> int:
    return data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data)
