"""Routing policies: pure functions from a snapshot of the workers to a choice. No I/O here.

A policy is ``(loads, request) -> worker_id``; ``request`` (``cost.RouteRequest``) carries the
prompt's length and its predicted prefix hits, which only ``cache_aware`` reads (router/cost.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdserve.router.cost import CostModel, RouteRequest


class WorkerLoad(NamedTuple):
    """What the router knows of a worker when it picks one. (A named tuple: one is built per worker
    in rotation for every decision, and a frozen dataclass costs several times more to build.)"""

    worker_id: str
    inflight: int  # requests this router has sent and not seen finish (fresh, exact for one router)
    num_running: int  # from the worker's last load snapshot (covers other routers' requests)
    num_waiting: int
    kv_usage: float
    waiting_prompt_tokens: int = 0
    inflight_tokens: int = 0  # prompt tokens of this router's requests in flight there, not yet computed
    generation_tokens_per_s: float = 0.0  # from its snapshot: its recent generation rate (a metric)
    prefill_tokens_per_s: float = 0.0  # from its snapshot: its measured prefill rate (0: not yet; the model's)
    free_kv_tokens: int = -1  # from its snapshot: free KV blocks x block size (-1: unknown)
    decode_step_s: float = 0.0  # from its snapshot: its recent decode-only steps' mean seconds (0: none yet)
    decode_step_seqs: float = 0.0  # and their mean sequences


def least_loaded_key(w: WorkerLoad) -> tuple:
    return (max(w.inflight, w.num_running + w.num_waiting), w.kv_usage, w.worker_id)


def least_loaded(workers: Sequence[WorkerLoad], request: RouteRequest | None = None) -> str | None:
    """The worker with the fewest requests (the larger of our count and its own), then the
    emptiest KV cache, then the name (so ties break the same way in every router)."""
    if not workers:
        return None
    return min(workers, key=least_loaded_key).worker_id


def least_queued_prefill_key(w: WorkerLoad) -> tuple:
    return (max(w.inflight_tokens, w.waiting_prompt_tokens), w.inflight, w.worker_id)


def least_queued_prefill(workers: Sequence[WorkerLoad], request: RouteRequest | None = None) -> str | None:
    """The prefill worker with the fewest prompt tokens ahead (the larger of our count and its
    own queue), then the fewest requests."""
    if not workers:
        return None
    return min(workers, key=least_queued_prefill_key).worker_id


# Policies that pick the worker whose load has the smallest key (unique: the name comes last), by
# their key: a caller that keeps workers ordered by it (the simulator's index) picks the same one
# without building every load each time.
POLICY_KEYS: dict[Callable, Callable[[WorkerLoad], tuple]] = {
    least_loaded: least_loaded_key,
    least_queued_prefill: least_queued_prefill_key,
}


@dataclass(frozen=True)
class DisaggregationConfig:
    """When a prompt is prefilled on a prefill worker rather than where it will be decoded."""

    min_prompt_tokens: int = 128  # shorter prompts are prefilled on the decode worker
    min_uncached_tokens: int = 64  # so are prompts whose part not cached on the decode worker is shorter


@dataclass(frozen=True)
class PrefillInputs:
    """What the router knows when it decides where a prompt is prefilled."""

    prompt_tokens: int
    prefill_available: bool  # a prefill worker is in rotation
    reserved: bool | None = None  # None: no reservation asked for yet; False: no decode worker had room
    cached_tokens: int = 0  # with a reservation: leading prompt tokens cached on that decode worker
    prompt_logprobs: bool = False  # the prompt's logprobs are asked for
    # With a reservation, the predicted seconds of each way (router/cost.py ``local_prefill_s`` on
    # that decode worker, ``via_remote_s`` through the cheapest prefill worker); None: not compared
    local_s: float | None = None
    remote_s: float | None = None


def prefill_route(x: PrefillInputs, cfg: DisaggregationConfig) -> str:
    """Where the prompt is prefilled: ``remote`` (a prefill worker), ``reserve`` (ask a decode
    worker for a reservation first, then decide again with its answer), or why it is prefilled
    on the decode worker: ``local_no_prefill_worker``, ``local_short``, ``local_prompt_logprobs``
    (one worker computes every prompt position, without prefix hits), ``local_no_room``,
    ``local_cached``, ``local_faster`` (the prefill pool's queue, its compute and the transfer
    take longer than prefilling here, counting the delay to this worker's batch). Every outcome
    but ``reserve`` is a label of the decisions metric."""
    if not x.prefill_available:
        return "local_no_prefill_worker"
    if x.prompt_logprobs:
        return "local_prompt_logprobs"
    if x.prompt_tokens < cfg.min_prompt_tokens:
        return "local_short"
    if x.reserved is None:
        return "reserve"
    if not x.reserved:
        return "local_no_room"
    if x.prompt_tokens - x.cached_tokens < cfg.min_uncached_tokens:
        return "local_cached"
    if x.local_s is not None and x.remote_s is not None and x.local_s < x.remote_s:
        return "local_faster"
    return "remote"


def round_robin_factory() -> Policy:
    """A policy that takes turns (its only state is the turn counter)."""
    turn = 0

    def pick(workers: Sequence[WorkerLoad], request: RouteRequest | None = None) -> str | None:
        nonlocal turn
        if not workers:
            return None
        ordered = sorted(workers, key=lambda w: w.worker_id)
        turn += 1
        return ordered[turn % len(ordered)].worker_id

    return pick


def random_factory(rng: random.Random | None = None) -> Policy:
    """A policy that picks uniformly at random (the baseline every other policy should beat)."""
    rng = rng or random.Random()

    def pick(workers: Sequence[WorkerLoad], request: RouteRequest | None = None) -> str | None:
        return rng.choice(sorted(w.worker_id for w in workers)) if workers else None

    return pick


def cache_aware_factory(model: CostModel, rng: random.Random | None = None, role: str = "decode") -> Policy:
    """Least predicted seconds (router/cost.py): ``decode_cost`` for a decode worker,
    ``remote_prefill_s`` (its queue and the part of the prompt it has not cached) for a prefill worker."""
    from pdserve.router import cost  # cost.py imports WorkerLoad from here

    rng = rng or random.Random()

    if role == "decode":
        def costs(workers: Sequence[WorkerLoad], req: RouteRequest) -> list[float]:
            return cost.decode_costs(workers, req, model)
    else:
        def costs(workers: Sequence[WorkerLoad], req: RouteRequest) -> list[float]:
            return [cost.remote_prefill_s(w, req, model) for w in workers]

    def pick(workers: Sequence[WorkerLoad], request: RouteRequest | None = None) -> str | None:
        req = request or cost.RouteRequest(0)
        seconds = costs(workers, req)
        if model.temperature > 0:
            return cost.choose({w.worker_id: c for w, c in zip(workers, seconds)}, model.temperature, rng)
        return cost.least(zip((w.worker_id for w in workers), seconds), rng)

    return pick


Policy = Callable[[Sequence[WorkerLoad], "RouteRequest | None"], "str | None"]

# name -> (decode policy, prefill policy), built from the cost model and, for those that draw, an rng
# (None: each policy its own unseeded one; the simulator passes its seeded one)
POLICIES: dict[str, Callable[..., tuple[Policy, Policy]]] = {
    "cache_aware": lambda m, rng=None: (cache_aware_factory(m, rng), cache_aware_factory(m, rng, role="prefill")),
    "least_loaded": lambda m, rng=None: (least_loaded, least_queued_prefill),
    "round_robin": lambda m, rng=None: (round_robin_factory(), least_queued_prefill),
    "random": lambda m, rng=None: (random_factory(rng), random_factory(rng)),
}
