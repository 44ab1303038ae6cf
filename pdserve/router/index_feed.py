"""The workers' KV events, from the state store into the router's global prefix index.

    every interval_s: store.read_kv_events(cursor) -> PrefixIndex.apply, each in stream order
      "resync" (a gap in a worker's numbers, or a new epoch)  -> that worker's KVSnapshot (gRPC),
                                                                 its events buffered meanwhile
      the store says events were lost (trimmed, an outage)    -> every tracked worker resyncs
    a worker joins the rotation (WorkerPool listener)         -> it resyncs (so does every worker in
                                                                 rotation when the router starts:
                                                                 it may have joined late)
    a worker leaves the rotation                              -> its entries are dropped at once

A snapshot that cannot be had (the call fails) leaves the worker with no entries; its next event
tries again, at most once per ``retry_s``. Several routers sharing a Redis store read the same
stream with their own cursors, so each builds the same index.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import WorkerHandle, WorkerPool
from pdserve.router.prefix_index import PrefixIndex, keys_of_packed
from pdserve.router.worker_client import kv_snapshot
from pdserve.state.store import follow_forever, stop_tasks

log = logging.getLogger(__name__)


class PrefixIndexFeed:
    def __init__(self, index: PrefixIndex, store, pool: WorkerPool, metrics: RouterMetrics,
                 interval_s: float = 0.1, snapshot_timeout_s: float = 10.0, retry_s: float = 1.0,
                 batch: int = 1000):
        self.index = index
        self.store = store  # a pdserve.state.store.StateStore, started and closed by its owner (discovery)
        self.pool = pool
        self.metrics = metrics
        self.interval_s = interval_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.retry_s = retry_s
        self.batch = batch
        self.cursor = ""
        self._task: asyncio.Task | None = None
        self._resyncs: dict[str, asyncio.Task] = {}
        self._last_try: dict[str, float] = {}
        self._full_warned = False

    async def start(self) -> None:
        self.pool.listeners.append(self.on_rotation)
        for w in self.pool.healthy():
            self.resync(w.worker_id, "joined")
        rounds = follow_forever(self.read_once, self.interval_s, self.batch, "reading KV events")
        self._task = asyncio.create_task(rounds, name="prefix-index-feed")

    async def close(self) -> None:
        if self.on_rotation in self.pool.listeners:
            self.pool.listeners.remove(self.on_rotation)
        await stop_tasks([self._task, *self._resyncs.values()], "prefix index feed")

    def on_rotation(self, worker: WorkerHandle, in_rotation: bool) -> None:
        if in_rotation:
            self.resync(worker.worker_id, "joined")
            return
        task = self._resyncs.pop(worker.worker_id, None)
        if task is not None:
            task.cancel()
        self.index.drop_worker(worker.worker_id)
        self.metrics.prefix_index_blocks.set(self.index.num_blocks)

    # ---- events ---------------------------------------------------------------------------------

    async def read_once(self) -> int:
        """Apply the events after the cursor (at most ``batch``); how many there were."""
        got = await self.store.read_kv_events(self.cursor, self.batch)
        self.cursor = got.cursor
        if got.resync:
            log.warning("KV events were lost in the state store: resyncing the prefix index")
            for worker_id in list(self.index.workers()):
                self.resync(worker_id, "store")
        for event in got.events:
            outcome = self.index.apply(event)
            self.metrics.prefix_index_events.labels(outcome).inc()
            if outcome == "resync":
                self.resync(event.worker_id, "gap")
        self.metrics.prefix_index_blocks.set(self.index.num_blocks)
        return len(got.events)

    # ---- resyncs --------------------------------------------------------------------------------

    def resync(self, worker_id: str, reason: str) -> None:
        """Rebuild the worker's entries from its snapshot (in a task; one at a time per worker)."""
        if not self.index.begin_resync(worker_id):
            if not self._full_warned:
                log.warning("prefix index: every worker slot is taken; %s is not indexed", worker_id)
                self._full_warned = True
            return
        if worker_id not in self._resyncs:
            task = asyncio.create_task(self._resync(worker_id, reason), name=f"prefix-index-resync-{worker_id}")
            self._resyncs[worker_id] = task
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        for worker_id, t in list(self._resyncs.items()):
            if t is task:
                del self._resyncs[worker_id]

    async def _resync(self, worker_id: str, reason: str) -> None:
        outcome = "resync"
        while outcome == "resync":  # events after the snapshot showed another gap: again
            wait = self._last_try.get(worker_id, -self.retry_s) + self.retry_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_try[worker_id] = time.monotonic()
            outcome = await self._resync_once(worker_id, reason)
        self.metrics.prefix_index_blocks.set(self.index.num_blocks)

    async def _resync_once(self, worker_id: str, reason: str) -> str:
        worker = next((w for w in self.pool.healthy() if w.worker_id == worker_id), None)
        if worker is None:  # it left the rotation meanwhile: nothing of it is indexed
            self.index.drop_worker(worker_id)
            return "failed"
        try:
            snapshot = await kv_snapshot(worker, self.snapshot_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("prefix index: no block list from %s (%s: %s); its entries are dropped until it "
                        "resyncs", worker_id, e.code().name, e.details())
            self.index.fail_resync(worker_id)
            self.metrics.prefix_index_resyncs.labels(reason, "failed").inc()
            return "failed"
        outcome = self.index.finish_resync(worker_id, snapshot.epoch, snapshot.seq,
                                           keys_of_packed(snapshot.block_hashes))
        self.metrics.prefix_index_resyncs.labels(reason, "ok").inc()
        return outcome
