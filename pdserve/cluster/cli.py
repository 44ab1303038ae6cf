"""The ``pdserve`` command line.

    pdserve serve                        the OpenAI API on :8000 with the default model
    pdserve generate --prompt "..."      one answer, streamed, engine in this process
    pdserve chat                         an interactive chat, engine in this process
    pdserve router --worker ADDR ...     the router alone, in front of running workers
    pdserve worker decode --port P       one decode worker alone
    pdserve bench --base-url URL         load-test any OpenAI-compatible server
    pdserve profile -o profile.json      this machine's engine step and KV transfer times, fitted
    pdserve sim --profile profile.json   simulate a cluster on a workload with those timings
    pdserve plan --roofline h100-sxm ... the cheapest pool sizes meeting a workload's SLOs
    pdserve cascade calibrate ...        a cascade's threshold from a prompt set
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.bench import cli as bench_cli
from pdserve.bench import plan_cli, profile_cli, sim_cli
from pdserve.cluster import cascade_cli, offline_cli, serve_cli
from pdserve.configs import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cli.add_commands(sub)
    offline_cli.add_commands(sub)
    bench_cli.add_commands(sub)
    sim_cli.add_commands(sub)
    plan_cli.add_commands(sub)
    profile_cli.add_commands(sub)
    cascade_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
