"""``pdserve plan``: the cheapest cluster that meets a workload's SLOs, searched on the simulator.

    found = plan(requests, SLO(ttft_ms=500, tpot_ms=50), [Option("h100", profile, cost=4.0)])
    found.candidates[0]                   # the cheapest configuration meeting the target, if any did
    write_yaml(found.candidates[0], option, slo, "cluster.yaml")

Each hardware option (a profile, its cost per replica-hour, the cluster's engine and router settings)
is searched on its own:

    colocated:      the smallest d (decode replicas that prefill their own prompts) that meets the target
    disaggregated:  for p = 1, 2, ... prefill replicas, the smallest d that meets it with them

Attainment is the bench's (metrics.py): the share of requests meeting every SLO; a configuration
*meets* when that share reaches ``target``. It is (nearly) monotone in replicas, so each smallest d is
found by doubling from 1 until one meets, then bisecting; more prefill replicas never need more decode
replicas, so the previous p's answer bounds the next p's search. The disaggregated walk stops when p
alone (with one decode replica) costs more than the cheapest configuration found, when a prefill
replica more saves no decode replica, or (nothing meeting yet) raises the attainment of the largest
configuration no further (the returns of prefill capacity only diminish: a heuristic), when d
reaches 1, or at ``max_replicas``. Every simulated configuration is kept, those that missed too.

The workload is simulated as given up to ``max_requests``; past that, its first ``max_requests`` arrivals
(a window of the same arrival process, so the rate is kept) stand for it, and the plan says so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pdserve.bench.latency_model import Profile
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.sim import SimConfig, SimRequest, simulate
from pdserve.configs import ConfigError


@dataclass(frozen=True)
class Option:
    """One kind of replica to plan with."""

    name: str
    profile: Profile
    cost: float = 1.0  # per replica-hour (any unit; the same for every option)
    config: SimConfig = SimConfig()  # engine limits, router, transfer backend; pool sizes are the plan's


@dataclass(frozen=True)
class Candidate:
    """One simulated configuration and what the simulation predicts for it."""

    option: str
    kind: str  # the profile's: measured | modelled
    prefill: int  # 0: colocated
    decode: int
    cost: float  # per hour: replicas x the option's cost
    attainment: float  # share of requests meeting every SLO
    meets: bool  # attainment >= the target
    goodput: float  # requests/s meeting every SLO
    ttft_ms: dict[str, float]  # the bench's stats: mean, median, p90, p99, max
    tpot_ms: dict[str, float]
    failed: int  # requests that did not finish (never served)
    running_per_decode: float  # mean requests on a decode replica (Little's law over the records)

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode

    @property
    def mode(self) -> str:
        return f"colocated, {self.decode} decode" if not self.prefill else \
            f"{self.prefill} prefill + {self.decode} decode"


@dataclass
class Plan:
    candidates: list[Candidate]  # best first: those meeting the target by cost, then the rest by cost
    target: float
    simulated_requests: int
    total_requests: int
    evaluations: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def meeting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.meets]


def plan(requests: list[SimRequest], slo: SLO, options: list[Option], target: float = 0.9, max_replicas: int = 16,
         max_requests: int = 2000) -> Plan:
    """Search every option's colocated and disaggregated pool sizes; see the module's docstring."""
    if slo is None or (slo.ttft_ms is None and slo.tpot_ms is None):
        raise ConfigError("--goodput: a plan needs at least one SLO, e.g. --goodput ttft:500 tpot:50")
    if not 0 < target <= 1:
        raise ConfigError(f"--target: must be in (0, 1], got {target}")
    if max_replicas < 1:
        raise ConfigError(f"--max-replicas: must be at least 1, got {max_replicas}")
    if not options:
        raise ConfigError("--profile/--roofline: give at least one profile to plan with")
    if not requests:
        raise ConfigError("--num-prompts: the workload is empty")
    simulated = sorted(requests, key=lambda r: r.arrival)[:max_requests]
    out = Plan([], target, len(simulated), len(requests))
    if len(simulated) < len(requests):
        out.notes.append(f"simulated the first {len(simulated)} of {len(requests)} requests (by arrival)")
    for option in options:
        search = _Search(option, simulated, slo, target, max_replicas)
        search.run()
        out.candidates += search.seen.values()
        out.evaluations += len(search.seen)
    out.candidates.sort(key=lambda c: (not c.meets, c.cost, -c.attainment, c.replicas, c.option))
    return out


def evaluate(option: Option, prefill: int, decode: int, requests: list[SimRequest], slo: SLO,
             target: float) -> Candidate:
    """Simulate one configuration (fixed pool sizes: the base's autoscaling is left out)."""
    config = dataclasses.replace(option.config, prefill_replicas=prefill, decode_replicas=decode, autoscaling={})
    result = simulate(config, option.profile, requests)
    summary = summarize(result.records, result.duration_s, slo)
    attainment = summary.slo_attainment
    # Little's law: mean requests held = the sum of their times held / the span. A decode replica
    # holds a request from its first token when another worker prefilled it (approximately: a prompt
    # routed locally is held from its arrival), from its arrival when colocated.
    held = sum(r.latency - (r.ttft if prefill else 0.0) for r in result.records if r.ok)
    return Candidate(option.name, option.profile.kind, prefill, decode, (prefill + decode) * option.cost, attainment,
                     attainment >= target, summary.goodput or 0.0, summary.ttft_ms, summary.tpot_ms, summary.failed,
                     held / max(result.duration_s, 1e-9) / decode)


class _Search:
    """One option's search; ``seen`` holds every configuration simulated, by (prefill, decode)."""

    def __init__(self, option: Option, requests: list[SimRequest], slo: SLO, target: float, max_replicas: int):
        self.option, self.requests, self.slo, self.target, self.max = option, requests, slo, target, max_replicas
        self.seen: dict[tuple[int, int], Candidate] = {}

    def meets(self, prefill: int, decode: int) -> bool:
        key = (prefill, decode)
        if key not in self.seen:
            self.seen[key] = evaluate(self.option, prefill, decode, self.requests, self.slo, self.target)
        return self.seen[key].meets

    def smallest_decode(self, prefill: int, hi: int) -> int | None:
        """The fewest decode replicas in [1, hi] meeting the target with ``prefill`` (None: not even hi)."""
        if hi < 1:
            return None
        failed, d = 0, 1  # failed: the largest count known to miss
        while not self.meets(prefill, d):
            if d == hi:
                return None
            failed, d = d, min(2 * d, hi)
        while d - failed > 1:
            mid = (failed + d) // 2
            if self.meets(prefill, mid):
                d = mid
            else:
                failed = mid
        return d

    def run(self) -> None:
        colocated = self.smallest_decode(0, self.max)
        best = colocated if colocated is not None else math.inf  # fewest replicas meeting so far
        hi, previous = self.max - 1, None
        largest = self.seen[(0, self.max)].attainment if colocated is None else 1.0
        for p in range(1, self.max):
            if p + 1 > best:  # with one decode replica, dearer than the best already
                break
            d = self.smallest_decode(p, min(hi, self.max - p))
            if d is None:  # even the most decode replicas missed: go on while prefill replicas help
                top = self.seen[(p, min(hi, self.max - p))].attainment
                if top <= largest:
                    break
                largest = top
                continue
            best = min(best, p + d)
            if d == 1 or d == previous:  # nothing left to save, or this prefill replica saved nothing
                break
            hi, previous = d, d


# ---- the cluster file --------------------------------------------------------------------------------


def autoscaling(c: Candidate, option: Option, slo: SLO, headroom: float = 2.0) -> dict[str, dict]:
    """Each pool's autoscaling section for candidate ``c``, from the same model that chose it.

    - bounds: ``min_replicas`` the planned count (the plan's load needs it), ``max_replicas`` that
      times ``headroom`` (2, or the peak rate over the planned rate: replicas scale with the load);
    - decode ``target_running_requests``: the simulated mean requests per decode replica at the planned
      load, rounded up (within ``max_num_seqs``); at that load the pool's running requests then ask for
      at most the planned count, and a load k times higher for about k times as many;
    - prefill ``target_queued_prompt_tokens``: the prompt tokens one replica computes in half the TTFT
      SLO (the profile's prefill rate), so a prompt behind a full queue still has half the SLO for itself;
    - ``tpot_slo_ms`` / ``ttft_slo_ms``: the plan's SLOs (the autoscaler reads them as p90s).
    """
    def bounds(n: int) -> dict:
        return {"min_replicas": n, "max_replicas": max(n, math.ceil(n * headroom))}

    decode = {**bounds(c.decode), "target_running_requests": min(max(1, math.ceil(c.running_per_decode)),
                                                                 option.config.max_num_seqs)}
    if slo.tpot_ms is not None:
        decode["tpot_slo_ms"] = slo.tpot_ms
    out = {"decode": decode}
    if c.prefill:
        prefill = bounds(c.prefill)
        if slo.ttft_ms is not None:
            rate = option.profile.cost_model(option.config.transfer_backend).prefill_tokens_per_s
            prefill["target_queued_prompt_tokens"] = max(1, int(rate * slo.ttft_ms / 2000))
            prefill["ttft_slo_ms"] = slo.ttft_ms
        out["prefill"] = prefill
    return out


def cluster_yaml(c: Candidate, option: Option, slo: SLO, base: dict | None = None, headroom: float = 2.0) -> dict:
    """The cluster file ``base`` (a parsed ``--config``, or defaults) with the candidate's pools and their
    autoscaling (left out with ``launcher: processes``, which has no autoscaler), validated as
    ``pdserve serve`` validates it; a ConfigError when it does not validate."""
    from pdserve.cluster.config import load_serve_config, merge

    data = dict(base or {})
    scaled = data.get("launcher", "ray") == "ray"
    sections = autoscaling(c, option, slo, headroom) if scaled else {}
    pools = {"prefill": {"replicas": c.prefill, "autoscaling": sections.get("prefill")},
             "decode": {"replicas": c.decode, "autoscaling": sections.get("decode")}}
    models = data.get("models")
    if models:
        if not isinstance(models, dict) or len(models) != 1:
            raise ConfigError("--config: a plan is for one model; the file serves several")
        name = next(iter(models))
        data["models"] = {name: merge(models[name] or {}, {"pools": pools})}
    else:
        data = merge(data, {"pools": pools})
    load_serve_config(None, data)  # raises, naming the key, when the file would not serve
    return data


def write_yaml(c: Candidate, option: Option, slo: SLO, path: str | Path, base: dict | None = None,
               headroom: float = 2.0, header: str = "") -> Path:
    """Write ``cluster_yaml(...)`` to ``path`` (after validating it), with ``header`` as comments."""
    data = cluster_yaml(c, option, slo, base, headroom)
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    path = Path(path)
    path.write_text(comments + yaml.safe_dump(data, sort_keys=False))
    return path
