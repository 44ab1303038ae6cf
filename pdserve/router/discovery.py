"""Workers found in the shared state store join and leave the router's pool while it runs.

Every ``interval_s`` the router lists the live workers in the store (``StateStore.workers()``):

    a new address                        -> WorkerPool.add (in rotation once it answers a poll)
    a record that says draining          -> out of rotation now (the poller would see it later)
    an address absent for ``grace_s``    -> WorkerPool.remove (its requests here finish first)

The grace period covers a store that restarted empty: workers rewrite their records within one
heartbeat, so a worker is dropped only when its heartbeat has really stopped. ``--worker``
addresses given on the command line are never removed. An unreachable store answers its last
known list, so an outage changes nothing here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.router.pool import WorkerPool
from pdserve.state.store import stop_tasks

log = logging.getLogger(__name__)


class StoreDiscovery:
    def __init__(self, pool: WorkerPool, store, interval_s: float = 0.5, grace_s: float = 5.0):
        self.pool = pool
        self.store = store  # a pdserve.state.store.StateStore, started and closed here
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.static = {w.address for w in pool.workers}
        self._last_seen: dict[str, float] = {}  # discovered address -> when the store last listed it
        self._task: asyncio.Task | None = None
        self._removals: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.store.start()
        await self.sync_once()
        self._task = asyncio.create_task(self._sync_forever(), name="state-store-discovery")

    async def close(self) -> None:
        await stop_tasks([self._task, *self._removals], "worker discovery")
        await self.store.close()

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_once()
            except Exception:  # keep discovering whatever one round did
                log.exception("worker discovery failed")

    async def sync_once(self) -> None:
        now = time.monotonic()
        records = await self.store.workers()
        known = {w.address: w for w in self.pool.workers}
        for r in records:
            if r.address in self.static:
                continue
            self._last_seen[r.address] = now
            if r.address not in known:
                log.info("worker %s (%s, %s) discovered in the state store", r.worker_id, r.role, r.address)
                await self.pool.add(r.address)
            elif r.draining and known[r.address].healthy:
                self.pool.mark_down(known[r.address], "draining (state store)")
        for address, seen in list(self._last_seen.items()):
            if now - seen >= self.grace_s:
                del self._last_seen[address]
                log.warning("worker at %s: no heartbeat in the state store for %.1f s; removed", address, now - seen)
                task = asyncio.create_task(self.pool.remove(address))
                self._removals.add(task)
                task.add_done_callback(self._removals.discard)
