"""The state store in Redis, shared by every router and worker given the same URL.

Keys (``ns`` is ``StateStoreConfig.namespace``)::

    ns:worker:<id>   the worker's record as JSON, set with an expiry of ttl_s on every heartbeat
                     (Redis' clock decides expiry: workers' and routers' clocks need not agree)
    ns:workers       the set of ids ever registered; an id whose record key is gone has expired
                     and is removed from the set by the next reader
    ns:kv_events     a stream of KV events, trimmed to about max_events entries
    ns:routes        a stream of the routers' recent routes, trimmed the same way; a reader
                     starts at its newest entry

While Redis cannot be reached, calls do not raise: one warning per outage, ``workers()``
answers the last list it read, writes are dropped. Workers write their whole record on every
heartbeat, so a Redis that comes back empty is repopulated within one heartbeat; the first
``read_kv_events`` after an outage says ``resync`` (events published meanwhile are lost).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.state.store import (
    KVEventBatch,
    KVEventRecord,
    RouteBatch,
    RouteRecord,
    StateStoreConfig,
    WorkerRecord,
    reraise_cancellation,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)


class RedisStateStore:
    def __init__(self, config: StateStoreConfig, op_timeout_s: float = 1.0):
        self.config = config
        self.op_timeout_s = op_timeout_s
        self.client: aioredis.Redis | None = None
        self._last_workers: list[WorkerRecord] = []
        self._down_since: float | None = None  # monotonic time the current outage began
        self._resync = False  # an outage happened since the last event read

    def _key(self, *parts: str) -> str:
        return ":".join((self.config.namespace, *parts))

    async def start(self) -> None:
        """Make the client (in the running event loop); connections open on first use."""
        # A blocking pool waits for a free connection instead of raising past max_connections;
        # no retries and short timeouts, so an outage costs one quick failure per call.
        pool = aioredis.BlockingConnectionPool.from_url(
            self.config.url, max_connections=32, timeout=self.op_timeout_s, decode_responses=True,
            socket_connect_timeout=self.op_timeout_s, socket_timeout=self.op_timeout_s, retry=Retry(NoBackoff(), 0))
        self.client = aioredis.Redis(connection_pool=pool)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose(close_connection_pool=True)
            self.client = None

    @property
    def reachable(self) -> bool:
        return self._down_since is None

    async def _call(self, what: str, op: Callable[[], Awaitable[T]], fallback: T) -> T:
        """``op()``, or ``fallback`` when Redis is unreachable (warned once per outage)."""
        try:
            result = await op()
        except _UNREACHABLE as e:
            reraise_cancellation()  # a cancellation the client turned into this error
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("state store: redis at %s unreachable (%s: %s); using the last known state until "
                            "it returns", self.config.url, what, e)
            return fallback
        reraise_cancellation()  # one the client swallowed outright
        if self._down_since is not None:
            log.warning("state store: redis at %s is back after %.1f s; resyncing", self.config.url,
                        time.monotonic() - self._down_since)
            self._down_since = None
            self._resync = True
        return result

    # ---- workers ----------------------------------------------------------------------------

    async def heartbeat(self, record: WorkerRecord) -> None:
        async def op():
            async with self.client.pipeline(transaction=False) as p:
                p.set(self._key("worker", record.worker_id), json.dumps(dataclasses.asdict(record)),
                      px=int(self.config.ttl_s * 1000))
                p.sadd(self._key("workers"), record.worker_id)
                await p.execute()

        await self._call("heartbeat", op, None)

    async def deregister(self, worker_id: str) -> None:
        async def op():
            async with self.client.pipeline(transaction=False) as p:
                p.delete(self._key("worker", worker_id))
                p.srem(self._key("workers"), worker_id)
                await p.execute()

        await self._call("deregister", op, None)

    async def workers(self) -> list[WorkerRecord]:
        async def op():
            ids = sorted(await self.client.smembers(self._key("workers")))
            values = await self.client.mget([self._key("worker", i) for i in ids]) if ids else []
            expired = [i for i, v in zip(ids, values) if v is None]
            if expired:
                await self.client.srem(self._key("workers"), *expired)
            return [WorkerRecord(**json.loads(v)) for v in values if v is not None]

        self._last_workers = await self._call("workers", op, self._last_workers)
        return list(self._last_workers)

    # ---- KV events --------------------------------------------------------------------------

    async def publish_kv_events(self, events: list[KVEventRecord]) -> None:
        if not events:
            return

        async def op():
            async with self.client.pipeline(transaction=False) as p:
                for e in events:
                    p.xadd(self._key("kv_events"), {"worker": e.worker_id, "kind": e.kind,
                                                    "hashes": ",".join(e.block_hashes), "epoch": e.epoch,
                                                    "seq": e.seq},
                           maxlen=self.config.max_events, approximate=True)
                await p.execute()

        await self._call("publish_kv_events", op, None)

    async def read_kv_events(self, cursor: str = "", count: int = 1000) -> KVEventBatch:
        async def op():
            key = self._key("kv_events")
            got = await self.client.xread({key: cursor or "0-0"}, count=count)
            entries = got[0][1] if got else []
            lost = False
            if cursor and await self.client.exists(key):
                # Entries were trimmed, and the oldest one kept is past our cursor: we missed some
                # (or read up to exactly the last one trimmed: a needless resync, which is harmless).
                info = await self.client.xinfo_stream(key)
                trimmed = info["entries-added"] > info["length"]
                lost = trimmed and bool(info["first-entry"]) and _id_after(info["first-entry"][0], cursor)
            return entries, lost

        entries, lost = await self._call("read_kv_events", op, ([], False))
        resync = False
        if self.reachable:
            resync, self._resync = self._resync or lost, False
        events = [KVEventRecord(f["worker"], f["kind"], tuple(h for h in f["hashes"].split(",") if h),
                                f.get("epoch", ""), int(f.get("seq", 0))) for _, f in entries]
        return KVEventBatch(events, entries[-1][0] if entries else cursor, resync)

    # ---- routes -----------------------------------------------------------------------------

    async def publish_routes(self, routes: list[RouteRecord]) -> None:
        if not routes:
            return

        async def op():
            async with self.client.pipeline(transaction=False) as p:
                for r in routes:
                    p.xadd(self._key("routes"), {"router": r.router_id, "model": r.model, "role": r.role,
                                                 "worker": r.worker_id, "keys": ",".join(f"{k:x}" for k in r.keys)},
                           maxlen=self.config.max_events, approximate=True)
                await p.execute()

        await self._call("publish_routes", op, None)

    async def read_routes(self, cursor: str = "", count: int = 1000) -> RouteBatch:
        async def op():
            key = self._key("routes")
            if not cursor:  # a new reader starts from now
                newest = await self.client.xrevrange(key, count=1)
                return [], newest[0][0] if newest else "0-0"
            got = await self.client.xread({key: cursor}, count=count)
            entries = got[0][1] if got else []
            return entries, entries[-1][0] if entries else cursor

        entries, after = await self._call("read_routes", op, ([], cursor))
        routes = [RouteRecord(f["router"], f.get("model", ""), f["role"], f["worker"],
                              tuple(int(k, 16) for k in f["keys"].split(",") if k)) for _, f in entries]
        return RouteBatch(routes, after)


def _id_after(a: str, b: str) -> bool:
    """Stream id ``a`` is later than ``b``."""
    ms_a, _, seq_a = a.partition("-")
    ms_b, _, seq_b = b.partition("-")
    return (int(ms_a), int(seq_a or 0)) > (int(ms_b), int(seq_b or 0))
