"""A worker announcing itself in the shared state store (``pdserve worker ... --redis URL``).

Lifecycle: registered when its gRPC server is up -> its record (address, model, fingerprint,
load snapshot) rewritten every ``heartbeat_s``, expiring ``ttl_s`` after the last one ->
on drain, one more heartbeat saying ``draining`` (routers take it out of rotation at once) ->
deregistered when it stops. Each heartbeat also drains the block pool's KV events since the
last one (prefix blocks stored / removed / all cleared, numbered per epoch) into the store's
stream, for the global prefix index.
A store that is unreachable drops the writes with a warning; the next heartbeat after it
returns registers the worker again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from pdserve.state.store import KVEventRecord, StateStore, StateStoreConfig, WorkerRecord, make_state_store, stop_tasks

if TYPE_CHECKING:
    from pdserve.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, store: StateStore, servicer: WorkerServicer, interval_s: float):
        self.store = store
        self.servicer = servicer
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def record(self) -> WorkerRecord:
        s = self.servicer.snapshot()
        return WorkerRecord(
            worker_id=self.servicer.worker_id, role=self.servicer.role, address=self.servicer.address,
            model=self.servicer.model_name, model_fingerprint=self.servicer.layout.model_fingerprint,
            num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage,
            waiting_prompt_tokens=s.waiting_prompt_tokens, draining=s.draining, timestamp=s.timestamp)

    async def start(self) -> None:
        await self.store.start()
        await self.beat()
        self._task = asyncio.create_task(self._beat_forever(), name="state-store-heartbeat")

    def take_kv_events(self) -> list[KVEventRecord]:
        """The block pool's events since the last call, with the pool's epoch and their numbers
        (a gap in them is what the engine dropped while nobody drained: consumers resync)."""
        buffer = self.servicer.engine.engine.kv.pool.events
        return [KVEventRecord(self.servicer.worker_id, e.kind, tuple(h.hex() for h in e.block_hashes),
                              buffer.epoch, e.seq) for e in buffer.drain()]

    async def beat(self) -> None:
        await self.store.heartbeat(self.record())
        await self.store.publish_kv_events(self.take_kv_events())

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
            except Exception:  # a bad round must not end the heartbeat
                log.exception("heartbeat failed")

    async def stop(self) -> None:
        await stop_tasks([self._task], "heartbeat")
        await self.store.deregister(self.servicer.worker_id)
        await self.store.close()


async def register(servicer: WorkerServicer, url: str, heartbeat_s: float, ttl_s: float) -> Registration:
    """Register ``servicer``'s worker in the Redis at ``url`` and keep it there."""
    config = StateStoreConfig(backend="redis", url=url, heartbeat_s=heartbeat_s, ttl_s=ttl_s)
    registration = Registration(make_state_store(config), servicer, heartbeat_s)
    await registration.start()
    log.info("worker %s registered in %s (heartbeat %.1f s, ttl %.1f s)", servicer.worker_id, url, heartbeat_s,
             ttl_s)
    return registration
