"""Routing cost in predicted seconds: pure functions of the workers' loads, a request's predicted
prefix hits (the global prefix index) and a latency model. No I/O here; the same functions serve
the live router and anything that replays its decisions.

For a request of P prompt tokens, with c_w of them predicted cached on worker w:

    uncached(w)    = P - c_w
    rate(w)        = its prefill tokens/s: measured by the worker (its load snapshot, over its recent
                     steps computing prompts), else the model's prefill_tokens_per_s
    queue(w)       = max(its queued prompt tokens, this router's in flight there) / rate(w)
    step(w)        = its decode step: the model's decode_step_s + decode_step_s_per_seq x batch, or
                     longer where its snapshot measured longer (its recent steps that computed no
                     prompt token, + decode_step_s_per_seq for each sequence more now)
    local(d)       = queue(d) + t + interference x t x (batch(d) + 1),    t = uncached(d) / rate(d)
                     (a prompt prefilled on a decode worker holds the decode steps of its batch, and of
                     the requests joining it meanwhile, counted as one more, for t)
    remote(p)      = queue(p) + uncached(p) / rate(p) + shortfall(p, uncached(p))     (a prefill worker)
    via_remote(d)  = min_p remote(p) + transfer_s_per_token x uncached(d) + remote_overhead_s
                     [+ interference x uncached(p*) / rate(p*) x (batch(d) + 1)   when p*, the cheapest
                     prefill worker, contends with d for compute (pdserve/compute_id.py: both on the
                     same oversubscribed cores or GPU): its prefill then holds d's batch as a local
                     one would, and only the compute it repeats is gained by sending it there]
    decode(d)      = decode_horizon_tokens x (step(d) + decode_step_s_per_seq x (batch(d) + 1))
                     (its own tokens, and the slowdown it adds to every sequence in the batch)
    shortfall(w,n) = max(n - free KV tokens(w), 0) / rate(w)
                     (KV pressure: tokens that do not fit in its free blocks wait for blocks or push a
                     running sequence out to be recomputed; counted as recomputing them)
    cost(d)        = decode(d) + min(local(d), via_remote(d)) + shortfall(d, uncached(d) + decode_horizon_tokens)
                     (via_remote only with a prefill worker)

The least cost wins; equal costs break at random (or, with a temperature, a softmax over the
costs picks, as Dynamo's router does).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.router.policy import WorkerLoad

_TIE = 1e-12  # seconds: costs this close are equal


@dataclass(frozen=True)
class CostModel:
    """The latency model's coefficients (defaults: SmolLM2-135M on 2 cores of this machine's CPU,
    benchmarks/engine_throughput.py; a profile of another model or machine overrides them)."""

    prefill_tokens_per_s: float = 500.0  # prompt tokens a worker computes per second, until it has measured its own
    decode_step_s: float = 0.02  # one decode step with one sequence
    decode_step_s_per_seq: float = 0.002  # what each more sequence in the batch adds to a step
    transfer_s_per_token: float = 5e-5  # shipping one token's KV from a prefill to a decode worker
    remote_overhead_s: float = 0.005  # the extra calls of a remote prefill (reserve, prefill, resume)
    decode_horizon_tokens: int = 16  # output tokens over which the decode slowdown is counted
    interference: float = 2.0  # weight of a local prefill's delay to the decode batch it holds
    temperature: float = 0.0  # 0: least cost (ties at random); > 0: softmax over -cost / temperature
    contention: bool = True  # count a contending prefill worker's delay to the decode batch (with_remote)


@dataclass(frozen=True)
class RouteRequest:
    """What a routing decision knows of the request, computed once per request."""

    prompt_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)  # worker -> leading tokens predicted cached there
    remote_s: float | None = None  # the cheapest remote prefill (min_p remote(p)); None: no prefill worker
    remote_compute_s: float = 0.0  # of it, the prefill worker's compute: uncached(p*) / rate(p*)
    shares_remote: frozenset[str] = frozenset()  # decode workers contending with p* for compute


def batch(w: WorkerLoad) -> int:
    """Sequences on the worker: the larger of this router's count and the worker's own."""
    return max(w.inflight, w.num_running + w.num_waiting)


def uncached(w: WorkerLoad, req: RouteRequest) -> int:
    return max(req.prompt_tokens - req.cached.get(w.worker_id, 0), 0)


def rate(w: WorkerLoad, m: CostModel) -> float:
    """The worker's prefill tokens/s: its own measurement where its snapshot has one, else the model's."""
    return w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else m.prefill_tokens_per_s


def queue_s(w: WorkerLoad, m: CostModel) -> float:
    return max(w.waiting_prompt_tokens, w.inflight_tokens) / rate(w, m)


def shortfall_s(w: WorkerLoad, tokens: int, m: CostModel) -> float:
    """KV pressure: the tokens that do not fit in the worker's free blocks, as recompute seconds."""
    if w.free_kv_tokens < 0 or tokens <= w.free_kv_tokens:
        return 0.0
    return (tokens - w.free_kv_tokens) / rate(w, m)


def step_s(w: WorkerLoad, m: CostModel) -> float:
    """The worker's decode step now: the model's, or slower where the worker's snapshot measured
    slower (its recent decode-only steps, at their batch, plus ``decode_step_s_per_seq`` for each
    sequence more now). Never faster: an idle worker has no measurement, and a busy one must not
    look cheaper than an idle one because it was measured. Steps that held a prompt chunk are not in
    the measurement: the prompt work ahead is ``queue_s`` and the interference term's, and a step
    time of a worker busy with prompts (as running / generation tokens/s had it) counted it again,
    several times over, taking requests off the worker that holds their prefix."""
    modelled = m.decode_step_s + m.decode_step_s_per_seq * batch(w)
    if w.decode_step_s > 0:
        return max(modelled, w.decode_step_s + m.decode_step_s_per_seq * max(batch(w) - w.decode_step_seqs, 0))
    return modelled


def local_prefill_s(w: WorkerLoad, uncached_tokens: int, m: CostModel) -> float:
    t = uncached_tokens / rate(w, m)
    return queue_s(w, m) + t + m.interference * t * (batch(w) + 1)


def remote_prefill_s(p: WorkerLoad, req: RouteRequest, m: CostModel) -> float:
    u = uncached(p, req)
    return queue_s(p, m) + u / rate(p, m) + shortfall_s(p, u, m)


def via_remote_s(remote_s: float, uncached_on_decode: int, m: CostModel) -> float:
    return remote_s + m.transfer_s_per_token * uncached_on_decode + m.remote_overhead_s


def remote_interference_s(w: WorkerLoad, req: RouteRequest, m: CostModel) -> float:
    """What the remote prefill delays decode worker ``w``'s batch by when the two contend for compute
    (``RouteRequest.shares_remote``), as ``local_prefill_s`` counts a local one's; else 0."""
    if w.worker_id not in req.shares_remote:
        return 0.0
    return m.interference * req.remote_compute_s * (batch(w) + 1)


def decode_s(w: WorkerLoad, m: CostModel) -> float:
    return m.decode_horizon_tokens * (step_s(w, m) + m.decode_step_s_per_seq * (batch(w) + 1))


def decode_cost(w: WorkerLoad, req: RouteRequest, m: CostModel) -> float:
    """Predicted seconds of sending the request to decode worker ``w``: ``decode_s`` + the cheaper of
    ``local_prefill_s`` and ``via_remote_s`` + ``shortfall_s`` (``decode_costs`` of one worker)."""
    return decode_costs((w,), req, m)[0]


def decode_costs(workers: Iterable[WorkerLoad], req: RouteRequest, m: CostModel) -> list[float]:
    """``decode_cost`` of each worker, written out in one loop body with the model's coefficients read
    once (a policy evaluates it for every worker of the pool on each request: with 64 workers the
    decision's p99 is the target; tests/router/test_cost.py checks it against the terms)."""
    base, per_seq, horizon = m.decode_step_s, m.decode_step_s_per_seq, m.decode_horizon_tokens
    default_rate, interference = m.prefill_tokens_per_s, m.interference
    remote, overhead = req.remote_s, m.remote_overhead_s
    shares, held = req.shares_remote, interference * req.remote_compute_s
    per_token, prompt, cached = m.transfer_s_per_token, req.prompt_tokens, req.cached
    out = []
    for w in workers:
        b = w.num_running + w.num_waiting
        if w.inflight > b:
            b = w.inflight
        step = base + per_seq * b
        if w.decode_step_s > 0:
            more = b - w.decode_step_seqs
            measured = w.decode_step_s + per_seq * (more if more > 0 else 0)
            if measured > step:
                step = measured
        u = prompt - cached.get(w.worker_id, 0) if cached else prompt
        u = u if u > 0 else 0
        r = w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else default_rate
        t = u / r
        queued = w.waiting_prompt_tokens if w.waiting_prompt_tokens > w.inflight_tokens else w.inflight_tokens
        prefill = queued / r + t + interference * t * (b + 1)
        if remote is not None:
            via = remote + per_token * u + overhead  # as via_remote_s adds them
            if shares and w.worker_id in shares:
                via += held * (b + 1)  # remote_interference_s
            if via < prefill:
                prefill = via
        need = u + horizon
        free = w.free_kv_tokens
        if 0 <= free < need:
            prefill += (need - free) / r
        out.append(horizon * (step + per_seq * (b + 1)) + prefill)
    return out


def cheapest_remote(prefills: Sequence[WorkerLoad], req: RouteRequest,
                    m: CostModel) -> tuple[WorkerLoad, float] | None:
    """The prefill worker of the least ``remote_prefill_s`` and that cost (None: no prefill worker)."""
    return min(((p, remote_prefill_s(p, req, m)) for p in prefills), key=lambda pc: pc[1], default=None)


def with_remote(req: RouteRequest, prefills: Sequence[WorkerLoad], m: CostModel,
                contention: Mapping[str, frozenset[str]] | None = None) -> RouteRequest:
    """``req`` with its cheapest remote prefill: the cost, and, where that prefill worker contends
    with decode workers for compute (``contention``: worker id -> the workers it contends with,
    pdserve/compute_id.py), its compute seconds and those decode workers."""
    best = cheapest_remote(prefills, req, m)
    if best is None:
        return RouteRequest(req.prompt_tokens, req.cached)
    p, remote = best
    shares = (contention or {}).get(p.worker_id, frozenset()) if m.contention else frozenset()
    compute = uncached(p, req) / rate(p, m) if shares else 0.0
    return RouteRequest(req.prompt_tokens, req.cached, remote, compute, shares)


def least(costs: Iterable[tuple[str, float]], rng: random.Random) -> str | None:
    """The least cost, equal ones at random: ``choose`` at temperature 0, in one pass."""
    best, tied = math.inf, []
    for name, c in costs:
        if c < best - _TIE:
            best, tied = c, [name]
        elif c <= best + _TIE:
            tied.append(name)
    if len(tied) <= 1:
        return tied[0] if tied else None
    return rng.choice(sorted(tied))


def choose(costs: Mapping[str, float], temperature: float, rng: random.Random) -> str | None:
    """The least cost (equal ones at random); with a temperature, a softmax draw over the costs."""
    if not costs:
        return None
    if temperature <= 0:
        return least(costs.items(), rng)
    low = min(costs.values())
    names = sorted(costs)
    weights = [math.exp(-(costs[k] - low) / temperature) for k in names]
    return rng.choices(names, weights)[0]


def describe_pick(role: str, loads: Sequence[WorkerLoad], req: RouteRequest, chosen: str | None, m: CostModel) -> str:
    """A pick as a line of the decisions' debug log (the router's and the simulator's, so that the two can be
    compared line by line): what was known of each candidate (its load snapshot and the router's own counts)
    and its seconds by the cost model (what ``cache_aware`` picks by; the other policies pick by their keys)."""
    seconds = decode_costs(loads, req, m) if role == "decode" else [remote_prefill_s(w, req, m) for w in loads]
    parts = [f"{w.worker_id}: {s:.3f} s (inflight {w.inflight} / {w.inflight_tokens} tok, running {w.num_running}, "
             f"waiting {w.num_waiting} / {w.waiting_prompt_tokens} tok, prefill {w.prefill_tokens_per_s:.0f} tok/s, "
             f"step {1e3 * w.decode_step_s:.1f} ms at {w.decode_step_seqs:.1f}, free {w.free_kv_tokens} tok)"
             for w, s in zip(loads, seconds)]
    remote = "" if req.remote_s is None else f", cheapest remote prefill {req.remote_s:.3f} s"
    return f"route {role}: {req.prompt_tokens} prompt tokens{remote} -> {chosen}; " + "; ".join(parts)


def describe_prefill(where: str, decode_id: str, local_s: float | None, remote_s: float | None, cached: int) -> str:
    """The second decision of a disaggregated request (``policy.prefill_route``) as a debug-log line."""
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return (f"prefill {where} (here on {decode_id} {fmt(local_s)} s, through a prefill worker {fmt(remote_s)} s, "
            f"{cached} tokens cached)")
