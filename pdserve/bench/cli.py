"""``pdserve bench``: load-test any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.configs import add_arguments, collect_arguments, from_dict


def cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.bench.api import BenchOutcome, run_bench, write_outputs
    from pdserve.bench.config import BenchConfig
    from pdserve.bench.metrics import SLO
    from pdserve.bench.report import sweep_table, table
    from pdserve.bench.runner import ServerUnreachable

    config = from_dict(BenchConfig, collect_arguments(args, BenchConfig))
    slo = SLO.parse(args.goodput)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    outcome = BenchOutcome("")
    try:
        runner(run_bench(config, slo, outcome=outcome))
    except ServerUnreachable as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve bench: interrupted; writing what was measured", file=sys.stderr)
        outcome.interrupted = outcome.interrupted or "KeyboardInterrupt"
    if not outcome.runs:
        return 130
    for run in outcome.runs:
        print(table(run["summary"], f"{config.dataset_name} @ {run['rate']:g} req/s"))
    if len(outcome.runs) > 1:
        print(sweep_table(outcome.runs, outcome.goodput_rate, config.attainment_target))
    for path in write_outputs(config, outcome, slo):
        print(f"wrote {path}")
    if outcome.interrupted:
        return 130
    failed = sum(r["summary"].failed for r in outcome.runs)
    return 0 if failed == 0 else 3


def add_commands(sub) -> None:
    from pdserve.bench.config import BenchConfig

    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (latency, throughput, goodput, plots)",
        description="Send a workload to any OpenAI-compatible server, streaming, and measure TTFT, TPOT, "
                    "inter-token and end-to-end latency, throughput and goodput; write a JSON of every request "
                    "and PNG plots. Exit status: 0 all requests succeeded, 3 some failed, 1 server unreachable.")
    add_arguments(bench, BenchConfig)
    bench.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                       help="SLOs for goodput and attainment, e.g. --goodput ttft:500 tpot:50 (milliseconds)")
    bench.set_defaults(func=cmd_bench)
