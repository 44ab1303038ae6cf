"""The global prefix index: block hash -> the workers holding that block, from their KV events.

Workers publish every change to their cached blocks (``stored`` / ``removed`` / ``cleared``,
numbered per worker within an *epoch*: a fresh random id per block pool, so per process). The
index keeps, for each hash, a 64-bit mask of the worker *slots* (one per tracked worker, at most
64) holding it, and per worker the epoch and the last sequence number applied:

    event seq == last + 1, same epoch        -> applied
    seq <= last, or an epoch retired earlier  -> ignored (a duplicate: events are idempotent)
    seq >  last + 1 (a gap), an unknown epoch -> the worker resyncs: its events are buffered until
      (a restart) past its first event,          ``finish_resync`` gets its full block list (a
      or a worker never synced                   snapshot as of some seq); the snapshot replaces its
                                                 entries, buffered events after that seq follow
    epoch unknown and seq == 1                -> a fresh pool from its start: entries replaced by it

Which workers are tracked is the caller's: ``begin_resync`` when a worker joins the rotation (the
router joining late resyncs everyone), ``drop_worker`` when it leaves (its entries go at once).

``lookup`` walks a prompt's chained block hashes and returns each worker's matched prefix length
in blocks: the first ``n`` blocks all held, as the worker's own prefix cache would find them.

Storage is an open-addressing table in numpy (linear probing): ``keys`` (uint64) and ``masks``
(uint64), 16 bytes a slot, at most 70% full, so 16-43 bytes per indexed block after growth. A key
is the first 8 bytes of the 16-byte block hash (0 is the empty slot, so a key of 0 reads as 1).
Two hashes sharing their first 8 bytes would share an entry: the index would then predict a hit
(or, after one of them is removed, a miss) the worker does not have. That only mispredicts a
routing choice: the worker computes its real hit from its full hashes. With a million blocks the
odds of any such pair are about 3e-8. A removed block leaves its key with an empty mask (found,
holding no worker) until the table is rebuilt, which drops them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.prefix_hash import BlockHash, block_hashes
from pdserve.state.store import KVEventRecord

log = logging.getLogger(__name__)

MAX_WORKERS = 64  # one bit each in a uint64 mask
_MAX_LOAD = 0.7  # rebuild (growing if need be) past this many used slots


def key_of(block_hash: BlockHash) -> int:
    """The index key of a block hash (bytes): its first 8 bytes, big-endian; never 0."""
    return int.from_bytes(block_hash[:8], "big") or 1


def key_of_hex(block_hash: str) -> int:
    """The index key of a block hash as events carry it (hex): the same as ``key_of``."""
    return int(block_hash[:16], 16) or 1


def keys_of(block_hashes: Iterable[BlockHash]) -> np.ndarray:
    """``key_of`` of each hash, as a uint64 array."""
    return np.fromiter((key_of(h) for h in block_hashes), np.uint64)


def keys_of_packed(packed: bytes) -> np.ndarray:
    """``key_of`` of each hash in concatenated 16-byte hashes (a KVSnapshot's ``block_hashes``)."""
    return np.maximum(np.frombuffer(packed, ">u8")[::2], 1).astype(np.uint64)


def prompt_keys(token_ids: Sequence[int], model_fingerprint: str, block_size: int,
                cache_salt: str | None = None) -> list[int]:
    """A prompt's index keys: the engine's chained block hashes (pdserve/prefix_hash.py), truncated."""
    hashes = block_hashes(token_ids, model_fingerprint, block_size, cache_salt)
    return keys_of_packed(b"".join(hashes)).tolist()


@dataclass
class _Worker:
    slot: int
    epoch: str | None = None  # None: never synced (or a resync failed): nothing trusted yet
    seq: int = 0
    num_blocks: int = 0
    resyncing: bool = False
    buffered: list[KVEventRecord] = field(default_factory=list)
    retired: set[str] = field(default_factory=set)  # earlier epochs: their late events are stale


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 16):
        self._alloc(max(16, 1 << (capacity - 1).bit_length()))
        self._live = 0  # slots whose mask holds a worker
        self._workers: dict[str, _Worker] = {}
        self._free_slots = list(range(MAX_WORKERS - 1, -1, -1))
        self._slot_ids: list[str | None] = [None] * MAX_WORKERS
        self._tracked = 0  # the tracked workers' slot bits
        self.events_applied = 0
        self.events_ignored = 0
        self.resyncs = 0

    # ---- sizes --------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes some tracked worker holds."""
        return self._live

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._masks.nbytes

    def workers(self) -> dict[str, int]:
        """Each tracked worker's number of indexed blocks."""
        return {wid: w.num_blocks for wid, w in self._workers.items()}

    def keys_of_worker(self, worker_id: str) -> np.ndarray:
        """The keys the index says the worker holds (sorted; a full scan: for checks, not routing)."""
        w = self._workers.get(worker_id)
        if w is None:
            return np.zeros(0, np.uint64)
        return np.sort(self._keys[(self._masks & np.uint64(1 << w.slot)) != 0])

    def is_synced(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.epoch is not None and not w.resyncing

    # ---- lookup -------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[int]) -> dict[str, int]:
        """Each worker's matched prefix in blocks (workers matching none are left out); O(len(keys)).

        ``keys``: a prompt's ``prompt_keys``. The walk stops at the first block no worker holds.
        """
        keys_mv, masks_mv, mask = self._keys_mv, self._masks_mv, self._mask
        held, matched = self._tracked, {}
        for depth, key in enumerate(keys):
            i = key & mask
            while (k := keys_mv[i]) != key and k:
                i = (i + 1) & mask
            now = held & masks_mv[i] if k else 0
            if now != held:  # some workers' prefixes end before this block
                self._record(held & ~now, depth, matched)
                if not now:
                    return matched
                held = now
        self._record(held, len(keys), matched)
        return matched

    def _record(self, slots: int, depth: int, matched: dict[str, int]) -> None:
        while slots and depth:
            low = slots & -slots
            matched[self._slot_ids[low.bit_length() - 1]] = depth
            slots ^= low

    # ---- events -------------------------------------------------------------------------------

    def apply(self, event: KVEventRecord) -> str:
        """Apply one event: ``applied``, ``ignored`` (a duplicate, stale, or a worker not tracked),
        ``buffered`` (its worker is resyncing), or ``resync`` (a gap or an unknown epoch: the worker
        is resyncing now, this event buffered; the caller fetches its snapshot for ``finish_resync``)."""
        w = self._workers.get(event.worker_id)
        if w is None or event.epoch in w.retired:
            return self._ignored()
        if w.resyncing:
            w.buffered.append(event)
            return "buffered"
        if event.epoch != w.epoch and event.seq == 1:  # a fresh pool, seen from its first event
            self._clear(w)
            if w.epoch is not None:
                w.retired = {w.epoch}
            w.epoch, w.seq = event.epoch, 0
        if event.epoch != w.epoch or event.seq > w.seq + 1:
            w.resyncing, w.buffered = True, [event]
            return "resync"
        if event.seq <= w.seq:
            return self._ignored()
        self._apply(w, event)
        w.seq = event.seq
        self.events_applied += 1
        return "applied"

    def _ignored(self) -> str:
        self.events_ignored += 1
        return "ignored"

    def _apply(self, w: _Worker, event: KVEventRecord) -> None:
        bit = 1 << w.slot
        if event.kind == "cleared":
            self._clear(w)
        elif event.kind == "stored":
            for h in event.block_hashes:
                i = self._slot_for(key_of_hex(h))
                m = self._masks_mv[i]
                if not m & bit:
                    self._masks_mv[i] = m | bit
                    w.num_blocks += 1
                    self._live += not m
        elif event.kind == "removed":
            for h in event.block_hashes:
                i = self._find(key_of_hex(h))
                if i >= 0 and (m := self._masks_mv[i]) & bit:
                    self._masks_mv[i] = m ^ bit
                    w.num_blocks -= 1
                    self._live -= m == bit
        else:
            log.warning("KV event of unknown kind %r from %s ignored", event.kind, event.worker_id)

    def _clear(self, w: _Worker) -> None:
        """Take the worker out of every entry (vectorised)."""
        if not w.num_blocks:
            return
        bit = np.uint64(1 << w.slot)
        at = np.flatnonzero(self._masks & bit)
        kept = self._masks[at] & ~bit
        self._masks[at] = kept
        self._live -= int(np.count_nonzero(kept == 0))
        w.num_blocks = 0

    # ---- which workers, and resyncs ---------------------------------------------------------

    def begin_resync(self, worker_id: str) -> bool:
        """Track the worker if it is not yet, and buffer its events until ``finish_resync``; False when
        all ``MAX_WORKERS`` slots are taken (the worker is not indexed: lookups never name it)."""
        w = self._workers.get(worker_id)
        if w is None:
            if not self._free_slots:
                return False
            w = self._workers[worker_id] = _Worker(self._free_slots.pop())
            self._slot_ids[w.slot] = worker_id
            self._tracked |= 1 << w.slot
        w.resyncing = True
        return True

    def finish_resync(self, worker_id: str, epoch: str, seq: int, keys: np.ndarray) -> str:
        """The worker's full block list (``keys_of`` its hashes) as of its event ``seq`` replaces its
        entries; the events buffered meanwhile follow. ``applied``, or ``resync`` when those show
        another gap (the worker stays resyncing: fetch another snapshot)."""
        w = self._workers.get(worker_id)
        if w is None:  # dropped while its snapshot was on the way
            return "ignored"
        self._clear(w)
        self._add_all(w, np.unique(keys))
        if w.epoch is not None and w.epoch != epoch:
            w.retired = {w.epoch}  # one restart back is enough: older ones have long gone quiet
        w.epoch, w.seq, w.resyncing = epoch, seq, False
        self.resyncs += 1
        buffered, w.buffered = w.buffered, []
        for n, event in enumerate(buffered):
            if event.epoch != epoch:  # from before the snapshot's pool (a restart): stale
                w.retired.add(event.epoch)
                self._ignored()
            elif self.apply(event) == "resync":  # a gap after the snapshot: the rest waits for the next one
                w.buffered.extend(buffered[n + 1:])
                return "resync"
        return "applied"

    def fail_resync(self, worker_id: str) -> None:
        """The snapshot could not be had: drop the worker's entries until a later resync succeeds."""
        w = self._workers.get(worker_id)
        if w is not None:
            self._clear(w)
            w.epoch, w.seq, w.resyncing, w.buffered = None, 0, False, []

    def drop_worker(self, worker_id: str) -> None:
        """The worker left the rotation: its entries go now, its slot is free for another."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._clear(w)
        self._slot_ids[w.slot] = None
        self._tracked &= ~(1 << w.slot)
        self._free_slots.append(w.slot)

    def _add_all(self, w: _Worker, keys: np.ndarray) -> None:
        """Set the worker's bit on ``keys`` (distinct), inserting those absent (vectorised)."""
        bit = np.uint64(1 << w.slot)
        at = self._locate(keys)
        found = at[at >= 0]
        before = self._masks[found]
        self._live += int(np.count_nonzero(before == 0))
        self._masks[found] = before | bit
        self._place(keys[at < 0], np.full(int(np.count_nonzero(at < 0)), bit, np.uint64))
        w.num_blocks += len(keys)

    # ---- the table ----------------------------------------------------------------------------

    def _alloc(self, capacity: int) -> None:
        self._keys = np.zeros(capacity, np.uint64)
        self._masks = np.zeros(capacity, np.uint64)
        # Scalar reads and writes through memoryviews give Python ints, several times faster than
        # numpy scalars: the per-event and per-lookup paths are scalar.
        self._keys_mv, self._masks_mv = memoryview(self._keys), memoryview(self._masks)
        self._mask = capacity - 1
        self._used = 0  # slots holding a key, with or without workers

    def _find(self, key: int) -> int:
        """The slot of ``key``, or -1."""
        keys_mv, mask = self._keys_mv, self._mask
        i = key & mask
        while (k := keys_mv[i]) != key:
            if not k:
                return -1
            i = (i + 1) & mask
        return i

    def _slot_for(self, key: int) -> int:
        """The slot of ``key``, taking an empty one if it has none."""
        keys_mv, mask = self._keys_mv, self._mask
        i = key & mask
        while (k := keys_mv[i]) != key:
            if not k:
                if self._used + 1 > _MAX_LOAD * (mask + 1):
                    self._rebuild(self._live + 1)
                    return self._slot_for(key)
                keys_mv[i] = key
                self._used += 1
                return i
            i = (i + 1) & mask
        return i

    def _rebuild(self, live: int) -> None:
        """A fresh table without the keys no worker holds, doubled until ``live`` fits at half load."""
        held = self._masks != 0
        keys, masks = self._keys[held], self._masks[held]
        capacity = self._mask + 1
        while live > capacity // 2:
            capacity *= 2
        self._alloc(capacity)
        self._live = 0
        self._place(keys, masks)

    def _locate(self, keys: np.ndarray) -> np.ndarray:
        """Vectorised ``_find``: each key's slot, -1 where absent."""
        table, mask = self._keys, np.uint64(self._mask)
        pos = (keys & mask).astype(np.int64)
        out = np.full(len(keys), -1, np.int64)
        pending = np.arange(len(keys))
        while pending.size:
            at = table[pos[pending]]
            hit = at == keys[pending]
            out[pending[hit]] = pos[pending[hit]]
            pending = pending[~hit & (at != 0)]
            pos[pending] = (pos[pending] + 1) & self._mask
        return out

    def _place(self, keys: np.ndarray, masks: np.ndarray) -> None:
        """Vectorised insertion of keys known to be absent (and distinct), with their masks."""
        if self._used + len(keys) > _MAX_LOAD * (self._mask + 1):
            self._rebuild(self._live + len(keys))
        table = self._keys
        pos = (keys & np.uint64(self._mask)).astype(np.int64)
        pending = np.arange(len(keys))
        while pending.size:
            p = pos[pending]
            empty = np.flatnonzero(table[p] == 0)
            # Several keys may want one empty slot: the first takes it, the others probe on.
            _, first = np.unique(p[empty], return_index=True)
            won = np.zeros(len(pending), bool)
            won[empty[first]] = True
            winners = pending[won]
            table[pos[winners]] = keys[winners]
            self._masks[pos[winners]] = masks[winners]
            pending = pending[~won]
            pos[pending] = (pos[pending] + 1) & self._mask
        self._used += len(keys)
        self._live += int(np.count_nonzero(masks))
