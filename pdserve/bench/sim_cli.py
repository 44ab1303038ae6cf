"""``pdserve sim``: simulate a cluster on a workload, with the bench's flags, table, JSON and plots.

    pdserve sim --config cluster.yaml --profile profile.json --dataset-name random --num-prompts 1000 \\
        --request-rate 20 --goodput ttft:500 tpot:50 --result-dir sim-results

The cluster comes from the file ``pdserve serve`` takes (pools, engine limits, router policy,
disaggregation thresholds, autoscaling), with ``--prefill``/``--decode``/``--policy`` over it; the
workload from the flags ``pdserve bench`` takes (the same seeded requests and arrival times); the
step and transfer times from a profile (``pdserve profile``'s JSON, or a roofline of a known GPU).
``pdserve --log-level DEBUG sim ...`` logs every routing decision as the router's ``--log-level DEBUG``
does, in the same format (``pdserve.router.cost.describe_pick``), to compare with a real run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from pathlib import Path

from pdserve.configs import ConfigError, add_arguments, collect_arguments, from_dict

# BenchConfig's flags that mean nothing without a server (or are not simulated yet).
# (result_dir: its own flag here, as a simulation writes files only when asked.)
_NOT_SIMULATED = ("base_url", "model", "endpoint", "duration", "warmup_requests", "max_concurrency", "temperature",
                  "ignore_eos", "timeout_s", "save_text", "progress", "result_dir")
DEFAULT_ROOFLINE = ("epyc-2core", "smollm2-135m")


def load_profile(path: str | None = None, hw: str | None = None, shape: str | None = None):
    """The profile from a file (``--profile``), or the roofline of hardware and a model shape (``--roofline``,
    ``--shape``; each defaults to ``DEFAULT_ROOFLINE``'s)."""
    from pdserve.bench.latency_model import HARDWARE, Profile, roofline
    from pdserve.engine.config import PRESETS

    if path and (hw or shape):
        raise ConfigError("--profile: give a profile file or --roofline/--shape, not both")
    if path:
        try:
            return Profile.load(path)
        except OSError as e:
            raise ConfigError(f"--profile: cannot read {path}: {e.strerror}") from e
    hw, shape = hw or DEFAULT_ROOFLINE[0], shape or DEFAULT_ROOFLINE[1]
    if hw not in HARDWARE:
        raise ConfigError(f"--roofline: {hw!r} is not one of {sorted(HARDWARE)}")
    if shape not in PRESETS:
        raise ConfigError(f"--shape: {shape!r} is not one of {sorted(PRESETS)}")
    return roofline(HARDWARE[hw], dataclasses.asdict(PRESETS[shape]), shape)


def sim_config(profile, config_path: str | None, *, prefill: int | None = None, decode: int | None = None,
               policy: str | None = None, transfer_backend: str | None = None, startup_s: float = 0.0,
               autoscale_interval_s: float = 1.0, seed: int = 0):
    """The cluster file (``--config``; None: the defaults) with the command line's overrides (None: the
    file's), as a SimConfig."""
    from pdserve.bench.sim import SimConfig
    from pdserve.cluster.config import load_serve_config

    overrides: dict = {}
    for role, replicas in (("prefill", prefill), ("decode", decode)):
        if replicas is not None:
            overrides.setdefault("pools", {})[role] = {"replicas": replicas}
    if policy is not None:
        overrides["router"] = {"policy": policy}
    serve = load_serve_config(config_path, overrides)
    backend = transfer_backend or serve.kv_transfer.backend
    if backend not in profile.transfer and backend == "torch" and "nccl" in profile.transfer:
        backend = "nccl"  # torch.distributed's transfer on GPUs
    if backend not in profile.transfer:
        raise ConfigError(f"--transfer-backend: the profile has no transfer model for {backend!r} (it has: "
                          f"{sorted(profile.transfer) or 'none'})")
    if startup_s < 0 or autoscale_interval_s <= 0:
        raise ConfigError("--startup-s must not be negative and --autoscale-interval-s must be positive")
    return SimConfig.from_serve(serve, profile, transfer_backend=backend, startup_s=startup_s,
                                autoscale_interval_s=autoscale_interval_s, seed=seed)


def requests_from_bench(config, rate: float, tokenizer=None):
    """The requests ``pdserve bench`` sends with ``config`` (a BenchConfig) at ``rate``: the runner's
    own workload (its warm-up requests first, marked) at its own arrival times, so the same seed
    gives the same prompts, lengths and times. ``tokenizer``: ``load_tokenizer(config.tokenizer)``
    when None (the bench's vocabulary range for random ids, and text traces)."""
    from pdserve.bench.runner import arrival_offsets, build_workload
    from pdserve.bench.sim import SimRequest

    if config.dataset_name == "chat":
        raise ConfigError("--dataset-name: 'chat' is not simulated (its turns are written from the model's "
                          "answers); use random, prefix, conversational or a jsonl trace")
    if tokenizer is None:
        from pdserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    items = build_workload(config, tokenizer)
    offsets = arrival_offsets(len(items), rate, config.arrival_kind(), config.burstiness, config.seed)
    out = []
    for i, (item, t) in enumerate(zip(items, offsets)):
        prompt = item.prompt
        if not isinstance(prompt, list):
            prompt = tokenizer.encode(prompt) if prompt is not None else tokenizer.encode_chat(item.messages)
        out.append(SimRequest(i, t, prompt, item.output_len or config.random_output_len,
                              warmup=i < config.warmup_requests))
    return out


def cmd_sim(args: argparse.Namespace) -> int:
    from pdserve.bench.api import BenchOutcome
    from pdserve.bench.config import BenchConfig
    from pdserve.bench.metrics import SLO, goodput_rate
    from pdserve.bench.report import sweep_table, table
    from pdserve.bench.sim import simulate

    bench = from_dict(BenchConfig, collect_arguments(args, BenchConfig), owner="pdserve sim")
    bench = dataclasses.replace(bench, label=bench.label or f"sim-{bench.dataset_name}")
    slo = SLO.parse(args.goodput)
    profile = load_profile(args.profile, args.roofline, args.shape)
    config = sim_config(profile, args.config, prefill=args.prefill, decode=args.decode, policy=args.policy,
                        transfer_backend=args.transfer_backend, startup_s=args.startup_s,
                        autoscale_interval_s=args.autoscale_interval_s, seed=bench.seed)
    print(f"profile: {profile.kind} ({profile.model.get('name', '?')} on {profile.hardware.get('name', '?')}); "
          f"{config.prefill_replicas} prefill + {config.decode_replicas} decode replicas, policy {config.policy}, "
          f"{config.num_kv_blocks} KV blocks each")
    outcome = BenchOutcome(str(profile.model.get("name", "")))
    sims = []
    for rate in bench.rate_list() or [bench.request_rate]:
        requests = requests_from_bench(bench, rate)
        started = time.perf_counter()
        result = simulate(config, profile, requests)
        wall_s = time.perf_counter() - started
        summary = result.summary(slo)
        outcome.runs.append({"rate": rate, "records": result.records, "summary": summary})
        sims.append(_sim_json(result, rate, wall_s))
        print(table(summary, f"simulated: {bench.dataset_name} @ {rate:g} req/s"))
        print(_speed_line(len(requests), result.events, wall_s))
        print("prefill decisions: " + (", ".join(f"{k} {v}" for k, v in result.decisions.items()) or "none"))
    if bench.rates and slo is not None:
        outcome.goodput_rate = goodput_rate([r["rate"] for r in outcome.runs],
                                            [r["summary"].slo_attainment for r in outcome.runs],
                                            bench.attainment_target)
    if len(outcome.runs) > 1:
        print(sweep_table(outcome.runs, outcome.goodput_rate, bench.attainment_target))
    if args.result_dir is not None:
        for path in _write(bench, outcome, slo, config, profile, sims):
            print(f"wrote {path}")
    return 0 if all(r["summary"].failed == 0 for r in outcome.runs) else 3


def _speed_line(requests: int, events: int, wall_s: float) -> str:
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return (f"simulated {requests} requests ({events} events) in {wall_s:.2f} s of wall time: "
            f"{requests / max(wall_s, 1e-9):.0f} requests per wall second; peak memory {peak_mib:.0f} MiB")


def _sim_json(result, rate: float, wall_s: float) -> dict:
    return {"rate": rate, "wall_s": wall_s, "requests_per_wall_s": len(result.records) / max(wall_s, 1e-9),
            "events": result.events, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "decisions": result.decisions, "pools": result.pools,
            "replicas": [dataclasses.asdict(r) for r in result.replicas]}


def _write(bench, outcome, slo, config, profile, sims: list[dict]) -> list[Path]:
    """The bench's JSON (with a ``sim`` section) and plots, and the pools' replicas over time."""
    from pdserve.bench.api import write_outputs
    from pdserve.bench.report import inf_as_text

    cfg = {k: v for k, v in dataclasses.asdict(config).items() if k != "cost"}
    paths = write_outputs(bench, outcome, slo, {"sim": {"config": inf_as_text(cfg), "profile": profile.to_json(),
                                                         "runs": sims}})
    out = Path(bench.result_dir) / f"{bench.label}-replicas.png"
    plot_replicas(sims, out, f"{bench.dataset_name}: replicas per pool (simulated)")
    return [*paths, out]


def plot_replicas(sims: list[dict], path: Path, title: str) -> None:
    """Each pool's replicas serving and asked for over time (the autoscaler's timeline), per rate."""
    from pdserve.bench.report import _pyplot, save_figure

    fig, ax = _pyplot().subplots(figsize=(8, 3.4))
    for sim in sims:
        suffix = f" @ {sim['rate']:g} req/s" if len(sims) > 1 else ""
        for role, points in sim["pools"].items():
            if points:
                t, ready, asked = zip(*points)
                line, = ax.step(t, ready, where="post", label=f"{role} serving{suffix}")
                ax.step(t, asked, where="post", ls=":", c=line.get_color(), label=f"{role} asked for{suffix}")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def add_commands(sub) -> None:
    from pdserve.bench.config import BenchConfig
    from pdserve.bench.latency_model import HARDWARE
    from pdserve.engine.config import PRESETS
    from pdserve.router.policy import POLICIES

    sim = sub.add_parser(
        "sim", help="simulate a cluster on a workload (the real scheduler and policies, a profile's timings)",
        description="A discrete-event simulation of the cluster in --config: each replica runs the engine's real "
                    "scheduler and KV cache with step and transfer times from a profile; the router's and the "
                    "autoscaler's real policies decide. Prints and writes what pdserve bench prints and writes. "
                    "Exit status: 0 every request finished, 3 some did not.")
    sim.add_argument("--config", default=None, help="the cluster YAML pdserve serve takes (default: its defaults)")
    sim.add_argument("--prefill", type=int, default=None, help="prefill replicas, over the file's (0: colocated)")
    sim.add_argument("--decode", type=int, default=None, help="decode replicas, over the file's")
    sim.add_argument("--policy", choices=sorted(POLICIES), default=None, help="router policy, over the file's")
    sim.add_argument("--profile", default=None, help="a latency profile (JSON, from pdserve profile)")
    sim.add_argument("--roofline", choices=sorted(HARDWARE), default=None,
                     help=f"instead of --profile: a modelled profile of this hardware (default: {DEFAULT_ROOFLINE[0]})")
    sim.add_argument("--shape", choices=sorted(PRESETS), default=None,
                     help=f"the model shape of --roofline (default: {DEFAULT_ROOFLINE[1]})")
    sim.add_argument("--transfer-backend", default=None,
                     help="the profile's KV transfer model to use (default: the file's kv_transfer.backend)")
    sim.add_argument("--startup-s", type=float, default=30.0,
                     help="seconds from the autoscaler asking for a replica to its serving (default: 30)")
    sim.add_argument("--autoscale-interval-s", type=float, default=1.0,
                     help="how often the autoscaling policy decides, in simulated seconds (default: 1)")
    add_arguments(sim, BenchConfig, skip=_NOT_SIMULATED)
    sim.add_argument("--result-dir", default=None,
                     help="where the JSON of every request and the PNG plots go (default: not written)")
    sim.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                     help="SLOs for goodput and attainment, e.g. --goodput ttft:500 tpot:50 (milliseconds)")
    sim.set_defaults(func=cmd_sim)

