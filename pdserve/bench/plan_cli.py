"""``pdserve plan``: the cheapest pool sizes meeting a workload's SLOs, from the simulator.

    pdserve plan --roofline h100-sxm=4 --roofline l4=1 --shape llama-3-8b --request-rate 20 \\
        --random-input-len 512 --random-output-len 128 --goodput ttft:500 tpot:50 --write cluster.yaml

The workload flags are ``pdserve bench``'s and ``pdserve sim``'s (the same seeded requests); the
cluster's engine limits and router come from ``--config`` as in ``pdserve sim``; each ``--profile``
(or ``--roofline`` x ``--shape``) is an option, with its cost per replica-hour after ``=``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pdserve.bench.sim_cli import _NOT_SIMULATED, DEFAULT_ROOFLINE, load_profile, requests_from_bench, sim_config
from pdserve.configs import ConfigError, add_arguments, collect_arguments, from_dict

# Besides what pdserve sim leaves out: a sweep (a plan is for one rate), and --target replaces its target.
_NOT_PLANNED = (*_NOT_SIMULATED, "rates", "attainment_target", "label")


def split_cost(spec: str, flag: str) -> tuple[str, float]:
    """``NAME=COST`` -> (NAME, COST); a bare NAME costs 1 per replica-hour."""
    name, sep, cost = spec.rpartition("=")
    if not sep:
        return spec, 1.0
    try:
        value = float(cost)
    except ValueError:
        raise ConfigError(f"{flag}: expected NAME or NAME=COST (a number per replica-hour), got {spec!r}") from None
    if not value > 0:
        raise ConfigError(f"{flag}: the cost in {spec!r} must be positive")
    return name, value


def options(args: argparse.Namespace, seed: int) -> list:
    """One plan Option per --profile, and per --roofline x --shape, each with the cluster file's settings."""
    from pdserve.bench.plan import Option

    if args.profile and (args.roofline or args.shape):
        raise ConfigError("--profile: give profile files or --roofline/--shape, not both")
    if args.shape and not args.roofline:
        raise ConfigError("--shape: needs --roofline HW (the hardware to model the shape on)")
    found = []
    for spec in args.profile or []:
        path, cost = split_cost(spec, "--profile")
        found.append((Path(path).stem, cost, (path, None, None)))
    for spec in args.roofline or ([] if args.profile else [DEFAULT_ROOFLINE[0]]):
        hw, cost = split_cost(spec, "--roofline")
        for shape in args.shape or [DEFAULT_ROOFLINE[1]]:
            found.append((f"{hw}/{shape}", cost, (None, hw, shape)))
    out = []
    for name, cost, source in found:
        profile = load_profile(*source)
        config = sim_config(profile, args.config, policy=args.policy, transfer_backend=args.transfer_backend,
                            seed=seed)
        out.append(Option(name, profile, cost, config))
    if len({o.name for o in out}) < len(out):
        raise ConfigError(f"--profile/--roofline: an option is named twice: {[o.name for o in out]}")
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.bench.config import BenchConfig
    from pdserve.bench.metrics import SLO
    from pdserve.bench.plan import plan

    bench = from_dict(BenchConfig, collect_arguments(args, BenchConfig), owner="pdserve plan")
    if bench.request_rate == float("inf"):
        raise ConfigError("--request-rate: a plan needs the workload's arrival rate (requests per second)")
    slo = SLO.parse(args.goodput)
    if args.peak_rate is not None and args.peak_rate < bench.request_rate:
        raise ConfigError(f"--peak-rate: must be at least --request-rate ({bench.request_rate:g}), got "
                          f"{args.peak_rate:g}")
    if args.top < 1 or args.max_sim_requests < 1:
        raise ConfigError("--top and --max-sim-requests: must be at least 1")
    opts = options(args, bench.seed)
    requests = requests_from_bench(bench, bench.request_rate)
    started = time.perf_counter()
    found = plan(requests, slo, opts, args.target, args.max_replicas, args.max_sim_requests)
    wall_s = time.perf_counter() - started
    print(_heading(bench, slo, found, opts))
    print(table(found, args.top))
    print(f"searched {found.evaluations} configurations in {wall_s:.1f} s of wall time")
    for o in opts:
        tried = [c for c in found.candidates if c.option == o.name]
        if not any(c.meets for c in tried):
            top = max(tried, key=lambda c: c.attainment)
            print(f"{o.name}: nothing met the target within --max-replicas {args.max_replicas} ({len(tried)} tried; "
                  f"best {top.mode}: {100 * top.attainment:.1f}%)")
    best = found.meeting[0] if found.meeting else None
    if args.json:
        Path(args.json).write_text(json.dumps(_json(found, bench, slo), indent=1, allow_nan=True))
        print(f"wrote {args.json}")
    if args.write and best is not None:
        print(f"wrote {_write(args, best, opts, slo, bench)}")
    return 0 if best is not None else 3


def _heading(bench, slo, found, opts) -> str:
    goals = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms)) if v is not None)
    lines = [f"workload: {bench.dataset_name}, {found.total_requests} requests at {bench.request_rate:g} req/s "
             f"({bench.arrival}); SLO {goals}; target: {100 * found.target:g}% of requests meeting every SLO",
             *[f"note: {n}" for n in found.notes]]
    for o in opts:
        marked = " (a roofline: modelled, not measured)" if o.profile.kind == "modelled" else ""
        lines.append(f"option {o.name}: {o.profile.kind} profile of {o.profile.model.get('name', '?')} on "
                     f"{o.profile.hardware.get('name', '?')}{marked}; cost {o.cost:g} per replica-hour")
    return "\n".join(lines)


def table(found, top: int) -> str:
    """The cheapest ``top`` configurations meeting the target; then, under the best, the same option and
    prefill count with the most decode replicas that missed (how tight the answer is)."""
    out = ["rank | option | profile | mode | replicas | cost/h | attainment | TTFT p90 (ms) | TPOT p90 (ms) | "
           "goodput (req/s)", "--- | --- | --- | --- | --- | --- | --- | --- | --- | ---"]
    for rank, c in enumerate(found.meeting[:top], 1):
        out.append(_row(str(rank), c))
    best = found.meeting[0] if found.meeting else None
    missed = [c for c in found.candidates if not c.meets and (best is None or (
        c.option, c.prefill) == (best.option, best.prefill) and c.decode < best.decode)]
    if missed:
        out.append(_row("missed", max(missed, key=lambda c: (c.attainment, c.decode))))
    return "\n".join(out)


def _row(rank: str, c) -> str:
    return (f"{rank} | {c.option} | {c.kind} | {c.mode} | {c.replicas} | {c.cost:g} | {100 * c.attainment:.1f}% | "
            f"{c.ttft_ms['p90']:.0f} | {c.tpot_ms['p90']:.1f} | {c.goodput:.2f}")


def _json(found, bench, slo) -> dict:
    return {"workload": dataclasses.asdict(bench), "slo": dataclasses.asdict(slo), "target": found.target,
            "simulated_requests": found.simulated_requests, "total_requests": found.total_requests,
            "notes": found.notes, "candidates": [{**dataclasses.asdict(c), "replicas": c.replicas, "mode": c.mode}
                                                 for c in found.candidates]}


def _write(args, best, opts, slo, bench) -> Path:
    from pdserve.bench.plan import write_yaml
    from pdserve.cluster.config import read_yaml

    option = next(o for o in opts if o.name == best.option)
    headroom = args.peak_rate / bench.request_rate if args.peak_rate else 2.0
    header = (f"written by pdserve plan: {best.option} ({best.kind} profile), {best.mode}\n"
              f"predicted at {bench.request_rate:g} req/s: {100 * best.attainment:.1f}% of requests within the SLO, "
              f"TTFT p90 {best.ttft_ms['p90']:.0f} ms, TPOT p90 {best.tpot_ms['p90']:.1f} ms\n"
              f"autoscaling: up to {headroom:g}x the planned replicas (pdserve/bench/plan.py, autoscaling())")
    return write_yaml(best, option, slo, args.write, read_yaml(args.config), headroom, header)


def add_commands(sub) -> None:
    from pdserve.bench.config import BenchConfig
    from pdserve.router.policy import POLICIES

    p = sub.add_parser(
        "plan", help="the cheapest pool sizes meeting a workload's SLOs (searched on the simulator)",
        description="Simulates colocated and disaggregated pool sizes for each profile on the workload and prints "
                    "the cheapest meeting the SLO attainment target, with their predicted latencies; --write "
                    "writes the best as a cluster YAML with autoscaling. Exit status: 0 a configuration met the "
                    "target, 3 none did.")
    p.add_argument("--profile", action="append", metavar="PATH[=COST]",
                   help="a latency profile (pdserve profile's JSON) to plan with, and its cost per replica-hour "
                        "(default 1); repeat to compare")
    p.add_argument("--roofline", action="append", metavar="HW[=COST]",
                   help=f"instead of --profile: a modelled profile of this hardware (default: {DEFAULT_ROOFLINE[0]}), "
                        "and its cost per replica-hour; repeat to compare")
    p.add_argument("--shape", action="append", metavar="PRESET",
                   help=f"the model shape of --roofline (default: {DEFAULT_ROOFLINE[1]}); repeat: each with each HW")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="the SLOs to meet, e.g. --goodput ttft:500 tpot:50 (milliseconds)")
    p.add_argument("--target", type=float, default=0.9,
                   help="the share of requests that must meet every SLO (default: 0.9)")
    p.add_argument("--max-replicas", type=int, default=16, help="most replicas in a configuration (default: 16)")
    p.add_argument("--config", default=None,
                   help="the cluster YAML whose engine limits and router the plan keeps (default: its defaults)")
    p.add_argument("--policy", choices=sorted(POLICIES), default=None, help="router policy, over the file's")
    p.add_argument("--transfer-backend", default=None,
                   help="the profiles' KV transfer model to use (default: the file's kv_transfer.backend)")
    p.add_argument("--peak-rate", type=float, default=None,
                   help="--write: autoscale up to this rate (max_replicas scaled by it; default: twice the rate)")
    p.add_argument("--max-sim-requests", type=int, default=2000,
                   help="simulate at most this many requests, the first to arrive (default: 2000)")
    p.add_argument("--top", type=int, default=10, help="configurations to print (default: 10)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every configuration simulated as JSON")
    p.add_argument("--write", default=None, metavar="PATH",
                   help="write the best configuration as a cluster YAML (--config's, with its pools and autoscaling)")
    add_arguments(p, BenchConfig, skip=_NOT_PLANNED)
    p.set_defaults(func=cmd_plan)
