"""How far `pdserve sim` scales: a 1,000-replica cluster and a million requests on this machine's CPU.

    .venv/bin/python benchmarks/sim_scale.py                        # 1,000 colocated replicas, 1,000,000 requests
    .venv/bin/python benchmarks/sim_scale.py --requests 100000      # a shorter run

The cluster is colocated (every replica prefills and decodes its own requests; ``--prefill`` splits off a
prefill pool) under the ``least_loaded`` policy, on the roofline of an H100 SXM with SmolLM2-135M's shape;
the workload is random 512-token prompts with 128 output tokens, Poisson arrivals at ``--rate`` (by
default 25 requests per second per replica, about a fifth of what a replica holds at this shape). The
prompts are made as the simulation reaches them, so a million of them never sit in memory at once; the
records are compact (``SimConfig.compact_records``). Prints one table row: replicas, requests, simulated
seconds, wall seconds, simulated requests per wall second, peak RSS, and the CPU's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from collections.abc import Sequence

import numpy as np

from pdserve.bench.latency_model import HARDWARE, roofline
from pdserve.bench.sim import SimConfig, SimRequest, simulate
from pdserve.engine.config import PRESETS
from pdserve.engine.cpu_isa import describe_cpu
from pdserve.router.policy import POLICIES

TOKEN_LOW, TOKEN_HIGH = 100, 40000  # the prompts' token ids: uniform in [TOKEN_LOW, TOKEN_HIGH)


class LazyRequests(Sequence):
    """``count`` requests of random prompts, each built when the simulation asks for it (in arrival order)."""

    CHUNK = 4096

    def __init__(self, count: int, rate: float, input_len: int, output_len: int, seed: int = 0):
        self.count, self.input_len, self.output_len, self.seed = count, input_len, output_len, seed
        self.arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, count)) if count else []
        self._chunk, self._tokens, self._built = -1, None, {}
        # Every token id's int made once: a prompt is references to them (an object array's rows), not
        # 512 new ints. The same prompts; a million of them no longer churn 16 GB of ints, and the
        # simulation's own objects stay closer together (measured: the note of the change).
        self._ids = np.array(list(range(TOKEN_HIGH)), dtype=object)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> SimRequest:
        if not 0 <= i < self.count:
            raise IndexError(i)
        if i not in self._built:
            chunk = i // self.CHUNK
            if chunk != self._chunk:  # one draw per chunk of prompts, made into lists at once
                rng = np.random.default_rng([self.seed, chunk])
                tokens = rng.integers(TOKEN_LOW, TOKEN_HIGH, (self.CHUNK, self.input_len))
                self._chunk, self._tokens = chunk, self._ids[tokens].tolist()
            if len(self._built) >= 4:  # the oldest out (the simulation asks for the next arrival, then this one)
                del self._built[next(iter(self._built))]
            self._built[i] = SimRequest(i, float(self.arrivals[i]), self._tokens[i % self.CHUNK], self.output_len)
        return self._built[i]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=1_000_000, help="requests to simulate (default: 1,000,000)")
    p.add_argument("--replicas", type=int, default=1000, help="replicas in all, both pools (default: 1,000)")
    p.add_argument("--prefill", type=int, default=0, help="of --replicas, how many are prefill workers (default: 0, "
                                                        "colocated)")
    p.add_argument("--rate", type=float, default=None,
                   help="arrivals per simulated second (default: 25 per replica)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="least_loaded", help="router policy (default: "
                                                                                      "least_loaded)")
    p.add_argument("--shape", choices=sorted(PRESETS), default="smollm2-135m", help="model shape of the H100 "
                                                                                  "roofline (default: smollm2-135m)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default: 128)")
    p.add_argument("--full-records", action="store_true", help="keep every token's gap in the records")
    p.add_argument("--reference", action="store_true", help="every step through the scheduler (fast_decode off)")
    args = p.parse_args(argv)
    profile = roofline(HARDWARE["h100-sxm"], dataclasses.asdict(PRESETS[args.shape]), args.shape)
    rate = args.rate or 25.0 * args.replicas
    config = SimConfig(prefill_replicas=args.prefill, decode_replicas=args.replicas - args.prefill,
                       policy=args.policy, compact_records=not args.full_records, fast_decode=not args.reference)
    requests = LazyRequests(args.requests, rate, args.input_len, args.output_len)
    started = time.perf_counter()
    result = simulate(config, profile, requests)
    wall = time.perf_counter() - started
    summary = result.summary()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"H100 roofline, {args.shape}; {config.prefill_replicas} prefill + {config.decode_replicas} decode "
          f"replicas, {args.policy}; {args.input_len} in / {args.output_len} out at {rate:g} req/s; "
          f"{result.events} events; completed {summary.completed}, failed {summary.failed}; "
          f"TTFT p50 {summary.ttft_ms['median']:.1f} ms, TPOT p50 {summary.tpot_ms['median']:.2f} ms")
    print("| replicas | requests | simulated s | wall s | simulated req / wall s | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.replicas} | {args.requests} | {result.duration_s:.1f} | {wall:.1f} | "
          f"{args.requests / wall:.0f} | {peak_mib:.0f} |")
    print(describe_cpu())
    return 0 if summary.failed == 0 else 3


if __name__ == "__main__":
    raise SystemExit(main())
