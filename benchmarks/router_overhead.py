"""What the router adds: latency through the router versus calling the worker's gRPC directly.

    python benchmarks/router_overhead.py                    # overhead at 64 streams + capacity sweep
    python benchmarks/router_overhead.py --model smollm2-135m-instruct   # overhead with the real engine

Part 1, overhead: the same requests from 64 concurrent closed-loop clients (each sends its next
request when the last one ends; their starts are staggered, so arrivals are spread as in a
steady state) to the worker's gRPC directly, then through the router's HTTP API; TTFT and
end-to-end latency percentiles of both, and what the router adds. By default the worker is the
timing-only stand-in (``pdserve worker timing-only``: fake tokens at a fixed rate, each stamped
with its send time), so both paths see identical worker timings; ``--model`` uses a real decode
worker instead.

Part 2, capacity (timing-only worker): 256 concurrent closed-loop streams at rising token
rates; for each, the delay from the worker stamping a token to the client receiving it,
directly and through the router, after a warm-up second. The router's capacity is the highest
relayed tokens/s at which it adds at most 5 ms at p99. Client, router and worker share this
machine's cores (in part 1 the router gets a core of its own: see --pin).

Prints tables, writes JSON and a PNG plot to --result-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench.http import HTTPClient  # noqa: E402
from pdserve.bench.timing_worker import parse_stamps  # noqa: E402
from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready  # noqa: E402
from pdserve.proto.v1 import worker_pb2 as pb  # noqa: E402
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc  # noqa: E402
from tests.integration.conftest import start_router  # noqa: E402

PROMPT = list(range(100, 164))
_ALL_CORES = os.sched_getaffinity(0)


class Result:
    def __init__(self):
        self.ttft, self.e2e, self.delay, self.tokens, self.wall = [], [], [], 0, 0.0
        self.received: list[float] = []  # perf_counter of every token-bearing message


async def direct_stream(stub, i: int, max_tokens: int, res: Result) -> None:
    req = pb.GenerateRequest(request_id=f"d{i}-{time.monotonic_ns()}", prompt_token_ids=PROMPT,
                             sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=max_tokens,
                                                        ignore_eos=True, repetition_penalty=1))
    t0 = time.perf_counter()
    first = None
    async for msg in stub.Generate(req):
        now = time.perf_counter()
        if msg.token_ids:
            first = first or now
            res.tokens += len(msg.token_ids)
            res.received.append(now)
            if msg.text.startswith("<t="):
                res.delay += [time.time() - (time.perf_counter() - now) - s for s in parse_stamps(msg.text)]
    res.ttft.append(first - t0)
    res.e2e.append(time.perf_counter() - t0)


async def router_stream(client: HTTPClient, model: str, max_tokens: int, res: Result) -> None:
    body = orjson.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "stream": True})
    t0 = time.perf_counter()
    first = None
    async for now, data in client.stream_events("/v1/completions", body):
        if data is None:
            t0 = now  # when the request was written
            continue
        if data == b"[DONE]":
            continue
        text = orjson.loads(data)["choices"][0]["text"]
        if text:
            first = first or now
            res.tokens += 1
            res.received.append(now)
            if text.startswith("<t="):
                res.delay += [time.time() - (time.perf_counter() - now) - s for s in parse_stamps(text)]
    res.ttft.append(first - t0)
    res.e2e.append(time.perf_counter() - t0)


async def closed_loop(send_one, clients: int, duration: float, stagger: float, res: Result) -> float:
    """``clients`` loops, each sending its next request when the last ends, until ``duration``;
    starts spread over ``stagger`` seconds. Requests starting in the first second are warm-up."""
    t_start = res.t_start = time.perf_counter()

    async def client(i: int) -> None:
        await asyncio.sleep(stagger * i / clients)
        while time.perf_counter() - t_start < duration:
            target = res if time.perf_counter() - t_start > 1.0 else Result()
            await send_one(target)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return time.perf_counter() - t_start


async def run_direct(address: str, clients: int, max_tokens: int, duration: float, stagger: float) -> Result:
    res = Result()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        await direct_stream(stub, -1, 2, Result())  # warm-up
        res.wall = await closed_loop(lambda r: direct_stream(stub, 0, max_tokens, r), clients, duration, stagger, res)
    return res


async def run_router(url: str, model: str, clients: int, max_tokens: int, duration: float, stagger: float) -> Result:
    res = Result()
    async with HTTPClient(url) as client:
        await asyncio.gather(*(client.request("GET", "/health") for _ in range(clients)))  # open the connections
        res.wall = await closed_loop(lambda r: router_stream(client, model, max_tokens, r), clients, duration,
                                     stagger, res)
    return res


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def start_cluster(worker_args: list[str], role: str, pin: bool) -> tuple[list, subprocess.Popen, str, str]:
    workers = [start_worker(role, ["--host", "127.0.0.1", "--port", "0", *worker_args])]
    wait_ready(workers, timeout_s=300)
    router, url = start_router([workers[0].address], "smollm2-135m-instruct", "--max-concurrent-requests", "4096")
    cores = sorted(os.sched_getaffinity(0))
    if pin and len(cores) >= 2:  # the router on a core of its own; worker and client share the rest
        _pin_tree(router.pid, {cores[0]})
        _pin_tree(workers[0].pid, set(cores[1:]))
        os.sched_setaffinity(0, set(cores[1:]))
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return workers, router, url, model


def _pin_tree(pid: int, cores: set[int]) -> None:
    """Pin a process and all its threads (gRPC starts some) to ``cores``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def stop_cluster(workers, router) -> None:
    router.terminate()
    router.wait(30)
    stop_workers(workers, grace_s=10)
    os.sched_setaffinity(0, _ALL_CORES)


def overhead(args) -> dict:
    if args.model:
        worker_args, role = ["--model", args.model, "--no-load-progress"], "decode"
    else:
        worker_args, role = ["--tokens-per-s", str(args.tokens_per_s)], "timing-only"
    workers, router, url, model = start_cluster(worker_args, role, args.pin)
    try:
        stagger = args.max_tokens / args.tokens_per_s if not args.model else 2.0
        direct = asyncio.run(run_direct(workers[0].address, args.streams, args.max_tokens, args.duration, stagger))
        routed = asyncio.run(run_router(url, model, args.streams, args.max_tokens, args.duration, stagger))
    finally:
        stop_cluster(workers, router)
    rows = []
    for name, key in (("TTFT", "ttft"), ("end-to-end", "e2e")):
        d, r = getattr(direct, key), getattr(routed, key)
        for q in (50, 90, 99):
            rows.append({"metric": name, "pct": q, "direct_ms": pct(d, q), "router_ms": pct(r, q),
                         "added_ms": pct(r, q) - pct(d, q)})
    print(f"\nPart 1: {args.streams} concurrent closed-loop streams x {args.max_tokens} tokens for "
          f"{args.duration:g} s ({len(direct.ttft)} direct and {len(routed.ttft)} routed requests), worker: "
          f"{args.model or f'timing-only at {args.tokens_per_s:g} tokens/s per stream'}")
    print("metric | percentile | direct gRPC (ms) | through router (ms) | router adds (ms)")
    print("--- | --- | --- | --- | ---")
    for row in rows:
        print(f"{row['metric']} | p{row['pct']} | {row['direct_ms']:.2f} | {row['router_ms']:.2f} | "
              f"{row['added_ms']:+.2f}")
    keep = ("ttft", "e2e")
    return {"rows": rows, "direct": {k: getattr(direct, k) for k in keep},
            "router": {k: getattr(routed, k) for k in keep}}


def capacity(args) -> list[dict]:
    rows = []
    print(f"\nPart 2: router capacity, {args.capacity_streams} concurrent streams, timing-only worker")
    print("tokens/s per stream | offered tokens/s | relayed tokens/s | direct p50 / p99 (ms) | "
          "router p50 / p99 (ms) | router adds at p99 (ms)")
    print("--- | --- | --- | --- | --- | ---")
    for rate in args.rates:
        n_tokens = max(8, int(rate * args.capacity_seconds))
        stagger = n_tokens / rate
        workers, router, url, model = start_cluster(["--tokens-per-s", str(rate)], "timing-only", args.pin_capacity)
        try:
            direct = asyncio.run(run_direct(workers[0].address, args.capacity_streams, n_tokens, args.duration,
                                            stagger))
            routed = asyncio.run(run_router(url, model, args.capacity_streams, n_tokens, args.duration, stagger))
        finally:
            stop_cluster(workers, router)
        window = [t for t in routed.received if 1.0 <= t - routed.t_start <= args.duration]
        row = {"rate": rate, "offered": rate * args.capacity_streams, "relayed": len(window) / (args.duration - 1.0),
               "direct_p50": pct(direct.delay, 50), "direct_p99": pct(direct.delay, 99),
               "router_p50": pct(routed.delay, 50), "router_p99": pct(routed.delay, 99)}
        row["added_p99"] = row["router_p99"] - row["direct_p99"]
        rows.append(row)
        print(f"{rate:g} | {row['offered']:.0f} | {row['relayed']:.0f} | {row['direct_p50']:.2f} / "
              f"{row['direct_p99']:.2f} | {row['router_p50']:.2f} / {row['router_p99']:.2f} | {row['added_p99']:+.2f}")
    ok = [r for r in rows if r["added_p99"] <= 5.0]
    best = max((r["relayed"] for r in ok), default=0.0)
    print(f"\nrouter capacity (router adds <= 5 ms at p99): {best:.0f} tokens/s")
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, key in (("direct gRPC", "direct"), ("through router", "router")):
        xs = np.sort(np.asarray(result["overhead"][key]["ttft"]) * 1e3)
        axes[0].plot(xs, np.linspace(0, 1, len(xs)), label=label)
    axes[0].set_xlabel("TTFT (ms)")
    axes[0].set_ylabel("fraction of requests")
    axes[0].set_title("TTFT CDF, 64 closed-loop streams")
    axes[0].legend()
    cap = result.get("capacity") or []
    if cap:
        axes[1].plot([r["relayed"] for r in cap], [r["added_p99"] for r in cap], "o-")
        axes[1].axhline(5.0, ls="--", c="k", lw=1)
        axes[1].set_xlabel("relayed tokens/s")
        axes[1].set_ylabel("router adds at p99 (ms)")
        axes[1].set_title("router capacity, 256 closed-loop streams")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="use a real decode worker with this model (default: timing-only)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams in part 1 (default: 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request in part 1 (default: 32)")
    p.add_argument("--tokens-per-s", type=float, default=20.0,
                   help="timing-only worker's rate per stream in part 1 (default: 20)")
    p.add_argument("--capacity-streams", type=int, default=256, help="streams in part 2 (default: 256)")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[10, 20, 40, 60],
                   help="tokens/s per stream to try in part 2 (default: 10,20,40,60)")
    p.add_argument("--capacity-seconds", type=float, default=2.0, help="length of each part-2 stream (default: 2)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds each measured phase runs (default: 10)")
    p.add_argument("--skip-capacity", action="store_true", help="run part 1 only")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="part 1: pin the router to a core of its own, the worker and client to the others "
                        "(default: on)")
    p.add_argument("--pin-capacity", action=argparse.BooleanOptionalAction, default=False,
                   help="part 2 likewise (default: off; at 10,000 tokens/s the worker and client need more "
                        "than one core of a 2-core machine)")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    args = p.parse_args()
    result = {"overhead": overhead(args)}
    if not args.skip_capacity and not args.model:
        result["capacity"] = capacity(args)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_overhead.json").write_text(json.dumps(result))
    plot(result, out / "router_overhead.png")
    print(f"\nwrote {out / 'router_overhead.json'} and {out / 'router_overhead.png'}")


if __name__ == "__main__":
    import uvloop

    uvloop.install()
    main()
