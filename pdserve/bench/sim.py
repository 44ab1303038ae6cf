"""``pdserve sim``: a discrete-event simulation of a serving cluster, on the real policies.

    result = simulate(SimConfig(prefill_replicas=2, decode_replicas=4), profile, requests)
    result.summary(slo)      # the bench's metrics (metrics.summarize), for its table, JSON and plots

What is real and what is modelled:

| real (the same code as the live cluster)                    | modelled                                  |
|---|---|
| each replica's ``Scheduler``, ``KVCacheManager``, block pool | a step's duration: ``profile.step_s``     |
| routing: ``prefill_route``, the named policies, the cost     | a KV transfer: ``profile.transfer_s`` of  |
|   model, the prefix index fed by the pools' KV events,       |   the tokens the decode worker lacks,     |
|   recent routes                                              |   from the first token on; a prefill      |
|                                                              |   worker's step: + shipping its KV        |
|                                                              |   (``_export_s``)                         |
| autoscaling: ``PoolPolicy.decide`` on the pools' signals     | a new replica: ready ``startup_s`` later  |
|                                                              | sampled tokens: one fixed id, never a stop|

A request's lifecycle (the dispatcher's sequence, router/dispatcher.py, minus the RPCs)::

    arrival -> prefill_route(prompt, a prefill worker in rotation?)
      colocated: decode policy picks a worker -> add_request -> its steps: prompt chunks, decodes
      reserve:   decode policy picks a worker -> reserve_remote_kv (None: the next one; none: colocated)
                 -> prefill_route again, with the decode worker's real hit and both ways in seconds
                 remote: prefill policy picks a worker -> add_request (handoff after 1 token)
                         first token (the TTFT) -> transfer_s(uncached on decode) -> finish_remote_kv(ok)
                 local:  finish_remote_kv(not ok): the decode worker computes what it lacks
    each step end: one token per sampling request; KV events -> the prefix index; the next step

Load snapshots (``WorkerLoad``) are read as the router reads them: the router's own in-flight counts
exactly, the worker's numbers as of its last poll (``poll_interval_s``), its prefill rate as of its last
ended step (the engine times a step when it ends: a long prompt's step under way is not in it yet). Time
is simulated: nothing here reads a clock, and a seed fixes every draw, so a run is reproducible.

Speed (``fast_decode``): a decode worker's step in which every running request decodes one token (a
free block for each request starting one, none stopping but at its length) skips
``Scheduler.schedule``/``update`` and their per-step objects for its running requests: it makes the
same ``KVCacheManager.allocate_slots`` calls the scheduler would (only where a block starts or
fills: elsewhere that call changes nothing), the same token appends, and ends requests at their
length with ``finish_requests``; what waits is then admitted by the scheduler's own code with the
budget left (``Scheduler.admit``), as ``schedule`` admits after its running requests. Such steps in
a row, with nothing to admit, are one event, a *run* (``_Replica.begin_run``): from its start, the
steps until a request reaches its length, their times known in advance (the batch and its context
are). Whatever reads the replica in between (a poll of its load, the autoscaler's signals) first
brings it to that moment (``advance``: the steps ended by then, the one under way begun, with the
same ``allocate_slots`` calls in the same order); whatever changes it (a request added, a
reservation, remote KV landing) first ends the run there (``_break``), and the step under way ends
on its own. With a prefix index the run stops at the first step that makes or fills a block, whose
KV events must reach the index when it ends. So the records, the KV events and the load snapshots
are those of the scheduler's path (tests compare the two, and the replicas' counts); the compact
records' gap runs come in another order (the same distribution). Without a prefix index, the pools
keep no KV events.
``compact_records`` keeps the inter-token gaps as (gap, count) runs instead of a list per request
(``SimResult.summary`` reads them; a million requests' lists would not fit in memory).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import math
import random
from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.latency_model import Profile, StepFeatures, features_of
from pdserve.bench.metrics import SLO, RequestRecord, Summary, summarize
from pdserve.cluster.autoscale import AutoscalingConfig, PoolPolicy, PoolSignals
from pdserve.configs import ConfigError
from pdserve.engine.block_pool import KVEventBuffer
from pdserve.engine.engine import DECODE_STEP_SAMPLES, PREFILL_RATE_MIN_TOKENS, PREFILL_RATE_STEPS, mean_decode_step
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ModelOutput, Scheduler
from pdserve.router import cost
from pdserve.router.cost import CostModel, RouteRequest
from pdserve.router.policy import (
    POLICIES,
    POLICY_KEYS,
    DisaggregationConfig,
    PrefillInputs,
    WorkerLoad,
    prefill_route,
)
from pdserve.router.prefix_index import PrefixIndex, keys_of_packed, prompt_keys
from pdserve.router.recent_routes import RecentRoutes, predicted_cached
from pdserve.state.store import KVEventRecord
from pdserve.worker.metrics import RecentQuantile

log = logging.getLogger(__name__)

RUN_TIMES = 8  # a run's step times computed at a time (_Replica.extend_run)
# A _PickIndex's heap is rebuilt from its current entries when it holds more than this many per replica
# (plus PICK_HEAP_MIN): its older versions are skipped only when they reach the top.
PICK_HEAP_SLACK, PICK_HEAP_MIN = 4, 64
TOKEN = 0  # every sampled token (requests carry no EOS id: they end at max_tokens)
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class SimConfig:
    """A simulated cluster: the pools, the engine's limits per replica, the router, the autoscaler."""

    prefill_replicas: int = 0  # 0: colocated (decode workers prefill their own prompts)
    decode_replicas: int = 1
    policy: str = "cache_aware"  # a router policy name (router/policy.py POLICIES)
    block_size: int = 16
    num_kv_blocks: int = 8192  # per replica
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_prefill_tokens: int | None = None  # the engine's prompt share of a step (None: the whole budget)
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    cost: CostModel | None = None  # the router's cost model (None: the profile's, Profile.cost_model)
    recent_routes_s: float = 5.0  # cache_aware: the router's recent routes (0: off)
    poll_interval_s: float = 0.5  # how stale the router's view of a worker's own numbers is
    transfer_backend: str = "grpc"  # the profile's transfer model to use
    autoscaling: dict[str, AutoscalingConfig] = field(default_factory=dict)  # by role; absent: fixed size
    startup_s: float = 30.0  # a replica the autoscaler adds serves this long after it is asked for
    autoscale_interval_s: float = 1.0  # how often the autoscaling policy decides
    # The policy sees each replica's numbers as Ray Serve hands them over: the samples taken at its
    # decisions within this look-back, time-weighted (Serve's look_back_period_s; 0: the numbers now).
    look_back_s: float = 0.0
    settle_s: float = 0.0  # the autoscaler keeps deciding this long after the last request ends (0: it stops then)
    seed: int = 0  # the policies' tie-breaks
    fast_decode: bool = True  # decode-only steps without the scheduler's objects (same results; False: reference)
    compact_records: bool = False  # records without per-token gaps; SimResult.summary has them (for big runs)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"router.policy: {self.policy!r} is not one of {sorted(POLICIES)}")
        if self.prefill_replicas < 0 or self.decode_replicas < 0:
            raise ConfigError("pools: replicas must not be negative")
        decode_scaler = self.autoscaling.get("decode")
        if self.decode_replicas < 1 and (decode_scaler is None or decode_scaler.min_replicas):
            raise ConfigError(f"pools.decode.replicas: at least one decode worker is needed, got "
                              f"{self.decode_replicas}")
        for key in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"engine.{key}: must be at least 1, got {getattr(self, key)}")
        for key in ("startup_s", "poll_interval_s", "recent_routes_s", "settle_s", "look_back_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must not be negative, got {getattr(self, key)}")
        if self.autoscale_interval_s <= 0:
            raise ConfigError(f"autoscale_interval_s: must be positive, got {self.autoscale_interval_s}")
        unknown = sorted(set(self.autoscaling) - set(ROLES))
        if unknown:
            raise ConfigError(f"autoscaling: {unknown} are not pools; pools: {list(ROLES)}")

    @classmethod
    def from_serve(cls, serve, profile: Profile, **overrides) -> SimConfig:
        """From the cluster's ``ServeConfig`` (cluster/config.py; one model): its pools, engine limits,
        router policy, disaggregation thresholds and autoscaling. The KV blocks per replica come from
        ``engine.num_kv_blocks``, else ``kv_cache_memory_gb`` over the profile's KV bytes per token."""
        if len(serve.served()) > 1:
            raise ConfigError("models: the simulator runs one model's pools; give a file with one model")
        model = serve.served()[0]
        engine, pools, router = model.engine, model.pools, serve.router
        blocks = engine.num_kv_blocks or int(engine.kv_cache_memory_gb * 2**30
                                             // (profile.kv_bytes_per_token * engine.block_size))
        fields = dict(
            prefill_replicas=pools.prefill.replicas, decode_replicas=pools.decode.replicas, policy=router.policy,
            block_size=engine.block_size, num_kv_blocks=blocks, max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.max_num_seqs, max_prefill_tokens=engine.max_prefill_tokens,
            scheduling_policy=engine.scheduling_policy,
            enable_prefix_caching=engine.enable_prefix_caching,
            disaggregation=DisaggregationConfig(router.disagg_min_prompt_tokens, router.disagg_min_uncached_tokens),
            recent_routes_s=router.recent_routes_s, poll_interval_s=router.poll_interval_s,
            transfer_backend=serve.kv_transfer.backend,
            autoscaling={r: getattr(pools, r).autoscaling for r in ROLES if getattr(pools, r).autoscaling},
            # what cluster/ray_app.py asks of Serve: a look-back of two metrics intervals
            look_back_s=2 * serve.ray.metrics_interval_s,
        )
        return cls(**{**fields, **overrides})


@dataclass(frozen=True)
class SimRequest:
    """One request of the workload: when it arrives, its prompt, how many tokens it generates."""

    index: int
    arrival: float  # seconds from the start
    prompt: list[int]
    output_len: int
    warmup: bool = False  # served like the rest, left out of the summary (the bench's warm-up requests)


@dataclass
class ReplicaStats:
    worker_id: str
    role: str
    started: float  # when it was asked for
    ready: float | None  # when it began serving (None: never did)
    stopped: float | None  # when it left after draining (None: still up at the end)
    steps: int
    busy_s: float
    preemptions: int
    prefix_queries: int
    prefix_hits: int


@dataclass
class SimResult:
    records: list[RequestRecord]  # by request index, with simulated times (the bench's records)
    duration_s: float  # first arrival to last finish
    replicas: list[ReplicaStats]
    pools: dict[str, list[tuple[float, int, int]]]  # role -> (time, replicas serving, replicas asked for)
    decisions: dict[str, int]  # prefill_route outcomes, as the router's decisions metric counts them
    events: int  # events processed
    itl_runs: tuple[array, array] | None = None  # compact_records: (gap s, how many tokens had it), all requests

    def summary(self, slo: SLO | None = None) -> Summary:
        """The bench's summary of the records (``metrics.summarize``); with compact records, the ITL
        statistics from ``itl_runs`` (the same numbers as from per-request lists, up to float rounding)."""
        out = summarize(self.records, self.duration_s, slo)
        if self.itl_runs is not None:
            out.itl_ms = weighted_stats_ms(*self.itl_runs)
        return out


def weighted_stats_ms(values, counts) -> dict[str, float]:
    """``metrics.stats_ms`` of ``values`` each repeated ``counts`` times, without repeating them:
    numpy's mean and its linear-interpolation percentiles (``np.median`` is the 50th)."""
    v = np.asarray(values, dtype=float) * 1e3
    c = np.asarray(counts, dtype=np.int64)
    keep = c > 0
    v, c = v[keep], c[keep]
    if not len(v):
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "max")}
    order = np.argsort(v, kind="stable")
    v, c = v[order], c[order]
    ends = np.cumsum(c)  # sorted value i fills positions [ends[i-1], ends[i])
    n = int(ends[-1])

    def at(position: int) -> float:
        return float(v[np.searchsorted(ends, position, side="right")])

    def percentile(q: float) -> float:
        virtual = (q / 100) * (n - 1)
        low = math.floor(virtual)
        a, b, t = at(low), at(min(low + 1, n - 1)), virtual - low
        return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t

    return {"mean": float((v * c).sum() / n), "median": percentile(50), "p90": percentile(90),
            "p99": percentile(99), "max": float(v[-1])}


def simulate(config: SimConfig, profile: Profile, requests: list[SimRequest]) -> SimResult:
    """Run the cluster on the requests (sorted by arrival) until every request has finished."""
    with _no_cyclic_collections():
        sim = _Simulation(config, profile, requests)
        try:
            return sim.run()
        finally:
            sim.close()


@contextlib.contextmanager
def _no_cyclic_collections():
    """Python's cyclic collector off during a simulation. Its objects form no reference cycles but
    the simulation's own (its replicas, made once; a test checks that a run leaves none), so
    reference counting frees every request's objects as before. The collector's passes over the
    millions of long-lived objects (blocks, requests in flight) grew with the heap: with one every
    100,000 allocations they still took 15 s of a 127 s run (1,000 replicas, 150,000 requests)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- a replica -----------------------------------------------------------------------------------


class _Replica:
    """One worker: a real scheduler over a real KV cache, its steps timed by the profile."""

    def __init__(self, worker_id: str, role: str, config: SimConfig, fingerprint: str, now: float):
        self.worker_id, self.role = worker_id, role
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching, fingerprint)
        if config.policy != "cache_aware":  # no prefix index reads its KV events
            self.kv.pool.events = KVEventBuffer(0)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.scheduling_policy, config.max_prefill_tokens)
        self.state = "starting"  # starting -> ready -> draining -> stopped (or starting -> stopped)
        self.stepping = False
        self.run: _Run | None = None  # the decode-only steps under way as one event (fast_decode)
        self.watch: set[_Replica] | None = None  # told when its load changes (its role's _PickIndex)
        self.due: float | None = None  # when its snapshot is polled again, as its _PickIndex has it
        self._inflight = self._inflight_tokens = 0  # the router's counts
        self.finished = 0  # requests it finished (the autoscaler's "served since the last report")
        self.stats = ReplicaStats(worker_id, role, now, None, None, 0, 0.0, 0, 0, 0)
        self._prefill_steps: deque[tuple[int, float]] = deque(maxlen=PREFILL_RATE_STEPS)
        self._prefilling: tuple[int, float] | None = None  # the prompt step under way: in the rate when it ends
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=DECODE_STEP_SAMPLES)  # (sequences, seconds)
        self._generated: deque[tuple[float, int]] = deque()  # (step end, tokens) within the rate window
        self._generated_sum = 0
        self._snapshot = WorkerLoad(worker_id, 0, 0, 0, 0.0)
        self._snapshot_at = -math.inf
        self._load = self._snapshot  # the last load handed out (built again when a count in it changed)

    @property
    def inflight(self) -> int:
        return self._inflight

    @inflight.setter
    def inflight(self, n: int) -> None:
        self._inflight = n
        if self.watch is not None:
            self.watch.add(self)

    @property
    def inflight_tokens(self) -> int:
        return self._inflight_tokens

    @inflight_tokens.setter
    def inflight_tokens(self, n: int) -> None:
        self._inflight_tokens = n
        if self.watch is not None:
            self.watch.add(self)

    def load(self, now: float, poll_s: float) -> WorkerLoad:
        """What the router knows of it: its own counts now, the worker's as of the last poll."""
        if now - self._snapshot_at >= poll_s:
            self.advance(now)
            self._snapshot, self._snapshot_at = self._poll(now), now
            self._load = self._snapshot
            if self.watch is not None:
                self.watch.add(self)
        w = self._load
        if w is self._snapshot or w.inflight != self.inflight or w.inflight_tokens != self.inflight_tokens:
            w = self._load = self._snapshot._replace(inflight=self.inflight, inflight_tokens=self.inflight_tokens)
        return w

    def known_load(self) -> WorkerLoad:
        """``load`` as the router last knew it, without polling (the debug log's view of an index's pick)."""
        return self._snapshot._replace(inflight=self.inflight, inflight_tokens=self.inflight_tokens)

    def _poll(self, now: float) -> WorkerLoad:
        """The worker's load snapshot as its servicer reports it (worker/servicer.py, engine stats)."""
        s = self.scheduler
        waiting_prompt = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting)
        while self._generated and self._generated[0][0] < now - 5.0:  # async_engine's rate window
            self._generated_sum -= self._generated.popleft()[1]
        seconds = sum(t for _, t in self._prefill_steps)
        prefill_rate = sum(n for n, _ in self._prefill_steps) / seconds if seconds > 0 else 0.0
        decode_s, decode_seqs = mean_decode_step(self._decode_steps)
        waiting = s.num_waiting + len(s.remote)  # those waiting for remote KV too, as the servicer adds them up
        return WorkerLoad(self.worker_id, 0, s.num_running, waiting, self.kv.usage, waiting_prompt, 0,
                          self._generated_sum / 5.0, prefill_rate, self.kv.pool.num_free_blocks * self.kv.block_size,
                          decode_s, decode_seqs)

    def begin_step(self, profile: Profile, batch: list[Request] | None, extra_s=None):
        """Schedule a step: (its output, its seconds), or None with nothing to run. ``batch``: the running
        requests of a step whose running part is decode-only (``decode_only``), each decoding a token,
        and the scheduler admitting what waits after them; None: the scheduler's step. ``extra_s``: what
        the scheduler's step takes beyond the profile's step (its scheduled items -> seconds), or None."""
        if batch is not None:
            return self._begin_decode(batch, profile)
        out = self.scheduler.schedule()
        while out.empty and out.preempted_ids:  # it preempted all it ran and admitted nothing in that call:
            out = self.scheduler.schedule()     # the engine's loop schedules again at once (has_unfinished)
        if out.empty:
            return None
        seconds = profile.step_s(features_of(out.scheduled))
        if extra_s is not None:
            seconds += extra_s(out.scheduled)
        self._account(out.scheduled, len(out.scheduled), seconds)
        return out, seconds

    def _account(self, scheduled, size: int, seconds: float) -> None:
        """A step begun: its prompt tokens (of ``scheduled``: the others decode) or its ``size`` decoding
        sequences into the rates the engine measures, its seconds into the replica's stats."""
        prompt = sum(max(0, min(s.start + s.num_tokens, s.request.num_prompt_tokens) - s.start)
                     for s in scheduled)
        if prompt >= PREFILL_RATE_MIN_TOKENS:  # as the engine measures its prefill rate and decode step
            self._prefilling = (prompt, seconds)  # the engine measures a step when it ends
        elif not prompt:
            self._decode_steps.append((size, seconds))
        self.stepping = True
        self.stats.steps += 1
        self.stats.busy_s += seconds

    def end_step(self, out, now: float) -> list[tuple[Request, bool]]:
        """The step's tokens (one per sampling request) into the scheduler: (request, finished) of each.
        ``out``: the scheduler's output, or (decode batch, the scheduler's admissions or None) of a step
        begun by ``_begin_decode``."""
        self.stepping = False
        if self._prefilling is not None:
            self._prefill_steps.append(self._prefilling)
            self._prefilling = None
        admitted = out
        outputs = []
        if isinstance(out, tuple):
            batch, admitted = out
            outputs = self._end_decode(batch)
        if admitted is not None:
            sampled = {item.request.request_id: [TOKEN] for item in admitted.scheduled if item.sample}
            outputs += [(co.request, co.finished) for co in self.scheduler.update(admitted, ModelOutput(sampled))]
        self._generated.append((now, len(outputs)))
        self._generated_sum += len(outputs)
        return outputs

    # A decode-only step, as Scheduler.schedule and update would run it (module docstring, "Speed").

    def decode_only(self) -> list[Request] | None:
        """The running requests, when the next step gives each exactly one token: a decode worker (its
        requests stop only at their length: ``_request``), each one token behind, within the token
        budget, and a free block for each request that starts one (no preemption; the scheduler then
        admits what waits with the budget left, ``Scheduler.admit``). None otherwise: the scheduler
        steps."""
        s = self.scheduler
        running = s.running
        if self.role != "decode" or not running or len(running) > s.max_num_batched_tokens:
            return None
        bs = self.kv.block_size
        new_blocks = 0
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1 or r.num_spec_slots:
                return None
            if r.num_computed_tokens % bs == 0:
                new_blocks += 1
        if new_blocks > self.kv.pool.num_free_blocks:
            return None
        return list(running)

    @property
    def admitting(self) -> bool:
        """Whether the scheduler's next step would try to admit a waiting request (a seat and a token of
        the budget left after one for each running request)."""
        s = self.scheduler
        return bool(s.waiting) and len(s.running) < min(s.max_num_seqs, s.max_num_batched_tokens)

    def _begin_decode(self, batch: list[Request], profile: Profile):
        """Each request's slot for its token, in the scheduler's order, then the scheduler's admissions
        with the budget left (``admitting``). ``allocate_slots`` is called where the position starts a
        block (a new one) or fills one (its hash cached, a KV event); at any other position it would
        change nothing."""
        bs, kv = self.kv.block_size, self.kv
        context = 0
        for r in batch:
            n = r.num_computed_tokens
            if n % bs == 0 or (n + 1) % bs == 0:
                if kv.allocate_slots(r, 1) is None:
                    raise AssertionError(f"{self.worker_id}: no block for {r.request_id} after counting free ones")
            r.num_computed_tokens = n + 1
            context += n + 1
        if not self.admitting:
            seconds = profile.step_s(StepFeatures(decode_seqs=len(batch), decode_context=context))
            self._account((), len(batch), seconds)
            return (batch, None), seconds
        admitted = self.scheduler.admit(self.scheduler.max_num_batched_tokens - len(batch))
        f = features_of(admitted.scheduled)
        seconds = profile.step_s(StepFeatures(f.prefill_tokens, f.prefill_pairs, f.decode_seqs + len(batch),
                                              f.decode_context + context))
        self._account(admitted.scheduled, len(batch) + len(admitted.scheduled), seconds)
        return (batch, admitted), seconds

    def _end_decode(self, batch: list[Request]) -> list[tuple[Request, bool]]:
        outputs = []
        for r in batch:
            r.append_output_token(TOKEN)
            done = r.num_output_tokens >= r.max_output_tokens
            if done:  # as update() ends it: FINISHED_LENGTH, out of running, its blocks freed in this order
                self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_LENGTH)
            outputs.append((r, done))
        return outputs

    # Decode-only steps in a row as one event (module docstring, "Speed").

    def begin_run(self, batch: list[Request], profile: Profile, now: float, publishes: bool) -> _Run | None:
        """The decode-only steps that follow from now until a request ends at its length (the last one),
        as one run, its first step begun; None when fewer than two follow (the step goes alone). Until
        one ends, nothing but an outside call changes the batch: no admission (``_kick`` runs only a
        batch not ``admitting``), blocks for every step's new ones counted free now, and every request
        past its first token (its first changes the router's counts). ``publishes``: KV events are read
        (a prefix index), so the run ends with the first step that makes or fills a block, whose events
        its end publishes."""
        bs = self.kv.block_size
        base: list[int] = []
        residues: dict[int, list[int]] = {}
        left = None  # steps until the first request reaches its length
        for i, r in enumerate(batch):  # one pass: a run begins at every break of a 1,000-replica cluster
            done, limit = r.num_output_tokens, r.max_output_tokens
            if done == 0 or limit is None:
                return None
            if left is None or limit - done < left:
                left = limit - done
            n = r.num_computed_tokens
            base.append(n)
            residues.setdefault(n % bs, []).append(i)
        if left < 2:
            return None
        free, need, steps = self.kv.pool.num_free_blocks, 0, 0
        while steps < left:
            starting = len(residues.get(-steps % bs, ()))
            if need + starting > free:
                break
            need += starting
            steps += 1
            if publishes and (starting or residues.get((-steps) % bs)):  # this step starts or fills a block
                break
        if steps < 2:
            return None
        run = self.run = _Run(batch, base, residues, steps, sum(base), now, [0] * len(batch))
        self.stepping = True
        self.extend_run(profile)
        self.advance(now)
        return run

    def extend_run(self, profile: Profile) -> None:
        """The times of the run's next ``RUN_TIMES`` steps (a run is most often broken off sooner)."""
        run = self.run
        size, ends, seconds = len(run.batch), run.ends, run.seconds
        t = ends[-1] if ends else run.start
        for j in range(len(ends), min(len(ends) + RUN_TIMES, run.steps)):
            s = profile.step_s(StepFeatures(decode_seqs=size, decode_context=run.context + size * (j + 1)))
            t += s
            seconds.append(s)
            ends.append(t)

    def advance(self, now: float) -> None:
        """The run's steps as of ``now``: those ended by then ended (their tokens counted in the rate
        window), the one under way begun (its blocks taken, its step counted). Its last step is ended
        by the simulation (``_step_end``), which ends requests. Request objects catch up in ``sync``."""
        run = self.run
        if run is None:
            return
        ended = min(bisect_right(run.ends, now), len(run.ends) - 1)  # the last one known is under way
        size = len(run.batch)
        for j in range(run.ended, ended):
            self._generated.append((run.ends[j], size))
            self._generated_sum += size
        run.ended = ended
        for j in range(run.begun, ended + 1):
            self._begin_run_step(run, j)
        run.begun = ended + 1

    def _begin_run_step(self, run: _Run, j: int) -> None:
        """Step ``j`` begun as ``_begin_decode`` begins a step: ``allocate_slots`` where a request's
        position starts or fills a block, in the batch's order."""
        bs, kv = self.kv.block_size, self.kv
        starting = run.residues.get(-j % bs, ())
        filling = run.residues.get((-j - 1) % bs, ())
        touched = sorted({*starting, *filling}) if starting and filling else (starting or filling)
        for i in touched:
            r = run.batch[i]
            self._sync_one(run, i, j)
            r.num_computed_tokens = run.base[i] + j
            if kv.allocate_slots(r, 1) is None:
                raise AssertionError(f"{self.worker_id}: no block for {r.request_id} after counting free ones")
        self._decode_steps.append((len(run.batch), run.seconds[j]))
        self.stats.steps += 1
        self.stats.busy_s += run.seconds[j]

    def _sync_one(self, run: _Run, i: int, ended: int) -> None:
        missing = ended - run.synced[i]
        if missing:
            r = run.batch[i]
            tokens = [TOKEN] * missing
            r.output_token_ids.extend(tokens)
            r.all_token_ids.extend(tokens)
            run.synced[i] = ended

    def end_run(self) -> _Run:
        """Out of run mode (the run's last step under way, or an outside call): every request as the
        steps so far left it. The step under way ends as a lone decode step (``_end_decode``)."""
        run, self.run = self.run, None
        for i, r in enumerate(run.batch):
            self._sync_one(run, i, run.ended)
            r.num_computed_tokens = run.base[i] + run.begun
        return run

    @property
    def idle(self) -> bool:
        return not self.scheduler.requests and not self.stepping


# ---- the simulation ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Run:
    """A decode worker's decode-only steps in a row (``_Replica.begin_run``): step ``j`` runs from
    ``ends[j - 1]`` (the run's start for the first) to ``ends[j]``, every request one token a step."""

    batch: list[Request]
    base: list[int]  # each request's computed tokens when the run began
    residues: dict[int, list[int]]  # base % block_size -> the requests' places in the batch
    steps: int  # in all (its last ends a request, or would need a block not counted free)
    context: int  # the batch's computed tokens when the run began
    start: float
    synced: list[int]  # steps whose token each request object holds (``_Replica._sync_one``)
    seconds: list[float] = field(default_factory=list)  # of the steps timed so far (``extend_run``)
    ends: list[float] = field(default_factory=list)
    begun: int = 0
    ended: int = 0
    recorded: int = 0  # steps whose tokens are in the requests' records (``_Simulation._record_run``)
    flows: list | None = None  # the requests' flows, in the batch's order


@dataclass(slots=True)
class _Flow:
    """One request on its way through the cluster."""

    req: SimRequest
    record: RequestRecord
    keys: list[int] = field(default_factory=list)  # its prefix-index keys (empty: not hashed)
    decode: _Replica | None = None
    uncached: int = 0  # prompt tokens the decode worker lacks (remote: what the transfer ships)
    counted: int = 0  # tokens added to the decode worker's inflight_tokens until the first token
    generating: bool = False  # the decode worker's Generate is under way (counted in its inflight)
    last: float = 0.0  # the last token's time


class _PickIndex:
    """A role's replicas in rotation, in the order of a policy's key of their loads (POLICY_KEYS):
    the policy's choice over every replica's load without building every load at each pick, which
    made a 1,000-replica simulation spend most of its time in the router's ``min``.

    A replica's load changes when the router's counts change or the worker is polled again: the
    first marks it dirty (``_Replica.watch``), the second falls due in time order (``expiry``).
    At a pick, what fell due and what is dirty is loaded again, as the router's every-worker scan
    would at that moment, and pushed with a new version; older versions are skipped when they
    come up, and dropped all at once when they outnumber the current ones (``PICK_HEAP_SLACK``;
    a busy replica's old entries sink and would otherwise pile up: 145,000 of them after 350,000
    requests on 1,000 replicas). The choice is the policy's over the same loads (one current entry
    per replica, a total order), so the simulation is unchanged.
    """

    def __init__(self, replicas: list[_Replica], key, now: float, poll_s: float):
        self.key = key
        self.members = {w.worker_id: w for w in replicas}
        self.dirty: set[_Replica] = set()
        self.heap: list[tuple] = []  # (key, version, worker id)
        self.expiry: list[tuple[float, str]] = []  # (when its snapshot is polled again, worker id)
        self.version: dict[str, int] = {}
        for w in replicas:
            w.watch, w.due = self.dirty, None
            self._push(w, now, poll_s)
        self.dirty.clear()

    def close(self) -> None:
        """Out of use (the rotation changed): its replicas stop reporting to it."""
        for w in self.members.values():
            if w.watch is self.dirty:
                w.watch = None

    def _push(self, w: _Replica, now: float, poll_s: float) -> None:
        load = w.load(now, poll_s)
        version = self.version[w.worker_id] = self.version.get(w.worker_id, 0) + 1
        heapq.heappush(self.heap, (self.key(load), version, w.worker_id))
        if len(self.heap) > PICK_HEAP_SLACK * len(self.members) + PICK_HEAP_MIN:  # mostly older versions:
            self.heap = [e for e in self.heap if e[1] == self.version[e[2]]]  # only the current ones kept
            heapq.heapify(self.heap)
        due = w._snapshot_at + poll_s
        if w.due != due:
            w.due = due
            heapq.heappush(self.expiry, (due, w.worker_id))

    def pick(self, now: float, poll_s: float, tried: set[str]) -> str | None:
        while self.expiry and self.expiry[0][0] <= now + 1e-9:  # load() decides whether it is due
            due, wid = heapq.heappop(self.expiry)
            w = self.members[wid]
            if w.due == due:
                w.due = None
                self.dirty.add(w)
        while self.dirty:
            w = self.dirty.pop()
            self._push(w, now, poll_s)
            self.dirty.discard(w)  # a poll inside _push marked it again
        chosen, passed = None, []
        while self.heap:
            _, version, wid = self.heap[0]
            if version != self.version[wid]:
                heapq.heappop(self.heap)
            elif wid in tried:
                passed.append(heapq.heappop(self.heap))
            else:
                chosen = wid
                break
        for entry in passed:
            heapq.heappush(self.heap, entry)
        return chosen


class _Simulation:
    def __init__(self, config: SimConfig, profile: Profile, requests: list[SimRequest]):
        self.config, self.profile, self.requests = config, profile, requests
        self.cost = config.cost or profile.cost_model(config.transfer_backend)
        profile.transfer_s(1, config.transfer_backend)  # a backend the profile lacks: refused now
        self._exports_cost = profile.ships_with_cost(config.transfer_backend)  # (a prefill worker's steps)
        self.fingerprint = str(profile.model.get("name", "sim"))
        self.rng = random.Random(config.seed)
        self.decode_policy, self.prefill_policy = POLICIES[config.policy](self.cost, self.rng)
        self.index = PrefixIndex() if config.policy == "cache_aware" else None
        self.recent = ({r: RecentRoutes(config.recent_routes_s) for r in ROLES}
                       if config.policy == "cache_aware" and config.recent_routes_s > 0 else None)
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0
        self.pools: dict[str, list[_Replica]] = {r: [] for r in ROLES}
        self.replicas: list[_Replica] = []
        self.by_id: dict[str, _Replica] = {}
        self._rotation: dict[str, list[_Replica]] = {}  # role -> its replicas in rotation (_routable)
        self._indexes: dict[str, _PickIndex] = {}  # role -> its rotation by the policy's key (POLICY_KEYS)
        self.timeline: dict[str, list[tuple[float, int, int]]] = {r: [] for r in ROLES}
        self.flows: dict[str, _Flow] = {}
        self.waiting_for_decode: deque[_Flow] = deque()
        self.woken_prefill = False  # a long prompt found no prefill worker since the last tick
        self._settle_until: float | None = None  # the last tick after the load (SimConfig.settle_s)
        self.decisions: dict[str, int] = {}
        self.done = 0
        # Each request's record is made when it arrives (a long workload may build its prompts lazily).
        self.records: list[RequestRecord] = [None] * len(requests)
        self.itl_runs = (array("d"), array("q")) if config.compact_records else None
        self._params: dict[int, SamplingParams] = {}
        self.scalers = {role: PoolPolicy(role, c) for role, c in config.autoscaling.items()}
        self.ttft = RecentQuantile(clock=lambda: self.now)  # the pools' recent quantiles (worker/metrics.py)
        self.tpot = RecentQuantile(clock=lambda: self.now)
        self._finished_seen: dict[str, int] = {}
        self._samples: dict[str, deque] = {}  # worker id -> its (time, numbers) within the look-back
        for role, n in (("prefill", config.prefill_replicas), ("decode", config.decode_replicas)):
            for _ in range(n):
                self._ready(self._add_replica(role))

    def close(self) -> None:
        """Its own reference cycles broken (the indexes that watch its replicas, the recent quantiles'
        clocks, events left unrun), so that reference counting frees it when it is dropped. Left to the
        cyclic collector, its millions of blocks cost a full collection when the collector came back
        on: 6 s after 100,000 requests on 1,000 replicas."""
        for index in self._indexes.values():
            index.close()
        self._indexes.clear()
        for replica in self.replicas:
            replica.watch, replica.run = None, None
            replica.kv.pool.unthread()
        self.ttft = self.tpot = None
        self._heap.clear()

    # ---- the event loop ------------------------------------------------------------------------

    def _at(self, t: float, fn, arg=None) -> None:
        self._seq += 1  # equal times run in the order they were scheduled
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def run(self) -> SimResult:
        if self.requests:
            self._enter(0)
        if self.scalers:
            self._at(0.0, self._tick)
        heap, pop, events = self._heap, heapq.heappop, 0
        while heap:
            self.now, _, fn, arg = pop(heap)
            events += 1
            fn(arg)
        self.events += events
        for flow in self.flows.values():  # stuck (no event could move them): failed
            flow.record.error = "unfinished"
        first = min((r.start for r in self.records), default=0.0)
        last = max((r.start + r.latency for r in self.records if r.ok), default=first)
        stats = [r.stats for r in self.replicas]
        for r in self.replicas:
            r.stats.preemptions = r.scheduler.num_preemptions
            r.stats.prefix_queries, r.stats.prefix_hits = r.scheduler.prefix_queries, r.scheduler.prefix_hits
        return SimResult(self.records, last - first, stats, self.timeline, dict(sorted(self.decisions.items())),
                         self.events, self.itl_runs)

    # ---- arrivals and routing (router/dispatcher.py's sequence) --------------------------------

    def _enter(self, i: int) -> None:
        """Request ``i`` enters the cluster the profile's request overhead after it was sent (its record
        starts when it was sent), so its first token and end come that much later and its gaps do not."""
        self._at(self.requests[i].arrival + self.profile.request_overhead_s, self._arrive, i)

    def _arrive(self, i: int) -> None:
        if i + 1 < len(self.requests):
            self._enter(i + 1)
        req = self.requests[i]
        record = self.records[i] = RequestRecord(req.index, req.arrival, len(req.prompt), req.output_len,
                                                 warmup=req.warmup)
        if self.itl_runs is not None:
            record.itl = ()  # never appended to: the gaps go to itl_runs
        flow = _Flow(req, record, last=req.arrival)
        if cdiv(len(req.prompt) + 1, self.config.block_size) > self.config.num_kv_blocks:
            flow.record.error = "prompt_too_long"  # the engine refuses it (engine.validate_prompt)
            self.done += 1
            return
        self.flows[str(req.index)] = flow
        self._dispatch(flow)

    def _dispatch(self, flow: _Flow) -> None:
        if not self._routable("decode"):
            self.waiting_for_decode.append(flow)  # until a decode worker is ready
            return
        route = self._route_request(flow)
        prompt = len(flow.req.prompt)
        where = prefill_route(PrefillInputs(prompt, bool(self._routable("prefill"))), self.config.disaggregation)
        if where == "reserve":
            self._disaggregated(flow, route)
            return
        if where == "local_no_prefill_worker" and prompt >= self.config.disaggregation.min_prompt_tokens:
            self.woken_prefill = True
        self._count(where)
        self._colocated(flow, route)

    def _route_request(self, flow: _Flow) -> RouteRequest:
        """Each worker's predicted prefix hit (the index's or the recent routes', the larger), the
        cheapest remote prefill."""
        prompt, bs = flow.req.prompt, self.config.block_size
        cached: dict[str, int] = {}
        if self.index is not None:  # cache_aware (its workers are always tracked, unlike a live router's)
            flow.keys = prompt_keys(prompt, self.fingerprint, bs)
            cached = predicted_cached(flow.keys, self.index, (self.recent or {}).values(), self.now, bs)
        now, poll_s = self.now, self.config.poll_interval_s
        prefills = [w.load(now, poll_s) for w in self._routable("prefill")]
        # Every replica on hardware of its own: no contention between them (pdserve/compute_id.py).
        return cost.with_remote(RouteRequest(len(prompt), cached), prefills, self.cost)

    def _pick(self, role: str, route: RouteRequest, tried: set[str], flow: _Flow) -> _Replica | None:
        policy = self.decode_policy if role == "decode" else self.prefill_policy
        now, poll_s = self.now, self.config.poll_interval_s
        key = POLICY_KEYS.get(policy)
        if key is not None:  # the same choice, from an index kept by the key
            index = self._indexes.get(role)
            if index is None:
                index = self._indexes[role] = _PickIndex(self._routable(role), key, now, poll_s)
            chosen = index.pick(now, poll_s, tried)
            loads = None
        else:
            candidates = [w for w in self._routable(role) if w.worker_id not in tried]
            loads = [w.load(now, poll_s) for w in candidates]  # every worker: as the router does
            chosen = policy(loads, route)
        if log.isEnabledFor(logging.DEBUG):  # as the router's debug line (dispatcher._pick)
            if loads is None:  # the index's pick: what the router last knew of each, without polling
                loads = [w.known_load() for w in self._routable(role) if w.worker_id not in tried]
            log.debug("t=%.3f request %s: %s", now, flow.req.index, cost.describe_pick(role, loads, route, chosen,
                                                                                         self.cost))
        if chosen is None:
            return None
        tried.add(chosen)
        if self.recent is not None and flow.keys:
            self.recent[role].add(flow.keys, chosen, self.now)
        return self.by_id[chosen]

    def _colocated(self, flow: _Flow, route: RouteRequest) -> None:
        decode = self._pick("decode", route, set(), flow)
        self._break(decode)
        predicted = max(min(route.cached.get(decode.worker_id, 0), route.prompt_tokens - 1), 0)
        self._generate(flow, decode, route.prompt_tokens - predicted)
        decode.scheduler.add_request(self._request(flow))
        self._kick(decode)

    def _disaggregated(self, flow: _Flow, route: RouteRequest) -> None:
        tried: set[str] = set()
        while True:
            decode = self._pick("decode", route, tried, flow)
            if decode is None:  # no decode worker has room to reserve: colocated instead
                self._count("local_no_room")
                self._colocated(flow, route)
                return
            request = self._request(flow)
            self._break(decode)
            if decode.scheduler.reserve_remote_kv(request) is not None:
                break
        cached = request.num_computed_tokens
        uncached = route.prompt_tokens - cached
        load = self._load(decode)
        local_s = cost.local_prefill_s(load, uncached, self.cost)
        remote_s = None if route.remote_s is None else (cost.via_remote_s(route.remote_s, uncached, self.cost)
                                                        + cost.remote_interference_s(load, route, self.cost))
        where = prefill_route(PrefillInputs(route.prompt_tokens, True, True, cached, local_s=local_s,
                                            remote_s=remote_s), self.config.disaggregation)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("t=%.3f request %s: %s", self.now, flow.req.index,
                      cost.describe_prefill(where, decode.worker_id, local_s, remote_s, cached))
        self._count(where)
        flow.decode, flow.uncached = decode, uncached
        prefill = self._pick("prefill", route, set(), flow) if where == "remote" else None
        if prefill is None:  # prefilled on the decode worker, keeping its reservation's hit
            self._generate(flow, decode, uncached)
            decode.scheduler.finish_remote_kv(request.request_id, False)
            self._kick(decode)
            return
        prefill.inflight += 1
        prefill.inflight_tokens += route.prompt_tokens
        first = self._request(flow)
        first.handoff_at = 1  # as engine.make_request(handoff_after=1) on the prefill worker
        prefill.scheduler.add_request(first)
        self._kick(prefill)

    def _generate(self, flow: _Flow, decode: _Replica, prefill_tokens: int) -> None:
        """The decode worker's Generate call: counted in flight there until it ends."""
        flow.decode, flow.counted, flow.generating = decode, prefill_tokens, True
        decode.inflight += 1
        decode.inflight_tokens += prefill_tokens

    def _request(self, flow: _Flow) -> Request:
        n = flow.req.output_len
        params = self._params.get(n)
        if params is None:
            params = self._params[n] = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        return Request(str(flow.req.index), flow.req.prompt, params, arrival_time=flow.req.arrival)

    # ---- steps and tokens ----------------------------------------------------------------------

    def _kick(self, replica: _Replica) -> None:
        """Start the replica's next step if it is free and has work."""
        if replica.stepping or replica.state == "stopped":
            return
        batch = replica.decode_only() if self.config.fast_decode else None
        if batch is not None and not replica.admitting:
            run = replica.begin_run(batch, self.profile, self.now, self.index is not None)
            if run is not None:
                run.flows = [self.flows[r.request_id] for r in run.batch]
                self._at(run.ends[-1], self._run_end, (replica, run))
                return
        begun = replica.begin_step(self.profile, batch,
                                   self._export_s if replica.role == "prefill" and self._exports_cost else None)
        if begun is not None:
            self._at(self.now + begun[1], self._step_end, (replica, begun[0]))
        elif replica.state == "draining" and replica.idle:
            self._stop(replica)

    def _export_s(self, scheduled) -> float:
        """What a prefill worker's step takes beyond the profile's step for shipping its KV
        (``TransferModel``). A step ships the tokens it computes that the request's decode worker lacks,
        its first chunk also those the prefill worker had cached (its own prefix hit); the exporter ships
        whole blocks as they complete: over the prompt, the same tokens."""
        tokens = 0
        for item in scheduled:
            request = item.request
            prompt = request.num_prompt_tokens
            skip = prompt - self.flows[request.request_id].uncached  # the decode worker's hit: never shipped
            first = 0 if item.start <= request.num_cached_tokens else item.start
            tokens += max(0, min(item.start + item.num_tokens, prompt) - max(first, skip))
        return self.profile.export_step_s(tokens, self.config.transfer_backend)

    def _step_end(self, arg) -> None:
        replica, out = arg
        outputs = replica.end_step(out, self.now)
        if replica.role == "prefill":
            for request, _ in outputs:
                self._first_token_from_prefill(replica, request)
        else:
            self._tokens(replica, outputs)
        self._publish(replica)
        self._kick(replica)

    def _tokens(self, decode: _Replica, outputs: list[tuple[Request, bool]]) -> None:
        """A decode worker's step's tokens, each as ``_token`` records it; with compact records, the
        tokens that neither start nor end their request and follow a token of the same time share one
        gap run (a step's batch mostly does)."""
        if self.itl_runs is None:
            for request, finished in outputs:
                self._token(decode, request, finished)
            return
        flows, now = self.flows, self.now
        last, count = None, 0
        for request, finished in outputs:
            flow = flows[request.request_id]
            record = flow.record
            if finished or record.ttft is None:
                self._token(decode, request, finished)
                continue
            if flow.last != last:
                if count:
                    self._itl_run(now - last, count)
                last, count = flow.last, 0
            count += 1
            flow.last = now
            record.output_tokens += 1
        if count:
            self._itl_run(now - last, count)

    def _run_end(self, arg) -> None:
        """A run's last step ends (a request reaches its length): the steps before it into the records,
        then the step's end as any step's."""
        replica, run = arg
        if replica.run is not run:  # broken off by an outside call (_break)
            return
        if len(run.ends) < run.steps:  # the last step timed so far ended: time the next ones
            replica.extend_run(self.profile)
            self._at(run.ends[-1], self._run_end, arg)
            return
        self._end_run(replica)
        self._step_end((replica, (run.batch, None)))

    def _break(self, replica: _Replica) -> None:
        """Before a call that changes the replica's requests or blocks: its run (if any) stops here, and
        the step under way ends on its own, as the scheduler's path would end it."""
        if replica.run is not None:
            run = self._end_run(replica)
            self._at(run.ends[run.begun - 1], self._step_end, (replica, (run.batch, None)))

    def _end_run(self, replica: _Replica) -> _Run:
        replica.advance(self.now)
        run = replica.end_run()
        self._record_run(run)
        return run

    def _record_run(self, run: _Run) -> None:
        """The tokens of the run's ended steps into the records, as ``_record_token`` records each. From
        its second step on, every request's gap is the step's."""
        flows, ends = run.flows, run.ends
        first = run.recorded
        if first == 0 and run.ended > 0:
            for flow in flows:
                self._record_token(flow, ends[0])
            first = 1
        if first >= run.ended:
            run.recorded = run.ended
            return
        size = len(flows)
        for j in range(first, run.ended):
            gap = ends[j] - ends[j - 1]
            if self.itl_runs is None:
                for flow in flows:
                    flow.record.itl.append(gap)
            else:
                self._itl_run(gap, size)
        last, count = ends[run.ended - 1], run.ended - first
        for flow in flows:
            flow.record.output_tokens += count
            flow.last = last
        run.recorded = run.ended

    def _first_token_from_prefill(self, prefill: _Replica, request: Request) -> None:
        flow = self.flows[request.request_id]
        prefill.inflight -= 1
        prefill.inflight_tokens -= len(flow.req.prompt)
        prefill.finished += 1
        self.ttft.observe(self.now - flow.req.arrival)  # approximately the prefill worker's own part
        flow.record.cached_tokens = request.num_cached_tokens  # the prefill worker's hit, as its usage says
        self._record_token(flow)
        if request.status is not RequestStatus.FINISHED_HANDOFF:  # its only token: release the reservation
            self._break(flow.decode)
            flow.decode.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            self._finish(flow)
            return
        self._generate(flow, flow.decode, 0)
        self._at(self.now + self.profile.transfer_s(flow.uncached, self.config.transfer_backend),
                 self._kv_landed, flow)

    def _kv_landed(self, flow: _Flow) -> None:
        decode = flow.decode
        self._break(decode)
        decode.scheduler.finish_remote_kv(str(flow.req.index), True)
        decode.scheduler.requests[str(flow.req.index)].add_prior_outputs([TOKEN], 0)
        self._publish(decode)
        self._kick(decode)

    def _token(self, decode: _Replica, request: Request, finished: bool) -> None:
        flow = self.flows[request.request_id]
        if flow.record.ttft is None:
            decode.inflight_tokens -= flow.counted
            if flow.record.cached_tokens is None:  # prefilled here (colocated): this worker's prefix hit
                flow.record.cached_tokens = request.num_cached_tokens
        self._record_token(flow)
        if finished:
            decode.finished += 1
            if flow.record.output_tokens > 1:
                record = flow.record
                self.tpot.observe((flow.last - record.start - record.ttft) / (record.output_tokens - 1))
            self._finish(flow)

    def _record_token(self, flow: _Flow, now: float | None = None) -> None:
        now = self.now if now is None else now
        record = flow.record
        if record.ttft is None:
            record.ttft = now - record.start
        elif self.itl_runs is None:
            record.itl.append(now - flow.last)
        else:
            self._itl_run(now - flow.last, 1)
        flow.last = now
        record.output_tokens += 1

    def _itl_run(self, gap: float, count: int) -> None:
        """``count`` tokens' gap into the compact records: a run of equal gaps (a step's batch shares
        one) is one entry."""
        gaps, counts = self.itl_runs
        if gaps and gaps[-1] == gap:
            counts[-1] += count
        else:
            gaps.append(gap)
            counts.append(count)

    def _finish(self, flow: _Flow) -> None:
        record = flow.record
        record.ok, record.latency = True, self.now - record.start
        record.stream_chunks = record.usage_tokens = record.output_tokens
        if flow.generating:
            flow.decode.inflight -= 1
        del self.flows[str(flow.req.index)]
        self.done += 1

    def _publish(self, replica: _Replica) -> None:
        """The replica's KV events into the global prefix index (as index_feed.py applies them)."""
        if self.index is None or replica.state != "ready":  # a draining one is out of the index
            return
        events = replica.kv.pool.events
        for e in events.drain():
            record = KVEventRecord(replica.worker_id, e.kind, tuple(h.hex() for h in e.block_hashes), events.epoch,
                                   e.seq)
            if self.index.apply(record) == "resync":
                self._resync(replica)

    def _resync(self, replica: _Replica) -> None:
        if self.index.begin_resync(replica.worker_id):  # False past the index's 64 workers: not indexed
            snap = replica.kv.pool.snapshot()
            keys = keys_of_packed(b"".join(snap.block_hashes))
            self.index.finish_resync(replica.worker_id, snap.epoch, snap.seq, keys)

    # ---- replicas and autoscaling --------------------------------------------------------------

    def _asked(self, role: str) -> list[_Replica]:
        """The pool's replicas serving or starting: what the autoscaler has asked for."""
        return [w for w in self.pools[role] if w.state in ("starting", "ready")]

    def _routable(self, role: str) -> list[_Replica]:
        """The pool's replicas in rotation (kept until a replica's state changes: ``_mark``)."""
        rotation = self._rotation.get(role)
        if rotation is None:
            rotation = self._rotation[role] = [w for w in self.pools[role] if w.state == "ready"]
        return rotation

    def _load(self, replica: _Replica) -> WorkerLoad:
        return replica.load(self.now, self.config.poll_interval_s)

    def _add_replica(self, role: str) -> _Replica:
        replica = _Replica(f"{role}-{len(self.pools[role])}", role, self.config, self.fingerprint, self.now)
        self.pools[role].append(replica)
        self.replicas.append(replica)
        self.by_id[replica.worker_id] = replica
        return replica

    def _ready(self, replica: _Replica) -> None:
        if replica.state != "starting":  # removed while it started
            return
        replica.state, replica.stats.ready = "ready", self.now
        replica.kv.pool.events.drain()
        if self.index is not None:
            self._resync(replica)
        self._mark(replica.role)
        if replica.role == "decode":
            while self.waiting_for_decode:
                self._dispatch(self.waiting_for_decode.popleft())

    def _stop(self, replica: _Replica) -> None:
        replica.state, replica.stats.stopped = "stopped", self.now
        self._mark(replica.role)

    def _mark(self, role: str) -> None:
        self._rotation.pop(role, None)
        index = self._indexes.pop(role, None)
        if index is not None:
            index.close()
        pool = self.pools[role]
        point = (self.now, sum(w.state == "ready" for w in pool), len(self._asked(role)))
        line = self.timeline[role]
        if line and line[-1][0] == self.now:
            line[-1] = point
        elif not line or line[-1][1:] != point[1:]:
            line.append(point)

    def _tick(self, _=None) -> None:
        for role, scaler in self.scalers.items():
            decision = scaler.decide(self._signals(role), self.now)
            self._resize(role, decision.desired)
        self.woken_prefill = False
        if self.done < len(self.requests) and (len(self._heap) or self.waiting_for_decode):
            self._at(self.now + self.config.autoscale_interval_s, self._tick)
        elif self.done == len(self.requests) and self.config.settle_s:  # the load is over: scaling down
            if self._settle_until is None:
                self._settle_until = self.now + self.config.settle_s
            if self.now < self._settle_until:
                self._at(self.now + self.config.autoscale_interval_s, self._tick)

    def _signals(self, role: str) -> PoolSignals:
        """The pool's signals, as cluster/ray_app.py builds them from what its replicas report."""
        asked = self._asked(role)
        ready = [w for w in asked if w.state == "ready"]
        queued = running = 0
        usage = 0.0
        for w in ready:
            w.advance(self.now)
            s = w.scheduler
            served = w.finished > self._finished_seen.get(w.worker_id, 0)
            self._finished_seen[w.worker_id] = w.finished
            sample = (sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
                      max(s.num_running + s.num_waiting, 1 if served else 0), w.kv.usage)
            q, r, u = self._looked_back(w, sample) if self.config.look_back_s else sample
            queued += q
            running += r
            usage += u
        if self.config.look_back_s:  # Serve's averages: cluster/ray_app.py rounds the pool's totals up
            queued, running = math.ceil(queued - 1e-9), math.ceil(running - 1e-9)
        ttft, tpot = self.ttft.quantile(0.9), self.tpot.quantile(0.9)
        waiting = len(self.waiting_for_decode) if role == "decode" else int(self.woken_prefill)
        return PoolSignals(len(asked), queued, running, usage / max(len(ready), 1),
                           None if ttft is None else 1000 * ttft, None if tpot is None else 1000 * tpot,
                           waiting if not ready else 0)

    def _looked_back(self, w: _Replica, sample: tuple) -> tuple:
        """``sample`` (the replica's numbers now) kept, and the time-weighted mean of those taken within
        the look-back, each held until the next and the last until now (Ray Serve's
        ``time_weighted_average`` over a replica's report; its floor of 1 ms for the last)."""
        samples = self._samples.setdefault(w.worker_id, deque())
        samples.append((self.now, sample))
        while samples[0][0] < self.now - self.config.look_back_s - 1e-9:
            samples.popleft()
        times = [t for t, _ in samples]
        held = [b - a for a, b in zip(times, times[1:])] + [max(self.now - times[-1], 1e-3)]
        weight = sum(held)
        return tuple(sum(values[k] * h for (_, values), h in zip(samples, held)) / weight
                     for k in range(len(sample)))

    def _resize(self, role: str, desired: int) -> None:
        asked = self._asked(role)
        for _ in range(desired - len(asked)):
            self._at(self.now + self.config.startup_s, self._ready, self._add_replica(role))
        for w in sorted(asked, key=lambda w: (w.state == "ready", -w.stats.started))[:max(len(asked) - desired, 0)]:
            if w.state == "starting":
                w.state, w.stats.stopped = "stopped", self.now
                continue
            w.state = "draining"  # out of rotation; finishes what it holds, then stops
            if self.index is not None:
                self.index.drop_worker(w.worker_id)
            if w.idle:
                self._stop(w)
        self._mark(role)

    def _count(self, where: str) -> None:
        self.decisions[where] = self.decisions.get(where, 0) + 1
