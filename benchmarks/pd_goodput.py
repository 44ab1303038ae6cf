"""DistServe's experiment on this machine: goodput of colocated vs disaggregated serving.

    python benchmarks/pd_goodput.py                      # about 25 minutes on 2 cores
    python benchmarks/pd_goodput.py --num-prompts 8 --rates 0.05,0.1,0.2

Colocated: two decode workers, each pinned to one core, prefilling their own prompts, the
router routing with its default policy (cache_aware: least predicted seconds). Disaggregated:
one prefill worker on one core, one decode worker on the other. Same model, same Poisson
workload (prompts uniform in 512-2048 tokens, outputs in 64-256) from the `pdserve bench`
library, at increasing request rates.

SLOs come from unloaded single-request figures measured in the same run, on one worker
pinned to one core: TTFT <= 5x the unloaded TTFT of a 2048-token prompt, TPOT <= 2x the
unloaded TPOT. Reports SLO attainment per rate for both, each one's goodput (the highest rate
with >= 90% attainment) and their ratio, and a PNG of attainment vs rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench.api import run_bench  # noqa: E402
from pdserve.bench.config import BenchConfig  # noqa: E402
from pdserve.bench.metrics import SLO, goodput_rate  # noqa: E402
from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready  # noqa: E402
from tests.integration.conftest import start_router  # noqa: E402

MODEL = "smollm2-135m-instruct"
MODES = {"colocated": ["decode", "decode"], "disaggregated": ["prefill", "decode"]}  # the workers' roles


def pin(pid: int, core: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass


def start(roles: list[str], router_flags: list[str] = (), worker_flags: list[str] = (),
          router_log_level: str = "WARNING"):
    cores = sorted(os.sched_getaffinity(0))
    common = ["--port", "0", "--model", MODEL, "--no-load-progress", "--num-threads", "1",
              "--kv-cache-memory-gb", "1", *worker_flags]
    workers = [start_worker(role, common) for role in roles]
    wait_ready(workers, timeout_s=300)
    for i, w in enumerate(workers):
        pin(w.pid, cores[i % len(cores)])
    router, url = start_router([w.address for w in workers], MODEL, "--max-concurrent-requests", "4096",
                               *router_flags, log_level=router_log_level)
    return workers, router, url


def stop(workers, router) -> None:
    router.terminate()
    router.wait(30)
    stop_workers(workers, grace_s=10)


@contextlib.contextmanager
def cluster(roles: list[str], router_flags: list[str] = (), worker_flags: list[str] = (),
            router_log_level: str = "WARNING"):
    """``start``'s cluster for the block (its router's URL), stopped after it."""
    workers, router, url = start(roles, router_flags, worker_flags, router_log_level)
    try:
        yield url
    finally:
        stop(workers, router)


def slo_of(ttft0_ms: float, tpot0_ms: float) -> SLO:
    """The SLOs from the unloaded figures: TTFT <= 5x a 2048-token prompt's, TPOT <= 2x."""
    return SLO(ttft_ms=5 * ttft0_ms, tpot_ms=2 * tpot0_ms)


def workload(url: str, num_prompts: int, rate: float, seed: int, i: int) -> BenchConfig:
    """The sweep's workload at its ``i``-th rate. A fresh seed per rate (the same for both setups): prompts
    repeated across rates would be prefix-cache hits, not prefills."""
    return BenchConfig(base_url=url, progress=False, dataset_name="random", random_input_len=1280,
                       random_output_len=160, random_range_ratio=0.6, num_prompts=num_prompts, request_rate=rate,
                       seed=seed + 1000 * (i + 1), warmup_requests=1)


def bench(url: str, **options):
    config = BenchConfig(base_url=url, progress=False, **options)
    return asyncio.run(run_bench(config, options.pop("slo", None)))


def unloaded() -> tuple[float, float]:
    """(TTFT of a 2048-token prompt, TPOT) of one request on one worker pinned to one core."""
    workers, router, url = start(["decode"])
    try:
        common = dict(dataset_name="random", random_range_ratio=0.0, request_rate=float("inf"), max_concurrency=1)
        bench(url, random_input_len=64, random_output_len=8, num_prompts=1, **common)  # warm up
        ttft_run = bench(url, random_input_len=2048, random_output_len=1, num_prompts=3, seed=11, **common)
        tpot_run = bench(url, random_input_len=512, random_output_len=128, num_prompts=3, seed=12, **common)
    finally:
        stop(workers, router)
    return ttft_run.runs[0]["summary"].ttft_ms["median"], tpot_run.runs[0]["summary"].tpot_ms["median"]


def sweep(name: str, roles: list[str], rates: list[float], slo: SLO, args) -> list[dict]:
    rows = []
    with cluster(roles) as url:
        for i, rate in enumerate(rates):
            config = workload(url, args.num_prompts, rate, args.seed, i)
            t = time.perf_counter()
            run = asyncio.run(run_bench(config, slo)).runs[0]
            s = run["summary"]
            rows.append({"rate": rate, "attainment": s.slo_attainment, "ttft_p90": s.ttft_ms["p90"],
                         "tpot_p90": s.tpot_ms["p90"], "completed": s.completed, "failed": s.failed,
                         "seconds": time.perf_counter() - t})
            print(f"  {name} @ {rate:g} req/s: attainment {100 * s.slo_attainment:.0f}%, TTFT p90 "
                  f"{s.ttft_ms['p90'] / 1e3:.1f} s, TPOT p90 {s.tpot_ms['p90']:.0f} ms", flush=True)
    return rows


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so the workers and routers this script started are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.05,0.1,0.15,0.2,0.3", help="request rates (default: 0.05,0.1,0.15,0.2,0.3)")
    p.add_argument("--num-prompts", type=int, default=12, help="requests per rate (default: 12)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    args = p.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    ttft0, tpot0 = unloaded()
    slo = slo_of(ttft0, tpot0)
    print(f"unloaded (one worker, one core): TTFT of a 2048-token prompt {ttft0 / 1e3:.2f} s, TPOT {tpot0:.1f} ms")
    print(f"SLOs: TTFT <= {slo.ttft_ms / 1e3:.2f} s, TPOT <= {slo.tpot_ms:.1f} ms")
    colocated = sweep("colocated", MODES["colocated"], rates, slo, args)
    disaggregated = sweep("disaggregated", MODES["disaggregated"], rates, slo, args)
    good_c = goodput_rate(rates, [r["attainment"] for r in colocated])
    good_d = goodput_rate(rates, [r["attainment"] for r in disaggregated])
    print("\nrate (req/s) | colocated attainment | disaggregated attainment | colocated TTFT / TPOT p90 | "
          "disaggregated TTFT / TPOT p90")
    print("--- | --- | --- | --- | ---")
    for c, d in zip(colocated, disaggregated):
        print(f"{c['rate']:g} | {100 * c['attainment']:.0f}% | {100 * d['attainment']:.0f}% | "
              f"{c['ttft_p90'] / 1e3:.1f} s / {c['tpot_p90']:.0f} ms | {d['ttft_p90'] / 1e3:.1f} s / "
              f"{d['tpot_p90']:.0f} ms")
    ratio = (good_d / good_c) if good_c and good_d else None
    print(f"\ngoodput (highest rate with >= 90% attainment): colocated {good_c}, disaggregated {good_d}"
          + (f", ratio {ratio:.2f}x" if ratio else ""))
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pd_goodput.json").write_text(json.dumps({
        "unloaded": {"ttft_ms": ttft0, "tpot_ms": tpot0}, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "colocated": colocated, "disaggregated": disaggregated, "goodput": {"colocated": good_c,
                                                                            "disaggregated": good_d}}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(rates, [100 * r["attainment"] for r in colocated], "o-", label=f"colocated (goodput {good_c})")
    ax.plot(rates, [100 * r["attainment"] for r in disaggregated], "s-", label=f"disaggregated (goodput {good_d})")
    ax.axhline(90, ls="--", c="k", lw=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"TTFT <= {slo.ttft_ms / 1e3:.1f} s, TPOT <= {slo.tpot_ms:.0f} ms (2 cores)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "pd_goodput.png", dpi=100)
    print(f"\nwrote {out / 'pd_goodput.json'} and {out / 'pd_goodput.png'}")


if __name__ == "__main__":
    main()
