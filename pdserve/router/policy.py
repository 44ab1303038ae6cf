"""Routing policies: pure functions from a snapshot of the workers to a choice. No I/O here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    """What the router knows of a worker when it picks one."""

    worker_id: str
    inflight: int  # requests this router has sent and not seen finish (fresh, exact for one router)
    num_running: int  # from the worker's last load snapshot (covers other routers' requests)
    num_waiting: int
    kv_usage: float
    waiting_prompt_tokens: int = 0


def least_loaded(workers: Sequence[WorkerLoad]) -> str | None:
    """The worker with the fewest requests (the larger of our count and its own), then the
    emptiest KV cache, then the name (so ties break the same way in every router)."""
    if not workers:
        return None

    def key(w: WorkerLoad):
        return (max(w.inflight, w.num_running + w.num_waiting), w.kv_usage, w.worker_id)

    return min(workers, key=key).worker_id


def round_robin_factory() -> Callable[[Sequence[WorkerLoad]], str | None]:
    """A policy that takes turns (its only state is the turn counter)."""
    turn = 0

    def pick(workers: Sequence[WorkerLoad]) -> str | None:
        nonlocal turn
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.worker_id)
        turn += 1
        return ordered[turn % len(ordered)].worker_id

    return pick


POLICIES: dict[str, Callable[[], Callable[[Sequence[WorkerLoad]], str | None]]] = {
    "least_loaded": lambda: least_loaded,
    "round_robin": round_robin_factory,
}
