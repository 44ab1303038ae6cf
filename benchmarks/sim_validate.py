"""Validate `pdserve sim` against real runs: pd_goodput.py's experiment, or the prefix-routing one, run and
simulated.

    python benchmarks/sim_validate.py                    # about 12 minutes on 2 cores
    python benchmarks/sim_validate.py --profile bench-results/sim_validate_profile.json \\
        --slo-ttft-ms 35900 --slo-tpot-ms 93.5           # reuse a profile and fixed SLOs: about 8 minutes
    python benchmarks/sim_validate.py --experiment prefix --rates 0.2,0.3,0.4 --num-prompts 48 \\
        --slo-ttft-ms 3000 --slo-tpot-ms 100             # cache-aware and least-loaded routing: ~21 minutes
    python benchmarks/sim_validate.py --resimulate docs/bench/sim_validate/prefix_48_epyc.json \\
        [--profile P.json]                               # a recorded run simulated again (seconds)

1. A latency profile of the engine as the workers run it (one thread, the same model and step
   budget): measured here through the profile library (`pdserve profile --threads 1`), or --profile;
   then a request's time outside engine steps, measured through a one-worker cluster as `pdserve profile
   --serving-url` measures it (unless --profile has one, or --no-request-overhead).
2. SLOs as pd_goodput.py derives them (unloaded figures of one worker on one core), or fixed ones.
3. For each mode (colocated: two decode workers; disaggregated: one prefill and one decode worker;
   each pinned to one core) the real cluster of pd_goodput.py serves its Poisson workload at each
   rate, through the bench library; the simulator serves the same requests (the bench's own
   workload and arrival times: same seed, prompts, lengths, the warm-up request) on a SimConfig of
   the same cluster (pools, the router's policy and cost model as pd_goodput's router runs them,
   the workers' engine limits and KV cache, the grpc transfer model of the profile).
4. A table per mode and rate: TTFT and TPOT p50/p90, SLO attainment and the prefix cache's hit rate
   (cached prompt tokens over prompt tokens, as the server's usage reports them), measured, simulated
   and the error; goodput (the highest rate with >= 90% attainment) measured against simulated. JSON
   of it all in --result-dir.

``--experiment prefix`` (issue 17's prefix-routing validation): the colocated cluster of step 3 (two
decode workers, one core each), once per router policy (``--policies``, by default cache_aware and
least_loaded), each worker's KV cache cut to ``--num-kv-blocks`` so that the workload's shared prefixes
do not all fit one worker; the bench's prefix workload (``--prefix-num`` prefixes of ``--prefix-len``
tokens, each request one of them plus ``--suffix-len`` random tokens, ``--output-len`` tokens out), a
fresh seed per rate as above. The simulator runs the same policy over a prefix index fed by its
replicas' KV events.

``--resimulate JSON``: no cluster; the requests of a recorded run (its JSON: the workload's flags and
seeds rebuild them) simulated again, with the run's own profile or ``--profile``, against the run's
measured figures: what a change to the simulator or another profile does to the errors.

A speed probe (``--no-speed-probe`` skips it) measures the machine against the profile before each run and
after the last: a 1,024-token prompt and 16 decode steps on an engine of the profile's, their seconds
over the profile's prediction. A shared host's speed drifts by several percent over minutes; each run
is simulated again with the profile at the mean of the probes around it, and both errors are printed:
the first is the validation, the second shows how much of it the machine's drift explains.

Each worker writes its engine's steps to a trace (``--step-trace``, in --result-dir/traces): each run
then prints how long the workers' own steps took against the profile's prediction for the same steps, and
at the end every run is simulated once more with a profile fitted to the steps the workers ran in all the
*other* runs (`pdserve profile --from-trace`'s fit; leave one out): the error left when the simulator
runs at the speed the engine has in this cluster (beside its router, the bench client and the other
worker on two cores) rather than alone. With it, each measured figure's 90% bootstrap interval (the cell's
requests drawn again with replacement): how uncertain the figure is by itself, from a few dozen requests;
the cells within 10% or inside that interval are counted too.

``--decisions``: every routing decision logged, the real router's and the simulator's, as the same
line (``pdserve.router.cost.describe_pick``), to see where the simulated router decided otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pd_goodput  # noqa: E402  (its cluster: start/stop/pin, the model, the unloaded SLO figures)

from pdserve.bench.api import run_bench  # noqa: E402
from pdserve.bench.config import BenchConfig  # noqa: E402
from pdserve.bench.latency_model import Profile, StepModel  # noqa: E402
from pdserve.bench.metrics import SLO, Summary, goodput_rate  # noqa: E402
from pdserve.bench.report import inf_as_text  # noqa: E402
from pdserve.bench.sim import SimConfig, SimRequest, simulate  # noqa: E402
from pdserve.bench.sim_cli import requests_from_bench  # noqa: E402
from pdserve.cluster.config import load_serve_config  # noqa: E402
from pdserve.engine.cpu_isa import describe_cpu  # noqa: E402

MODES = pd_goodput.MODES
# The workers' flags in pd_goodput.start, as a cluster file's engine section; its router gets only
# start_router's --poll-interval-s 0.2 (and an admission limit the workload never reaches).
WORKER_ENGINE = {"model": pd_goodput.MODEL, "kv_cache_memory_gb": 1.0, "num_threads": 1}
ROUTER = {"poll_interval_s": 0.2}
METRICS = [("TTFT p50 (ms)", "ttft_ms", "median"), ("TTFT p90 (ms)", "ttft_ms", "p90"),
           ("TPOT p50 (ms)", "tpot_ms", "median"), ("TPOT p90 (ms)", "tpot_ms", "p90")]
PERCENTS = ("SLO attainment (%)", "Prefix hit (%)")  # errors in percentage points


@dataclasses.dataclass(frozen=True)
class Setup:
    """One cluster the experiment runs and simulates: the workers' roles, the router's policy (None: its
    default) and the workers' KV blocks (None: ``WORKER_ENGINE``'s memory)."""

    name: str
    roles: tuple[str, ...]
    policy: str | None = None
    num_kv_blocks: int | None = None

    def router_flags(self) -> list[str]:
        return [] if self.policy is None else ["--policy", self.policy]

    def worker_flags(self) -> list[str]:
        return [] if self.num_kv_blocks is None else ["--num-kv-blocks", str(self.num_kv_blocks)]


def setups(args) -> list[Setup]:
    if args.experiment == "pd":
        return [Setup(mode, tuple(MODES[mode])) for mode in args.modes.split(",")]
    return [Setup(policy, tuple(MODES["colocated"]), policy, args.num_kv_blocks) for policy in args.policies.split(",")]


def workload(url: str, rate: float, i: int, args) -> BenchConfig:
    """The ``i``-th rate's workload: pd_goodput's, or the prefix experiment's (a fresh seed per rate too)."""
    if args.experiment == "pd":
        return pd_goodput.workload(url, args.num_prompts, rate, args.seed, i)
    return BenchConfig(base_url=url, progress=False, dataset_name="prefix", prefix_num=args.prefix_num,
                       prefix_len=args.prefix_len, suffix_len=args.suffix_len, random_output_len=args.output_len,
                       num_prompts=args.num_prompts, request_rate=rate, seed=args.seed + 1000 * (i + 1),
                       warmup_requests=1)


def get_profile(args) -> Profile:
    """``--profile``, or one measured here as the workers run the engine: one thread, their model and budget."""
    if args.profile:
        return Profile.load(args.profile)
    from pdserve.bench.profile import ProfileConfig, measure

    engine = load_serve_config(None, {"engine": WORKER_ENGINE}).served()[0].engine
    config = ProfileConfig(model=engine.model, dtype=engine.dtype, threads=engine.num_threads,
                           max_seconds=args.profile_seconds, max_num_batched_tokens=engine.max_num_batched_tokens,
                           transfer_backends="grpc", seed=args.seed)
    profile, _ = measure(config, progress=False)
    path = Path(args.result_dir) / "sim_validate_profile.json"
    profile.save(path)
    print(f"wrote {path}")
    return profile


def request_overhead(profile: Profile, args) -> Profile:
    """The profile with a request's time outside engine steps (`pdserve profile --serving-url`'s
    measurement) measured through a cluster of one worker pinned to one core, as the runs' workers are."""
    from pdserve.bench.profile import with_request_overhead

    with pd_goodput.cluster(["decode"]) as url:
        profile = with_request_overhead(profile, url, seed=args.seed)
    path = Path(args.result_dir) / "sim_validate_profile.json"
    profile.save(path)
    print(f"a request outside engine steps: {1e3 * profile.request_overhead_s:.1f} ms (rewrote {path})")
    return profile


class SpeedProbe:
    """How fast this machine computes now, against the profile: a 1,024-token prompt's step and 16 decode
    steps of one 512-token sequence on an engine of the profile's (one thread, pinned to the first core,
    which is idle between runs), their seconds over the profile's prediction for the same steps. Measured
    before each run and after the last, to tell the machine's own drift (a shared host's speed varies
    by several percent over minutes) from what the simulator leaves out."""

    WAVES = (("prefill", (1024,), 1), ("decode", (512,), 16))

    def __init__(self, seed: int = 0):
        from pdserve.bench.profile import ProfileConfig, build_engine

        engine = load_serve_config(None, {"engine": WORKER_ENGINE}).served()[0].engine
        config = ProfileConfig(model=engine.model, dtype=engine.dtype, threads=engine.num_threads,
                               max_num_batched_tokens=engine.max_num_batched_tokens, quick=True, seed=seed)
        self.engine = build_engine(config)[0]
        self.seed = seed

    def measure(self, profile: Profile) -> float:
        """Measured over predicted seconds of the probe's steps (1.07: 7% slower than the profile)."""
        import os

        from pdserve.bench.profile import StepDriver, Wave

        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(allowed)})  # this thread only: the bench client's loop runs elsewhere later
        try:
            driver = StepDriver(self.engine, self.seed)
            for kind, prompts, max_tokens in self.WAVES:
                driver.run(Wave(kind, prompts, max_tokens))
        finally:
            os.sched_setaffinity(0, allowed)
        return sum(s.seconds for s in driver.samples) / sum(profile.step_s(s.features) for s in driver.samples)


def at_speed(profile: Profile, factor: float) -> Profile:
    """The profile with every step ``factor`` times as long (transfers as they were)."""
    return dataclasses.replace(profile, step=StepModel(*(c * factor for c in dataclasses.astuple(profile.step))))


def get_slo(args) -> tuple[SLO, dict | None]:
    """Fixed SLOs from the flags, or pd_goodput's: 5x the unloaded TTFT of a 2048-token prompt, 2x the TPOT."""
    if args.slo_ttft_ms and args.slo_tpot_ms:
        return SLO(args.slo_ttft_ms, args.slo_tpot_ms), None
    ttft0, tpot0 = pd_goodput.unloaded()
    return pd_goodput.slo_of(ttft0, tpot0), {"ttft_ms": ttft0, "tpot_ms": tpot0}


def sim_config(setup: Setup, profile: Profile) -> SimConfig:
    """pd_goodput's cluster as the simulator's: pools, engine limits and KV blocks of the workers' flags, the
    router's policy, thresholds, poll interval and its own cost model (RouterConfig's, not the profile's), and
    its recent routes kept until pushed out (a router without a state store keeps them so)."""
    roles = setup.roles
    pools = {"prefill": {"replicas": roles.count("prefill")}, "decode": {"replicas": roles.count("decode")}}
    engine = WORKER_ENGINE if setup.num_kv_blocks is None else {**WORKER_ENGINE, "num_kv_blocks": setup.num_kv_blocks}
    router = ROUTER if setup.policy is None else {**ROUTER, "policy": setup.policy}
    serve = load_serve_config(None, {"engine": engine, "router": router, "pools": pools})
    return SimConfig.from_serve(serve, profile, cost=serve.router.cost_model(), recent_routes_s=math.inf)


def run_simulated(config: SimConfig, profile: Profile, requests: list[SimRequest], slo: SLO):
    result = simulate(config, profile, requests)
    return result.summary(slo), result.decisions, result.records


def router_decisions(url: str) -> dict[str, int]:
    """The router's prefill decisions so far (its /metrics counter), by outcome."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = re.findall(r'^pdserve_router_prefill_decisions_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {k: int(float(v)) for k, v in found}


def run_real(setup: Setup, rates: list[float], slo: SLO, args, probe: SpeedProbe | None = None,
             profile: Profile | None = None) -> list[dict]:
    """pd_goodput.sweep's runs, keeping each rate's config, summary and records (and the router's decisions);
    with a ``probe``, the machine's speed against ``profile`` before each run and after the last. Each rate
    gets a cluster of its own, as each simulation starts with fresh replicas: a worker keeps what it measured
    (its prefill rate, its decode step), and a cluster kept from the last rate routed the next rate's first
    requests by those figures where the simulated router had the cost model's defaults."""
    runs, roles = [], list(setup.roles)
    traces = Path(args.result_dir) / "traces"
    for i, rate in enumerate(rates):
        speed = probe.measure(profile) if probe else None
        if runs and speed is not None:
            runs[-1]["speed"].append(speed)
        cell = f"{setup.name}-{rate:g}"
        for old in traces.glob(f"{cell}-*.jsonl"):
            old.unlink()
        trace_flags = ["--step-trace", str(traces / f"{cell}-{{pid}}.jsonl")]
        with pd_goodput.cluster(roles, setup.router_flags(), [*setup.worker_flags(), *trace_flags],
                                "DEBUG" if args.decisions else "WARNING") as url:
            config = workload(url, rate, i, args)
            before, started = router_decisions(url), time.perf_counter()
            run = asyncio.run(run_bench(config, slo)).runs[0]
            after = router_decisions(url)
            runs.append({"config": config, "rate": rate, "summary": run["summary"], "records": run["records"],
                         "seconds": time.perf_counter() - started, "speed": [] if speed is None else [speed],
                         "decisions": {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}})
        # written as the workers stop; kept relative to --result-dir, so a copied result dir resimulates
        runs[-1]["traces"] = sorted(str(p.relative_to(args.result_dir)) for p in traces.glob(f"{cell}-*.jsonl"))
        s = run["summary"]
        print(f"  {setup.name} @ {rate:g} req/s: {s.completed} done, {s.failed} failed, attainment "
              f"{100 * s.slo_attainment:.0f}%, {runs[-1]['seconds']:.0f} s"
              + (f"; machine speed before it {speed:.3f}x the profile's step times" if speed else ""), flush=True)
    if probe and runs:
        runs[-1]["speed"].append(probe.measure(profile))
    return runs


def figures(s: Summary) -> dict[str, float]:
    out = {label: getattr(s, key)[stat] for label, key, stat in METRICS}
    out["SLO attainment (%)"] = 100 * s.slo_attainment
    out["Prefix hit (%)"] = math.nan if s.prefix_hit_rate is None else 100 * s.prefix_hit_rate
    return out


def error(measured: float, simulated: float, label: str) -> float:
    """Relative error in %, or for a percentage (attainment, prefix hits) the difference in percentage points."""
    if label in PERCENTS:
        return simulated - measured
    return 100 * (simulated - measured) / measured if measured else math.nan


def print_errors(measured: dict[str, float], simulated: dict[str, float]) -> dict[str, float]:
    """Each metric's error, printed as a table row (measured, simulated, error); returns the errors."""
    errors = {k: error(measured[k], simulated[k], k) for k in measured}
    print("| metric | measured | simulated | error |\n|---|---|---|---|")
    for k in measured:
        unit = "pp" if k in PERCENTS else "%"
        print(f"| {k} | {measured[k]:.1f} | {simulated[k]:.1f} | {errors[k]:+.1f} {unit} |")
    return errors


def compare(mode: str, real: dict, sim: Summary, decisions: dict, tokenizer_check: int) -> dict:
    measured, simulated = figures(real["summary"]), figures(sim)
    print(f"\n{mode} @ {real['rate']:g} req/s ({real['summary'].completed} requests measured, "
          f"{real['seconds']:.0f} s; prefill decisions real {real['decisions'] or '-'}, simulated {decisions or '-'})")
    errors = print_errors(measured, simulated)
    return {"mode": mode, "rate": real["rate"], "seconds": real["seconds"], "measured": measured,
            "simulated": simulated, "errors": errors, "decisions": {"real": real["decisions"], "sim": decisions},
            "prompt_length_mismatches": tokenizer_check,
            "summaries": {"measured": real["summary"].to_dict(), "simulated": sim.to_dict()}}


def per_request(measured, simulated) -> list[dict]:
    """Each request's lengths, TTFT and TPOT (ms), measured and simulated: where an error comes from."""
    sim = {r.index: r for r in simulated}

    def ms(value):
        return None if value is None else round(1e3 * value, 1)

    return [{"index": r.index, "warmup": r.warmup, "input": r.input_tokens, "output": r.output_tokens,
             "start_s": round(r.start, 2), "ttft_ms": [ms(r.ttft), ms(sim[r.index].ttft)],
             "tpot_ms": [ms(r.tpot), ms(sim[r.index].tpot)],
             "cached": [r.cached_tokens, sim[r.index].cached_tokens]} for r in measured]


def prompt_mismatches(requests: list[SimRequest], records) -> int:
    """Requests whose prompt length the server reported differs from the simulated one (should be 0)."""
    by_index = {r.index: r for r in records}
    return sum(1 for q in requests if by_index[q.index].input_tokens != len(q.prompt))


def at_probe_speed(measured: dict[str, float], config: SimConfig, profile: Profile, requests, slo: SLO,
                   speed: list[float]) -> dict:
    """The run simulated again with the profile at the machine's speed around it (the mean of the probes
    before and after it): how much of the error the machine's drift explains. Printed and returned."""
    factor = sum(speed) / len(speed)
    simulated = figures(run_simulated(config, at_speed(profile, factor), requests, slo)[0])
    errors = {k: error(measured[k], simulated[k], k) for k in measured if k not in PERCENTS}
    print(f"with the profile at the machine's speed around the run (x{factor:.3f}, probes "
          + " / ".join(f"{x:.3f}" for x in speed) + "): "
          + ", ".join(f"{k.replace(' (ms)', '')} {e:+.1f}%" for k, e in errors.items()))
    return {"speed": speed, "factor": factor, "simulated": simulated, "errors": errors}


def trace_speeds(paths: list[str], profile: Profile, base: Path) -> dict[str, float]:
    """Each worker's steps in a run (its step trace; ``paths`` relative to ``base``, the result dir) against
    the profile: measured over predicted seconds, by the worker's role (a colocated pair: decode, decode#2).
    Printed."""
    from pdserve.bench.step_trace import read_trace, speed_against

    speeds: dict[str, float] = {}
    for path in paths:
        header, steps = read_trace(base / path)
        role = header.get("role", "?")
        name = role if role not in speeds else f"{role}#{sum(k.startswith(role) for k in speeds) + 1}"
        speeds[name] = speed_against(profile, steps)
    if speeds:
        print("the workers' own steps took " + ", ".join(f"{x:.3f}x ({k})" for k, x in speeds.items())
              + " the profile's time for them")
    return speeds


def measured_interval(requests: list[dict], label: str, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The measured figure's 90% bootstrap interval (``label`` one of METRICS' time figures): the run's
    requests (``per_request``'s, the warm-up left out) drawn again with replacement ``resamples`` times, the
    figure of each draw, their 5th and 95th percentiles. From a few dozen requests a percentile is uncertain
    by itself, and most where it sits at a cliff of its distribution (TTFT between the requests that hit a
    cached prefix and those that did not, with about half of each): there, a simulator that is right about
    every step still lands anywhere in the interval."""
    import numpy as np

    _, key, stat = next(m for m in METRICS if m[0] == label)  # key: per_request's column too
    values = np.array([r[key][0] for r in requests if not r["warmup"] and r[key][0] is not None])
    if len(values) < 2:
        return (math.nan, math.nan)
    draws = np.random.default_rng(seed).choice(values, size=(resamples, len(values)))
    of_draws = np.median(draws, axis=1) if stat == "median" else np.percentile(draws, 90, axis=1)
    return float(np.percentile(of_draws, 5)), float(np.percentile(of_draws, 95))


def cross_validate(results: dict, profile: Profile, slo: SLO, tokenizer, args, base: Path) -> dict[str, list[float]]:
    """Each run simulated again with a profile fitted to the steps the cluster's workers ran in every
    *other* run (their step traces; leave one out, so no run is simulated with its own steps): the error
    left when the simulator runs at the speed the engine has in this cluster, beside its router, client
    and the other worker, rather than alone. Adds ``from_traces`` to each row; returns the errors by metric.
    ``base``: the result dir the rows' trace paths are relative to."""
    from pdserve.bench.step_trace import profile_from_traces

    cells = [(setup, row) for setup in setups(args) for row in results[setup.name]["rows"]]
    errors: dict[str, list[float]] = {}
    print("\neach run simulated with a profile fitted to the workers' steps in the other runs (leave one out):")
    for i, (setup, row) in enumerate(cells):
        others = [base / p for j, (_, r) in enumerate(cells) if j != i for p in r["traces"]["paths"]]
        if not others:
            continue
        fitted, _ = profile_from_traces(others, profile, args.seed, args.trace_skip_s, "the run's profile")
        rate_index = [float(x) for x in args.rates.split(",")].index(row["rate"])
        requests = requests_from_bench(workload("http://unused", row["rate"], rate_index, args), row["rate"],
                                       tokenizer)
        simulated = figures(run_simulated(sim_config(setup, fitted), fitted, requests, slo)[0])
        errs = {k: error(row["measured"][k], simulated[k], k) for k in row["measured"] if k not in PERCENTS}
        intervals = {k: measured_interval(row["requests"], k, seed=args.seed) for k in errs}
        inside = {k: intervals[k][0] <= simulated[k] <= intervals[k][1] for k in errs}
        row["from_traces"] = {"simulated": simulated, "errors": errs, "steps": fitted.fit["samples"],
                              "speed": trace_speeds(row["traces"]["paths"], fitted, base),
                              "measured_interval_90": intervals, "inside_interval": inside}
        print(f"  {setup.name} @ {row['rate']:g} req/s: "
              + ", ".join(f"{k.replace(' (ms)', '')} {e:+.1f}%" for k, e in errs.items()))
        print("    measured 90% intervals: " + ", ".join(
            f"{k.replace(' (ms)', '')} {lo:.0f}-{hi:.0f}{'' if inside[k] else ' (simulated outside)'}"
            for k, (lo, hi) in intervals.items()))
        for k, e in errs.items():
            errors.setdefault(k, []).append(e)
            errors.setdefault(INSIDE + k, []).append(0.0 if inside[k] or abs(e) <= 10 else math.inf)
    return errors


def validate_setup(setup: Setup, rates: list[float], slo: SLO, profile: Profile, tokenizer, args,
                   probe: SpeedProbe | None = None) -> dict:
    mode = setup.name
    real_runs = run_real(setup, rates, slo, args, probe, profile)  # every real run first: then no core is shared
    config = sim_config(setup, profile)
    rows = []
    for real in real_runs:
        requests = requests_from_bench(real["config"], real["rate"], tokenizer)
        summary, decisions, records = run_simulated(config, profile, requests, slo)
        rows.append(compare(mode, real, summary, decisions, prompt_mismatches(requests, real["records"])))
        rows[-1]["requests"] = per_request(real["records"], records)
        if real["speed"]:
            rows[-1]["at_probe_speed"] = at_probe_speed(rows[-1]["measured"], config, profile, requests, slo,
                                                        real["speed"])
        rows[-1]["traces"] = {"paths": real["traces"],
                              "speed": trace_speeds(real["traces"], profile, Path(args.result_dir))}
    attained = [(r["measured"]["SLO attainment (%)"] / 100, r["simulated"]["SLO attainment (%)"] / 100) for r in rows]
    good_m = goodput_rate(rates, [a for a, _ in attained])
    good_s = goodput_rate(rates, [b for _, b in attained])
    err = 100 * (good_s - good_m) / good_m if good_m and good_s else None
    print(f"\n{mode} goodput (highest rate with >= 90% attainment): measured {good_m}, simulated {good_s}"
          + (f", error {err:+.0f}%" if err is not None else ""))
    sim_cfg = inf_as_text({k: v for k, v in dataclasses.asdict(config).items() if k != "cost"})
    return {"rows": rows, "goodput": {"measured": good_m, "simulated": good_s, "error_pct": err},
            "sim_config": sim_cfg, "cost_model": dataclasses.asdict(config.cost)}


def simulated_unloaded(profile: Profile) -> dict:
    """pd_goodput.unloaded's two requests, simulated on one decode worker: TTFT of 2048 tokens, TPOT at 512/128."""
    config = sim_config(Setup("unloaded", ("decode",)), profile)
    ttft = simulate(config, profile, [SimRequest(0, 0.0, list(range(100, 2148)), 1)]).records[0].ttft
    tpot = simulate(config, profile, [SimRequest(0, 0.0, list(range(100, 612)), 128)]).records[0].tpot
    return {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot}


def resimulate(path: str, profile_path: str | None) -> dict[str, list[float]]:
    """A recorded run's requests simulated again (``--resimulate``): the errors per cell and how many
    cells each metric has within 10%. Returns the errors by metric."""
    from pdserve.engine.tokenizer import load_tokenizer

    recorded = json.loads(Path(path).read_text())
    args = argparse.Namespace(**recorded["args"])
    profile = Profile.load(profile_path) if profile_path else Profile.from_json(recorded["profile"])
    slo = SLO(**recorded["slo"])
    tokenizer = load_tokenizer(BenchConfig(base_url="http://unused").tokenizer)
    rates = [float(x) for x in args.rates.split(",")]
    source = profile_path or "the run's own"
    print(f"{path}: measured on {recorded['cpu_flags']}; profile: {source}")
    errors: dict[str, list[float]] = {}
    at_speed_errors: dict[str, list[float]] = {}
    for setup in setups(args):
        config = sim_config(setup, profile)
        rows = {row["rate"]: row for row in recorded["modes"][setup.name]["rows"]}
        for i, rate in enumerate(rates):
            requests = requests_from_bench(workload("http://unused", rate, i, args), rate, tokenizer)
            simulated = figures(run_simulated(config, profile, requests, slo)[0])
            measured = rows[rate]["measured"]
            print(f"\n{setup.name} @ {rate:g} req/s")
            for k, e in print_errors(measured, simulated).items():
                errors.setdefault(k, []).append(e)
            if "at_probe_speed" in rows[rate] and not profile_path:  # the probes measured against the run's profile
                speed = rows[rate]["at_probe_speed"]["speed"]
                for k, e in at_probe_speed(measured, config, profile, requests, slo, speed)["errors"].items():
                    at_speed_errors.setdefault(k, []).append(e)
    base = Path(path).parent  # the rows' trace paths are relative to the recorded run's directory
    traced = [base / p for mode in recorded["modes"].values() for row in mode["rows"]
              for p in row.get("traces", {}).get("paths", [])]
    from_traces = {}
    if traced and all(p.exists() for p in traced):
        args.trace_skip_s = getattr(args, "trace_skip_s", 5.0)
        from_traces = cross_validate(recorded["modes"], profile, slo, tokenizer, args, base)
    print("\nwithin 10%: " + within(errors))
    if at_speed_errors:
        print("within 10% at the probes' speed: " + within(at_speed_errors))
    if from_traces:
        print("within 10% with profiles fitted to the workers' steps in the other runs: " + within(from_traces))
    return errors


INSIDE = "inside: "  # cross_validate's: 0 where a cell is within 10% or inside the measured 90% interval, else inf


def within(errors: dict[str, list[float]]) -> str:
    """'M n of N, ...' for each time metric; where cross_validate counted them, after a semicolon how many
    cells are within 10% or inside the measured figure's 90% bootstrap interval (``measured_interval``)."""
    def counts(keys, prefix=""):
        return ", ".join(f"{k} {sum(abs(e) <= 10 for e in errors[prefix + k])} of {len(errors[k])}" for k in keys)

    plain = [k for k in errors if k not in PERCENTS and not k.startswith(INSIDE)]
    inside = [k for k in plain if INSIDE + k in errors]
    return counts(plain) + (f"; within 10% or inside the measured 90% interval: {counts(inside, INSIDE)}"
                            if inside else "")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.1,0.2,0.3", help="request rates, comma-separated (default: 0.1,0.2,0.3)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="measured requests per rate, after one warm-up request (default: 8)")
    p.add_argument("--modes", default="colocated,disaggregated",
                   help="which clusters: colocated (two decode workers), disaggregated (one prefill, one decode), "
                        "comma-separated (default: both)")
    p.add_argument("--profile", default=None,
                   help="a latency profile (JSON) to simulate with, measured with --threads 1 on this machine "
                        "(default: measure one first, written to --result-dir)")
    p.add_argument("--profile-seconds", type=float, default=120.0,
                   help="without --profile: the profile's --max-seconds of engine steps (default: 120)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT SLO in ms; with --slo-tpot-ms, instead of pd_goodput's unloaded measurement "
                        "(default: 5x the unloaded TTFT of a 2048-token prompt)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT SLO in ms, with --slo-ttft-ms (default: 2x the unloaded TPOT)")
    p.add_argument("--experiment", choices=("pd", "prefix"), default="pd",
                   help="pd: pd_goodput's colocated and disaggregated clusters (--modes); prefix: the colocated "
                        "cluster under each of --policies on the prefix workload (default: pd)")
    p.add_argument("--policies", default="cache_aware,least_loaded",
                   help="prefix: the router policies, comma-separated (default: cache_aware,least_loaded)")
    p.add_argument("--num-kv-blocks", type=int, default=640,
                   help="prefix: each worker's KV blocks of 16 tokens (default: 640, room for about half of "
                        "the default workload's prefixes)")
    p.add_argument("--prefix-num", type=int, default=12, help="prefix: shared prefixes (default: 12)")
    p.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens in each prefix (default: 1024)")
    p.add_argument("--suffix-len", type=int, default=64,
                   help="prefix: random tokens after the prefix (default: 64)")
    p.add_argument("--output-len", type=int, default=32, help="prefix: output tokens a request (default: 32)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed; rate i uses seed + 1000 (i + 1), as pd_goodput (default: 0)")
    p.add_argument("--resimulate", default=None, metavar="JSON",
                   help="simulate a recorded run's requests again (its sim_validate*.json) against its measured "
                        "figures, with its profile or --profile; starts no cluster, takes the workload flags "
                        "from the JSON")
    p.add_argument("--no-request-overhead", action="store_true",
                   help="leave a request's time outside engine steps out of the profile (by default it is measured "
                        "first through a one-worker cluster, as `pdserve profile --serving-url` measures it, unless "
                        "--profile has it)")
    p.add_argument("--no-speed-probe", action="store_true",
                   help="skip the speed probe (a 1,024-token prompt and 16 decode steps on an engine of the "
                        "profile's, before each run and after the last: the machine's speed against the profile, "
                        "and each run simulated again at that speed)")
    p.add_argument("--trace-skip-s", type=float, default=5.0,
                   help="leave out each worker's steps in its first seconds when fitting a profile to the "
                        "workers' step traces (their first steps build oneDNN's kernels; default: 5)")
    p.add_argument("--decisions", action="store_true",
                   help="log every routing decision, the real router's (its --log-level DEBUG, on stderr) and "
                        "the simulator's, in one format (router/cost.py describe_pick): what each knew of every "
                        "worker, their cost-model seconds, where the prompt was prefilled")
    p.add_argument("--result-dir", default="bench-results",
                   help="where sim_validate.json (and a measured profile) go (default: bench-results)")
    args = p.parse_args()
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        p.error(f"--modes: {unknown} are not modes; modes: {list(MODES)}")
    from pdserve.router.policy import POLICIES

    unknown = sorted(set(args.policies.split(",")) - set(POLICIES))
    if unknown:
        p.error(f"--policies: {unknown} are not router policies; policies: {sorted(POLICIES)}")
    if (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
        p.error("--slo-ttft-ms and --slo-tpot-ms go together")
    return args


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so the workers and routers this script started are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args = parse_args()
    if args.decisions:  # the simulator's decisions (the real router's go to its own stderr)
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("pdserve.bench.sim").setLevel(logging.DEBUG)
    if args.resimulate:
        resimulate(args.resimulate, args.profile)
        return
    started = time.perf_counter()
    rates = [float(x) for x in args.rates.split(",")]
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    print(describe_cpu())
    profile = get_profile(args)
    if not args.no_request_overhead and not profile.request_overhead_s:
        profile = request_overhead(profile, args)
    from pdserve.bench.profile_cli import table
    from pdserve.engine.tokenizer import load_tokenizer

    print(table(profile))
    slo, unloaded = get_slo(args)
    sim_unloaded = simulated_unloaded(profile)
    if unloaded:
        print(f"unloaded (one worker, one core): TTFT of 2048 tokens {unloaded['ttft_ms']:.0f} ms (simulated "
              f"{sim_unloaded['ttft_ms']:.0f}), TPOT {unloaded['tpot_ms']:.1f} ms "
              f"(simulated {sim_unloaded['tpot_ms']:.1f})")
    print(f"SLOs: TTFT <= {slo.ttft_ms:.0f} ms, TPOT <= {slo.tpot_ms:.1f} ms", flush=True)
    tokenizer = load_tokenizer(BenchConfig(base_url="http://unused").tokenizer)
    probe = None if args.no_speed_probe else SpeedProbe(args.seed)
    results = {setup.name: validate_setup(setup, rates, slo, profile, tokenizer, args, probe)
               for setup in setups(args)}
    summary = {"profile": {k: [row["errors"][k] for r in results.values() for row in r["rows"]]
                           for k, _, _ in METRICS}}
    probed = [row["at_probe_speed"]["errors"] for r in results.values() for row in r["rows"]
              if "at_probe_speed" in row]
    if probed:
        summary["at_probe_speed"] = {k: [e[k] for e in probed] for k in probed[0]}
    summary["from_traces"] = cross_validate(results, profile, slo, tokenizer, args, Path(args.result_dir))
    print()
    for name, errors in summary.items():
        print(f"within 10% ({name}): " + within(errors))
    elapsed = time.perf_counter() - started
    print(f"\ntook {elapsed / 60:.1f} minutes")
    path = Path(args.result_dir) / ("sim_validate.json" if args.experiment == "pd" else "sim_validate_prefix.json")
    path.write_text(json.dumps({
        "cpu_flags": describe_cpu(), "args": vars(args), "seconds": elapsed, "profile": profile.to_json(),
        "slo": dataclasses.asdict(slo), "unloaded": {"measured": unloaded, "simulated": sim_unloaded},
        "modes": results, "within_10pct": {name: within(errors) for name, errors in summary.items()}},
        indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
