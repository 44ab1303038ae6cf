"""Each router's routes, shared with the other routers through the state store (cache_aware).

A router remembers where it sent each recent prompt (recent_routes.py) until the workers' KV
events reach the prefix index. Several routers behind one load balancer each see only their own
share of the requests: a tenant's next request often reaches a router that did not send the last
one, before the worker holding the prompt has stored it (the first request still queued) or
published it (its next heartbeat). So each router publishes its routes through the state store
and counts the other routers' routes as its own, as Dynamo's router replica sync shares its
routers' decisions:

    a route (Dispatcher._pick; again at the request's first token) -> queued here
    every interval_s: the queue -> store.publish_routes
                      store.read_routes(cursor) -> the other routers' routes -> the RecentRoutes of
                      that model's dispatcher and pool, fresh from when they were read

A shared route is a hint that expires (``recent_routes_s``) like the router's own: late or lost,
it costs a cache miss, never a wrong answer. A router reads from when it started.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Sequence

from pdserve.router.metrics import RouterMetrics
from pdserve.router.recent_routes import RecentRoutes
from pdserve.state.store import RouteRecord, follow_forever, stop_tasks


class RouteShare:
    def __init__(self, store, recents: dict[str, dict[str, RecentRoutes]], metrics: RouterMetrics,
                 interval_s: float = 0.05, batch: int = 1000, max_pending: int = 10_000):
        self.store = store  # a pdserve.state.store.StateStore, started and closed by its owner (discovery)
        self.recents = recents  # model name -> pool ("prefill" / "decode") -> its dispatcher's RecentRoutes
        self.metrics = metrics
        self.interval_s = interval_s
        self.batch = batch
        self.router_id = uuid.uuid4().hex[:12]
        self.cursor = ""
        self._pending: deque[RouteRecord] = deque(maxlen=max_pending)  # a stalled store drops the oldest
        self._task: asyncio.Task | None = None

    def note(self, model: str, role: str, keys: Sequence[int], worker_id: str) -> None:
        """This router sent the prompt with ``keys`` to ``worker_id`` of pool ``role`` (published next round)."""
        self._pending.append(RouteRecord(self.router_id, model, role, worker_id, tuple(keys)))

    async def start(self) -> None:
        self.cursor = (await self.store.read_routes("")).cursor
        rounds = follow_forever(self.exchange_once, self.interval_s, self.batch, "sharing routes")
        self._task = asyncio.create_task(rounds, name="route-share")

    async def close(self) -> None:
        await stop_tasks([self._task], "route share")

    async def exchange_once(self) -> int:
        """Publish the routes noted since the last round; apply the other routers' routes since the
        cursor (at most ``batch``); how many were read."""
        if self._pending:
            pending = list(self._pending)
            self._pending.clear()
            await self.store.publish_routes(pending)
            self.metrics.shared_routes.labels("sent").inc(len(pending))
        got = await self.store.read_routes(self.cursor, self.batch)
        self.cursor = got.cursor
        now = time.monotonic()
        for route in got.routes:
            if route.router_id == self.router_id:
                continue
            recent = self.recents.get(route.model, {}).get(route.role)
            if recent is None:  # a model or pool this router does not serve
                continue
            recent.add(route.keys, route.worker_id, now)
            self.metrics.shared_routes.labels("received").inc()
        return len(got.routes)
