"""Soak and overload (issue 15, item 7): mixed tenants and service classes at twice the cluster's
capacity, with a decode worker killed (and a replacement started) and Redis restarted during the run.

    python benchmarks/soak.py                      # 2 decode workers, 120 s of load
    python benchmarks/soak.py --duration-s 60      # shorter

The cluster: `--decode` decode workers of the tiny random model (colocated; `--max-num-seqs` small
so that its capacity is a few requests per second and the machine is not the limit), registered in
a Redis that the router reads, workers scheduling by priority; a router with three tenants' keys,
`gold` (may use priority), `silver` (default), `bronze` (flex), a queue in front of its sequence cap,
and per-class SLOs; the workers run at `--worker-nice` 10 (the router and the client would otherwise
wait for a core behind them: on a machine of its own a router has cores to itself). First the
capacity is measured (closed loop, every client back to back); then
Poisson arrivals at `--overload` x that rate for `--duration-s`: `--mix` says which share of the
requests each tenant sends, each in its own class. At 30% of the run one decode worker is SIGKILLed
and a new one started; at 60% Redis is stopped and started again.

Reported per class: offered, admitted (200), shed (429; and how many of those a worker ended
unstarted at their queue timeout, the rest being the router's queue's), errors (another status with OpenAI's error
body), lost (no answer at all, or a stream cut without an error: must be 0), attainment of the class's
SLO among the admitted ones (TTFT and TPOT measured by the client), and p90 TTFT. Memory: the
router's, each surviving worker's and the replacement's RSS sampled every second (the replacement's
from its start); growth = mean RSS of the last quarter over the mean of the second quarter of its
samples (target <= 5%). Leaked blocks: every worker's KV usage and running
requests after the run (0). Prints the table with the CPU's flags; writes soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready  # noqa: E402
from pdserve.engine.cpu_isa import describe_cpu  # noqa: E402
from tests.integration.conftest import Cluster, start_router  # noqa: E402
from tests.redis_server import RedisServer, redis_binary  # noqa: E402

MODEL = "random:tiny"
TENANTS = {"gold": "priority", "silver": "default", "bronze": "flex"}
SLO_MS = {"priority": (2000, 200), "default": (5000, 400), "flex": (20000, 1000)}  # (TTFT, TPOT) per class


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


class Sampler(threading.Thread):
    """RSS of the router and the workers every second."""

    def __init__(self, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.pids, self.samples, self.stop = dict(pids), [], threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(1.0):
            pids = dict(self.pids)  # a worker may join (the replacement) while this runs
            self.samples.append((time.monotonic() - start, {name: rss_kb(pid) for name, pid in pids.items()}))

    def growth(self, name: str) -> float | None:
        values = [s[name] for _, s in self.samples if s.get(name)]
        if len(values) < 8:
            return None
        q = len(values) // 4
        second, last = statistics.mean(values[q:2 * q]), statistics.mean(values[-q:])
        return last / second - 1


async def request(client: httpx.AsyncClient, key: str, tier: str, rng: random.Random) -> dict:
    body = {"model": MODEL, "prompt": [rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))],
            "max_tokens": rng.randint(8, 48), "ignore_eos": True, "temperature": 0, "stream": True,
            "service_tier": tier}
    started, first, last, tokens = time.perf_counter(), None, None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                ok_shape = '"error"' in text and '"message"' in text
                return {"status": r.status_code, "outcome": "shed" if r.status_code == 429 else
                        ("error" if ok_shape else "lost"), "why": text[:200]}
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"status": 200, "outcome": "error", "why": chunk["error"].get("message", "")[:200]}
                    if chunk.get("choices"):  # a token (its text may be empty or held back)
                        now = time.perf_counter()
                        first = first or now
                        last, tokens = now, tokens + 1
    except httpx.HTTPError as e:
        return {"status": 0, "outcome": "lost", "why": f"{e!r} after {time.perf_counter() - started:.3f} s"}
    if not done:
        return {"status": 200, "outcome": "lost", "why": f"stream cut after {tokens} chunks, without [DONE]"}
    if first is None:
        return {"status": 200, "outcome": "lost", "why": "[DONE] without a token"}
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return {"status": 200, "outcome": "admitted", "ttft": first - started, "tpot": tpot}


async def capacity(url: str, keys: dict[str, str], clients: int, seconds: float) -> float:
    """Requests per second completed with every client back to back (the default class)."""
    rng = random.Random(1)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        deadline = time.perf_counter() + seconds

        async def loop():
            nonlocal done
            while time.perf_counter() < deadline:
                if (await request(client, keys["silver"], "default", rng))["outcome"] == "admitted":
                    done += 1

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return done / (time.perf_counter() - started)


async def overload(url: str, keys: dict[str, str], rate: float, args, faults) -> list[tuple[str, dict]]:
    rng = random.Random(args.seed)
    tenants = list(TENANTS)
    weights = [float(x) for x in args.mix.split(",")]
    results: list[tuple[str, dict]] = []
    # Idle connections are dropped by the client after 2 s, before the router's server closes them
    # (uvicorn: 5 s): a request sent on a connection the server closes at that moment fails with a
    # ReadError the router never saw. One ReadError came in six short runs without this; with the
    # client's race ruled out, a "lost" request is one the router dropped.
    limits = httpx.Limits(max_connections=1024, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        tasks, at = [], 0.0
        fired = set()
        while at < args.duration_s:
            at += rng.expovariate(rate)
            for share, fault in faults:
                if share not in fired and at >= share * args.duration_s:
                    fired.add(share)
                    tasks.append(asyncio.create_task(asyncio.to_thread(fault, t0 + share * args.duration_s)))
            tenant = rng.choices(tenants, weights)[0]
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))

            async def one(tenant=tenant, seed=rng.random()):
                results.append((TENANTS[tenant], await request(client, keys[tenant], TENANTS[tenant],
                                                               random.Random(seed))))

            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return results


def settle(cluster: Cluster, timeout_s: float = 30.0) -> list[dict]:
    """Every live worker's running, waiting and KV usage once all are idle (the last aborts and frees
    reach the engines a step after the answers), or as they stand after ``timeout_s``: a leak."""
    deadline = time.monotonic() + timeout_s
    while True:
        leftovers = [{"worker": s.worker_id, "running": s.num_running, "waiting": s.num_waiting,
                      "kv_usage": s.kv_usage} for s in cluster.stats()]
        idle = all(w["running"] == 0 and w["waiting"] == 0 and w["kv_usage"] == 0 for w in leftovers)
        if idle or time.monotonic() > deadline:
            return leftovers
        time.sleep(0.2)


def summarize(results: list[tuple[str, dict]]) -> list[dict]:
    rows = []
    for tier in ("priority", "default", "flex"):
        mine = [r for t, r in results if t == tier]
        admitted = [r for r in mine if r["outcome"] == "admitted"]
        ttft_ms, tpot_ms = SLO_MS[tier]
        met = [r for r in admitted if r["ttft"] * 1000 <= ttft_ms and r["tpot"] * 1000 <= tpot_ms]
        ttfts = sorted(r["ttft"] for r in admitted)
        rows.append({"class": tier, "offered": len(mine), "admitted": len(admitted),
                     "shed": sum(r["outcome"] == "shed" for r in mine),
                     # of those, ended unstarted at their queue timeout by a worker (the rest: the router's queue)
                     "shed_by_worker": sum(r["outcome"] == "shed" and "this worker's queue" in r["why"] for r in mine),
                     "errors": sum(r["outcome"] == "error" for r in mine),
                     "lost": sum(r["outcome"] == "lost" for r in mine),
                     "why": sorted({r.get("why", "") for r in mine if r["outcome"] in ("lost", "error")})[:5],
                     "attainment": len(met) / len(admitted) if admitted else None,
                     "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
                     "slo_ms": [ttft_ms, tpot_ms]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="each worker's running cap (default 4)")
    p.add_argument("--duration-s", type=float, default=120.0, help="seconds of overload (default 120)")
    p.add_argument("--overload", type=float, default=2.0, help="offered rate / measured capacity (default 2)")
    p.add_argument("--mix", default="0.2,0.4,0.4", help="shares of gold (priority), silver (default), bronze "
                                                        "(flex) requests (default 0.2,0.4,0.4)")
    p.add_argument("--capacity-s", type=float, default=20.0, help="seconds of the capacity measurement (default 20)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and prompts (default 0)")
    p.add_argument("--result-dir", default="docs/bench/soak", help="where soak.json and soak.png go")
    p.add_argument("--worker-nice", type=int, default=10,
                   help="the workers' niceness (default 10). On one machine the router and this client share "
                        "the cores with the workers, which starve them at 2x overload; a deployment gives the "
                        "router cores of its own, and a lower priority for the workers stands in for that. 0: "
                        "all equal (priority's TTFT then includes the router's wait for a core)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    keys = {tenant: f"sk-soak-{tenant}" for tenant in TENANTS}
    (work / "keys").write_text("".join(f"{t} {k}\n" for t, k in keys.items()))
    slo = "".join(f"    {tier}: {{ttft_ms: {t}, tpot_ms: {o}}}\n" for tier, (t, o) in SLO_MS.items())
    (work / "cluster.yaml").write_text("auth:\n  tenants:\n    gold: {service_tiers: [priority, default, flex]}\n"
                                       f"router:\n  slo:\n{slo}")
    redis = RedisServer(redis_binary())
    redis.start()
    common = ["--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--num-threads", "1", "--no-load-progress",
              "--redis", redis.url(), "--heartbeat-s", "0.2", "--num-kv-blocks", "256",
              "--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", "priority"]
    workers = [start_worker("decode", common) for _ in range(args.decode)]

    def nice(worker) -> None:
        if args.worker_nice:
            os.setpriority(os.PRIO_PROCESS, worker.process.pid, args.worker_nice)

    for w in workers:
        nice(w)
    router = None
    try:
        wait_ready(workers, timeout_s=300)
        router, url = start_router([], MODEL, "--redis", redis.url(), "--config", str(work / "cluster.yaml"),
                                   "--api-keys-file", str(work / "keys"),
                                   "--max-concurrent-requests", str(args.decode * args.max_num_seqs * 2),
                                   "--queue-size", "32", "--queue-timeout-s", "15", ready=False)
        while len([w for w in httpx.get(url + "/ready", timeout=5).json()["workers"] if w["healthy"]]) < args.decode:
            time.sleep(0.2)
        cap = asyncio.run(capacity(url, keys, args.decode * args.max_num_seqs, args.capacity_s))
        rate = args.overload * cap
        print(f"capacity {cap:.2f} req/s; offering {rate:.2f} req/s for {args.duration_s:.0f} s", flush=True)
        sampler = Sampler({"router": router.pid, **{f"worker{i}": w.pid for i, w in enumerate(workers[1:], 1)}})
        sampler.start()
        events = []

        def kill_and_replace(_at):
            victim = workers[0]
            victim.process.send_signal(signal.SIGKILL)
            events.append(("decode worker killed", time.monotonic()))
            workers.append(start_worker("decode", common))
            nice(workers[-1])
            wait_ready(workers[-1:], timeout_s=300)
            events.append(("replacement ready", time.monotonic()))
            sampler.pids["replacement"] = workers[-1].process.pid

        def restart_redis(_at):
            redis.stop()
            events.append(("redis stopped", time.monotonic()))
            time.sleep(2.0)  # the gap a restart leaves (the routers' and workers' grace covers it)
            redis.start()
            events.append(("redis started", time.monotonic()))

        results = asyncio.run(overload(url, keys, rate, args, [(0.3, kill_and_replace), (0.6, restart_redis)]))
        sampler.stop.set()
        sampler.join()
        leftovers = settle(Cluster(url, workers[1:], router, MODEL))
        metrics = httpx.get(url + "/metrics", timeout=5, headers={"Authorization": f"Bearer {keys['gold']}"}).text
    finally:
        router_stop_s = None  # how long the router took to stop on SIGTERM; None: it had to be killed
        if router is not None:
            router.send_signal(signal.SIGTERM)
            asked = time.monotonic()
            try:
                router.wait(30)
                router_stop_s = time.monotonic() - asked
            except subprocess.TimeoutExpired:
                print("the router did not stop within 30 s of SIGTERM; killing it", file=sys.stderr, flush=True)
                router.kill()
                router.wait()
        stop_workers([w for w in workers if w.process.poll() is None], grace_s=10)
        redis.stop()

    rows = summarize(results)
    growth = {name: sampler.growth(name) for name in sampler.pids}
    report = {"cpu": describe_cpu(), "args": vars(args), "capacity_rps": cap, "offered_rps": rate, "classes": rows,
              "rss_growth": growth, "leftovers": leftovers,
              "router_stop_s": router_stop_s,
              "router_slo_lines": [line for line in metrics.splitlines() if line.startswith("pdserve_router_slo")],
              "events": events}
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    plot(sampler, out / "soak.png")


def print_table(report: dict) -> None:
    print(f"\n{report['cpu']}")
    print(f"capacity {report['capacity_rps']:.2f} req/s, offered {report['offered_rps']:.2f} req/s\n")
    print("| class | offered | admitted | shed (429) | of them by a worker | errors | lost | SLO (TTFT / TPOT ms) | "
          "attainment | TTFT p90 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["classes"]:
        att = "-" if r["attainment"] is None else f"{r['attainment']:.0%}"
        p90 = "-" if r["ttft_p90_s"] is None else f"{r['ttft_p90_s']:.2f} s"
        print(f"| {r['class']} | {r['offered']} | {r['admitted']} | {r['shed']} | {r['shed_by_worker']} | "
              f"{r['errors']} | {r['lost']} | "
              f"{r['slo_ms'][0]} / {r['slo_ms'][1]} | {att} | {p90} |")
    growth = ", ".join(f"{k} {'-' if v is None else f'{v:+.1%}'}" for k, v in report["rss_growth"].items())
    print(f"\nRSS growth, last quarter over second: {growth}")
    print(f"after the run: {report['leftovers']}")


def plot(sampler: Sampler, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in sampler.pids:
        points = [(t, s[name] / 1024) for t, s in sampler.samples if s.get(name)]
        if points:
            ax.plot(*zip(*points), label=name)
    ax.set_xlabel("seconds into the overload")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("soak: memory under 2x overload, a worker killed, Redis restarted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
