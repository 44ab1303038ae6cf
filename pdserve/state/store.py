"""The state routers share: which workers are alive, their load, the KV events of the prefix index,
and the routers' own recent routes.

Every worker announces itself with a ``WorkerRecord`` (role, model, fingerprint, gRPC address,
load snapshot) and repeats it every ``heartbeat_s``; a record not repeated within ``ttl_s`` has
expired and is no longer listed. Routers list the live workers and read the KV-event stream
from a cursor. Two backends, chosen by name (``make_state_store``), imported only when chosen:

    memory   in this process (one router, tests); the default
    redis    redis-py asyncio, shared by every router and worker pointed at the same URL

A store that cannot reach its server does not raise: it logs one warning per outage and
answers with the last state it knew (``workers``), drops writes (a worker's next heartbeat
registers it again), and logs when the server is back.

Routes (``RouteRecord``) are what one router tells the others: "I sent a prompt with these
prefix-index keys to this worker", so a prompt routed by one router counts as held there for all
of them until the worker's own KV events say so (router/route_share.py). They are short-lived
hints, not state: a reader starts at the newest one, and one lost in an outage is not missed.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pdserve.configs import ConfigError, doc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateStoreConfig:
    """Where the cluster's shared state lives (the ``state_store:`` section of the cluster YAML)."""

    backend: Literal["memory", "redis"] = doc("memory", "memory (in the router's process) or redis (shared)")
    url: str = doc("", "redis: the server, e.g. redis://host:6379/0")
    namespace: str = doc("pdserve", "prefix of every key, so several clusters can share one Redis")
    ttl_s: float = doc(5.0, "a worker not heard from for this long is dropped from the rotation")
    heartbeat_s: float = doc(1.0, "how often a worker repeats its record (with its load)")
    max_events: int = doc(10000, "KV events kept in the stream (older ones are trimmed)")

    def __post_init__(self) -> None:
        if self.backend == "redis" and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"state_store.url: the redis backend needs a redis:// URL, got {self.url!r}")
        if self.heartbeat_s <= 0:
            raise ConfigError(f"state_store.heartbeat_s: must be positive, got {self.heartbeat_s}")
        if self.ttl_s <= self.heartbeat_s:
            raise ConfigError(f"state_store.ttl_s: must be longer than heartbeat_s ({self.heartbeat_s}), "
                              f"got {self.ttl_s}")
        if self.max_events < 1:
            raise ConfigError(f"state_store.max_events: must be positive, got {self.max_events}")


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as the store knows it: identity, where to reach it, and its last load snapshot."""

    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # gRPC host:port
    model: str = ""
    model_fingerprint: str = ""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    waiting_prompt_tokens: int = 0
    draining: bool = False
    timestamp: float = 0.0  # the worker's clock (time.time()) when it sent this record


@dataclass(frozen=True)
class KVEventRecord:
    """A worker's prefix blocks stored or removed (engine.block_pool.KVEvent, with its origin)."""

    worker_id: str
    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: tuple[str, ...]  # hex
    epoch: str = ""  # the worker's block pool: a new one (a restart) numbers its events from 1 again
    seq: int = 0  # consecutive per worker and epoch: a gap means events were lost (resync)


@dataclass(frozen=True)
class KVEventBatch:
    events: list[KVEventRecord]
    cursor: str  # pass back to read the events after these
    resync: bool = False  # events were lost since the cursor (trimmed, or the server restarted): rebuild


@dataclass(frozen=True)
class RouteRecord:
    """One router's route of one prompt: its prefix-index keys were sent to ``worker_id``."""

    router_id: str
    model: str  # the served model's name ("" with one model)
    role: str  # "prefill" | "decode": the pool the worker is in
    worker_id: str
    keys: tuple[int, ...]  # prefix_index.prompt_keys of the prompt, in order


@dataclass(frozen=True)
class RouteBatch:
    routes: list[RouteRecord]
    cursor: str  # pass back to read the routes after these


class StateStore(Protocol):
    """The calls every backend answers; all of them survive the server going away."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def heartbeat(self, record: WorkerRecord) -> None:
        """Register ``record.worker_id`` or refresh it; it expires ``ttl_s`` after the last call."""

    async def deregister(self, worker_id: str) -> None: ...

    async def workers(self) -> list[WorkerRecord]:
        """The live workers (last known ones while the server is unreachable)."""

    async def publish_kv_events(self, events: list[KVEventRecord]) -> None: ...

    async def read_kv_events(self, cursor: str = "", count: int = 1000) -> KVEventBatch:
        """Events after ``cursor`` ("" = from the oldest kept), at most ``count``."""

    async def publish_routes(self, routes: list[RouteRecord]) -> None: ...

    async def read_routes(self, cursor: str = "", count: int = 1000) -> RouteBatch:
        """Routes after ``cursor`` ("" = none yet: the cursor of the newest, so a reader starts from
        now), at most ``count``. Routes lost in an outage or trimmed are skipped, not signalled."""


class MemoryStateStore:
    """The in-process store: a dict of records with their expiry, a bounded deque of events."""

    def __init__(self, config: StateStoreConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._records: dict[str, tuple[WorkerRecord, float]] = {}  # id -> (record, expires at)
        self._events: deque[tuple[int, KVEventRecord]] = deque(maxlen=config.max_events)
        self._next_event = 1
        self._routes: deque[tuple[int, RouteRecord]] = deque(maxlen=config.max_events)
        self._next_route = 1

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def heartbeat(self, record: WorkerRecord) -> None:
        self._records[record.worker_id] = (record, self.clock() + self.config.ttl_s)

    async def deregister(self, worker_id: str) -> None:
        self._records.pop(worker_id, None)

    async def workers(self) -> list[WorkerRecord]:
        now = self.clock()
        for worker_id in [k for k, (_, expires) in self._records.items() if expires <= now]:
            del self._records[worker_id]
        return sorted((r for r, _ in self._records.values()), key=lambda r: r.worker_id)

    async def publish_kv_events(self, events: list[KVEventRecord]) -> None:
        for event in events:
            self._events.append((self._next_event, event))
            self._next_event += 1

    async def read_kv_events(self, cursor: str = "", count: int = 1000) -> KVEventBatch:
        after = int(cursor or 0)
        oldest = self._events[0][0] if self._events else self._next_event
        resync = after + 1 < oldest and after > 0
        if after >= self._next_event:  # a cursor from before this store restarted empty: events were lost
            after, resync = 0, True
        picked = [(i, e) for i, e in self._events if i > after][:count]
        return KVEventBatch([e for _, e in picked], str(picked[-1][0] if picked else max(after, oldest - 1)), resync)


    async def publish_routes(self, routes: list[RouteRecord]) -> None:
        for route in routes:
            self._routes.append((self._next_route, route))
            self._next_route += 1

    async def read_routes(self, cursor: str = "", count: int = 1000) -> RouteBatch:
        if not cursor or int(cursor) >= self._next_route:  # a new reader, or a cursor from before a restart
            return RouteBatch([], str(self._next_route - 1))
        after = int(cursor)
        first = max(0, after + 1 - self._routes[0][0]) if self._routes else 0  # ids are consecutive
        picked = list(itertools.islice(self._routes, first, first + count))
        return RouteBatch([r for _, r in picked], str(picked[-1][0] if picked else self._next_route - 1))


STATE_STORES: dict[str, str | Callable[[StateStoreConfig], StateStore]] = {
    "memory": "pdserve.state.store:MemoryStateStore",
    "redis": "pdserve.state.redis_store:RedisStateStore",
}


def reraise_cancellation() -> None:
    """Raise CancelledError if the running task was asked to stop and code below it swallowed that.

    A store call whose client turned a cancellation into a timeout or a connection error (seen
    with redis-py while Redis restarted: the router's event reader then slept on, "cancelling"
    for good, and the router never finished stopping) would otherwise carry on as if Redis were
    merely down."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_tasks(tasks, what: str, timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout_s``: a task that swallows its
    cancellation is left behind with a warning instead of holding up the shutdown for ever."""
    tasks = [t for t in tasks if t is not None]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        log.warning("%s: %d task(s) did not stop within %.0f s of being cancelled; left behind: %s", what,
                    len(pending), timeout_s, ", ".join(t.get_name() for t in pending))


async def follow_forever(read_once: Callable[[], Awaitable[int]], interval_s: float, batch: int, what: str) -> None:
    """A stream's reader: ``read_once()`` (how many entries it took, at most ``batch``) again at once
    while it takes full batches, else after ``interval_s``; a round that raises is logged and the
    next one follows."""
    while True:
        try:
            n = await read_once()
        except Exception:  # keep following whatever one round did
            log.exception("%s failed", what)
            n = 0
        if n < batch:
            await asyncio.sleep(interval_s)


def register_state_store(name: str, factory: str | Callable[[StateStoreConfig], StateStore]) -> None:
    """Add a backend ("module:Class", or a callable taking the config); tests register fakes here."""
    STATE_STORES[name] = factory


def make_state_store(config: StateStoreConfig) -> StateStore:
    """The backend ``config.backend`` names, its module imported only now."""
    factory = STATE_STORES.get(config.backend)
    if factory is None:
        raise ConfigError(f"state_store.backend: {config.backend!r} is not one of {sorted(STATE_STORES)}")
    if isinstance(factory, str):
        module, name = factory.split(":")
        factory = getattr(importlib.import_module(module), name)
    return factory(config)
