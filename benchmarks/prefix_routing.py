"""Cache-aware routing against load-based routing on the same requests (issue 14, Performance).

    python benchmarks/prefix_routing.py                 # SmolLM2-135M, the full workloads (long)
    python benchmarks/prefix_routing.py --quick         # the tiny random model, small workloads (a minute or two)
    python benchmarks/prefix_routing.py --decision-only # the decision's time with 64 workers

Each run: a fresh cluster of 1 prefill + 4 decode workers (`--prefill`, `--decode`) publishing KV
events to a real Redis, one router reading it (`--policy` each of cache_aware, least_loaded,
round_robin), every worker with `--num-kv-blocks` set so that the workload's working set does not
fit one worker. Workloads
(prompts as token ids, sent to /v1/completions, streamed):
  (a) tenants: `--tenants` system prompts of `--system-tokens` tokens, each request one of them
      plus a short question, Poisson arrivals at `--rate`;
  (b) multi-turn: `--users` concurrent users, each holding `--conversations` conversations of
      `--turns` turns one after another; a turn
      re-sends the previous turn's prompt, a stand-in for the answer (`--answer-tokens`) and a
      new question (the bench's chat workload renders its answers through the chat template;
      here the growing context is explicit token ids, so the oracle below is exact). By default a
      closed loop: each turn as soon as the previous answer arrives, so each policy sets its own
      rate and latency mostly mirrors throughput (Little's law). `--chat-rate R` paces it instead:
      each user sends its turns at its own Poisson times, R turns a second over all users, a turn
      whose previous answer has not arrived waiting for it (a user reads before replying); while
      a cluster keeps up, every policy serves the same requests at the same times.
With `--routers 2`, one more row: cache_aware with two routers reading one index through the same
Redis, requests alternating between them (a user's turns too).
Prefix hit rate = sum of `usage.prompt_tokens_details.cached_tokens` / sum of prompt tokens.
Oracle = the same requests on one colocated worker with room for everything (measured the same
way). TTFT p50/p90 and throughput (requests/s, output tokens/s) per policy.

Prints a table headed by the CPU; writes prefix_routing.json and prefix_routing.png to --result-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready  # noqa: E402
from pdserve.engine.cpu_isa import describe_cpu  # noqa: E402
from pdserve.prefix_hash import block_hashes  # noqa: E402
from tests.integration.conftest import start_router  # noqa: E402
from tests.redis_server import RedisServer, redis_binary  # noqa: E402

BLOCK = 16
POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass
class Request:
    at: float  # seconds after the start (multi-turn: or the user's previous answer, the later; -1: at the answer)
    prompt: list[int]
    user: int = -1
    max_tokens: int = 16


@dataclass
class Result:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    error: str = ""  # empty: answered in full

    @property
    def ok(self) -> bool:
        return not self.error


# ---- workloads --------------------------------------------------------------------------------

def tenants_workload(args, rng: random.Random) -> list[Request]:
    systems = [ids(rng, args.system_tokens) for _ in range(args.tenants)]
    at, out = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        out.append(Request(at, rng.choice(systems) + ids(rng, rng.randint(10, 40)), max_tokens=args.output_tokens))
    return out


def chat_workload(args, rng: random.Random) -> list[Request]:
    """Each user holds ``--conversations`` conversations one after another (so that the working set,
    every conversation, outgrows what the users have in flight at once); its turns at its own Poisson
    times, ``--chat-rate`` over all users (their own generator: the prompts do not depend on it)."""
    clock = random.Random(f"{args.seed}/chat-times")
    out = []
    for user in range(args.users):
        at = 0.0
        for _ in range(args.conversations):
            context = ids(rng, args.system_tokens // 4)
            for _ in range(args.turns):
                context = context + ids(rng, rng.randint(20, 60))
                at = at + clock.expovariate(args.chat_rate / args.users) if args.chat_rate > 0 else -1
                out.append(Request(at, context, user, args.output_tokens))
                context = context + ids(rng, args.answer_tokens)
    return out


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def working_set_blocks(requests: list[Request]) -> int:
    """Distinct prompt blocks (chained hashes, as the workers' caches tell them apart)."""
    return len({h for r in requests for h in block_hashes(r.prompt, "bench", BLOCK)})


# ---- the client -------------------------------------------------------------------------------

async def one(client: httpx.AsyncClient, url: str, model: str, r: Request) -> Result:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started, first, use = time.perf_counter(), None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Result(0, 0, len(r.prompt), 0, 0, f"{resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):  # the first token (its text may be held back)
                    first = time.perf_counter()
                use = chunk.get("usage") or use
    except httpx.HTTPError as e:
        return Result(0, 0, len(r.prompt), 0, 0, repr(e))
    end = time.perf_counter()
    if use is None or first is None:
        return Result(0, end - started, len(r.prompt), 0, 0, "no token or no usage in the stream")
    return Result(first - started, end - started, use["prompt_tokens"],
                  use["prompt_tokens_details"]["cached_tokens"], use["completion_tokens"])


async def drive(urls: list[str], model: str, requests: list[Request]) -> tuple[list[Result], float]:
    """Tenants: each request at its arrival time. Multi-turn: each user's turns one after another, each
    at its time or at the previous answer, the later.
    With several routers the requests alternate between them (a user's turns too), so a router
    routes prefixes that the other one's requests put on the workers."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        t0 = time.perf_counter()

        async def at_time(i: int, r: Request) -> Result:
            await asyncio.sleep(max(0.0, t0 + r.at - time.perf_counter()))
            return await one(client, urls[i % len(urls)], model, r)

        async def user(turns: list[Request]) -> list[Result]:
            results = []
            for t, r in enumerate(turns):
                await asyncio.sleep(max(0.0, t0 + r.at - time.perf_counter()))
                results.append(await one(client, urls[(r.user + t) % len(urls)], model, r))
            return results

        if requests[0].user < 0:
            results = await asyncio.gather(*(at_time(i, r) for i, r in enumerate(requests)))
        else:
            users = sorted({r.user for r in requests})
            per_user = await asyncio.gather(*(user([r for r in requests if r.user == u]) for u in users))
            results = [x for xs in per_user for x in xs]
        return list(results), time.perf_counter() - t0


# ---- clusters ---------------------------------------------------------------------------------

def run_policy(args, policy: str, requests: list[Request], kv_blocks: int, oracle: bool = False,
               routers: int = 1) -> dict:
    redis = RedisServer(redis_binary())
    redis.start()
    common = ["--host", "127.0.0.1", "--port", "0", "--model", args.model, "--num-threads", "1",
              "--no-load-progress", "--redis", redis.url(), "--heartbeat-s", "0.2"]
    roles = ["decode"] if oracle else ["prefill"] * args.prefill + ["decode"] * args.decode
    blocks = 4 * kv_blocks * args.decode if oracle else kv_blocks
    workers = [start_worker(role, [*common, "--num-kv-blocks", str(blocks)]) for role in roles]
    started: list = []
    try:
        wait_ready(workers, timeout_s=600)
        for _ in range(routers):  # several: one index, through the same Redis
            started.append(start_router([], args.model, "--redis", redis.url(), "--policy", policy,
                                        "--max-concurrent-requests", "4096", *args.router_flags.split()))
        urls = [url for _, url in started]
        wait_until(lambda: all(len(healthy(url)) == len(workers) for url in urls), 60)
        model = httpx.get(urls[0] + "/v1/models", timeout=5).json()["data"][0]["id"]
        results, duration = asyncio.run(drive(urls, model, requests))
        metrics = [httpx.get(url + "/metrics", timeout=5).text for url in urls]
        per_worker = [worker_stats(w.address) for w in workers]
    finally:
        for router, _ in started:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        stop_workers(workers, grace_s=10)
        redis.stop()
    name = "oracle" if oracle else policy if routers == 1 else f"{policy} x{routers}"
    return {**summarize(name, results, duration, metrics), "workers": per_worker}


def worker_stats(address: str) -> dict:
    """What a worker did over the run (its own Stats): where the prompt compute and the KV pressure went."""
    import grpc

    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        s = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
    return {"role": s.role, "prompt_tokens": s.prompt_tokens_total, "prefix_hits": s.prefix_cache_hits,
            "prefix_queries": s.prefix_cache_queries, "generation_tokens": s.generation_tokens_total,
            "preemptions": s.num_preemptions}


def healthy(url: str) -> list:
    try:
        return [w for w in httpx.get(url + "/ready", timeout=5).json()["workers"] if w["healthy"]]
    except httpx.HTTPError:
        return []


def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not list every worker")
        time.sleep(0.2)


def metric(text: str, name: str, label: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


def decision_quantile(text: str, q: float) -> float | None:
    """A quantile of the decode decision's time from the router's histogram (bucket upper bound)."""
    rows = [(float(line.split('le="')[1].split('"')[0]), float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("pdserve_router_routing_decision_seconds_bucket") and 'step="decode"' in line]
    if not rows or rows[-1][1] == 0:
        return None
    total = rows[-1][1]
    return next(le for le, n in sorted(rows) if n >= q * total)


def summarize(policy: str, results: list[Result], duration: float, metrics: list[str]) -> dict:
    """One policy's row; counters summed over its routers, the decision's p99 the worst of theirs."""
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "policy": policy, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p90_s": quantile(ttfts, 0.9),
        "requests_per_s": len(ok) / duration, "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "hit_rate": sum(r.cached_tokens for r in ok) / max(prompt, 1),
        "predicted_cached": sum(metric(m, "pdserve_router_cached_tokens_total", 'source="predicted"') for m in metrics),
        "actual_cached": sum(metric(m, "pdserve_router_cached_tokens_total", 'source="actual"') for m in metrics),
        "remote_prefills": sum(metric(m, "pdserve_router_prefill_decisions_total", 'outcome="remote"')
                               for m in metrics),
        "decisions": decisions(metrics),
        "decision_p99_s": max((q for m in metrics if (q := decision_quantile(m, 0.99)) is not None), default=None),
        "ttfts": ttfts,
    }


def decisions(metrics: list[str]) -> dict[str, float]:
    """Where prompts were prefilled, by the router's outcome label, summed over its routers."""
    out: dict[str, float] = {}
    for text in metrics:
        for line in text.splitlines():
            if line.startswith("pdserve_router_prefill_decisions_total{"):
                outcome = line.split('outcome="')[1].split('"')[0]
                out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ---- the decision alone -----------------------------------------------------------------------

def decision_only() -> dict:
    from pdserve.router.cost import CostModel, RouteRequest
    from pdserve.router.policy import POLICIES as BY_NAME
    from pdserve.router.policy import WorkerLoad

    decode, _ = BY_NAME["cache_aware"](CostModel())
    rng = random.Random(0)
    times = []
    for _ in range(20000):
        loads = [WorkerLoad(f"w{i}", rng.randrange(4), rng.randrange(8), 0, 0.5, rng.randrange(2000), 0, 40.0)
                 for i in range(64)]
        req = RouteRequest(2000, {f"w{i}": 16 * rng.randrange(100) for i in rng.sample(range(64), 8)}, 0.5)
        started = time.perf_counter()
        decode(loads, req)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"workers": 64, "p50_us": 1e6 * quantile(times, 0.5), "p99_us": 1e6 * quantile(times, 0.99),
            "p999_us": 1e6 * quantile(times, 0.999)}


# ---- main -------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny random model and small workloads (a smoke run)")
    p.add_argument("--decision-only", action="store_true", help="only time the cache_aware decision, 64 workers")
    p.add_argument("--model", default=None, help="default: smollm2-135m-instruct (random:tiny with --quick)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"routing policies compared, comma-separated (default {','.join(POLICIES)})")
    p.add_argument("--workloads", default="tenants,chat", help="tenants and/or chat, comma-separated (default both)")
    p.add_argument("--decode", type=int, default=4,
                   help="decode workers behind the router (default 4)")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers behind the router (default 1; 0: every prompt prefilled on its decode "
                        "worker, so the decode choice decides every hit)")
    p.add_argument("--tenants", type=int, default=16,
                   help="tenants workload: tenants, each with its own system prompt (default 16)")
    p.add_argument("--system-tokens", type=int, default=1000,
                   help="tenants: tokens of each system prompt (default 1000)")
    p.add_argument("--requests", type=int, default=None, help="tenants workload (default 160; 48 with --quick)")
    p.add_argument("--rate", type=float, default=None, help="tenants: requests/s (default 0.5; 8 with --quick)")
    p.add_argument("--users", type=int, default=8, help="chat: concurrent users (default 8)")
    p.add_argument("--chat-rate", type=float, default=0.0,
                   help="chat: turns/s over all users, each user's at its own Poisson times, a turn not before "
                        "the previous answer (default 0: a closed loop, each turn at the previous answer)")
    p.add_argument("--turns", type=int, default=None, help="default 6; 3 with --quick")
    p.add_argument("--conversations", type=int, default=None, help="per user, one after another (default 4; 3 "
                                                                      "with --quick)")
    p.add_argument("--answer-tokens", type=int, default=64,
                   help="chat: tokens standing in for each answer in the next turn's context (default 64)")
    p.add_argument("--output-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--kv-fraction", type=float, default=0.4,
                   help="each worker's KV blocks as a fraction of the working set's")
    p.add_argument("--routers", type=int, default=1,
                   help="N > 1 adds a row: cache_aware with N routers sharing one Redis, requests alternating "
                        "between them (its hit rate against one router's; default 1, no such row)")
    p.add_argument("--router-flags", default="", help="more flags for every router, e.g. '--cost-interference 1'")
    p.add_argument("--no-oracle", action="store_true",
                   help="leave out the oracle row (one worker with room for everything): a shorter run")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)")
    p.add_argument("--result-dir", default="docs/bench/prefix_routing",
                   help="where prefix_routing.json and .png go (default docs/bench/prefix_routing)")
    args = p.parse_args()
    args.model = args.model or ("random:tiny" if args.quick else "smollm2-135m-instruct")
    args.requests = args.requests or (48 if args.quick else 160)
    args.rate = args.rate or (8.0 if args.quick else 0.5)
    args.turns = args.turns or (3 if args.quick else 6)
    args.conversations = args.conversations or (3 if args.quick else 4)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the clusters on the way out
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {describe_cpu()}")
    report: dict = {"cpu": describe_cpu(), "args": vars(args)}
    if args.decision_only:
        report["decision"] = d = decision_only()
        print(f"cache_aware decision, 64 workers: p50 {d['p50_us']:.1f} us, p99 {d['p99_us']:.1f} us, "
              f"p99.9 {d['p999_us']:.1f} us")
        (out / "prefix_routing_decision.json").write_text(json.dumps(report, indent=1))
        return
    build = {"tenants": tenants_workload, "chat": chat_workload}
    report["workloads"] = {}
    for name in args.workloads.split(","):
        requests = build[name](args, random.Random(args.seed))
        kv_blocks = max(64, int(args.kv_fraction * working_set_blocks(requests)))
        rows = [run_policy(args, policy, requests, kv_blocks) for policy in args.policies.split(",")]
        if args.routers > 1:
            rows.append(run_policy(args, "cache_aware", requests, kv_blocks, routers=args.routers))
        if not args.no_oracle:
            rows.append(run_policy(args, "least_loaded", requests, kv_blocks, oracle=True))
        report["workloads"][name] = {"kv_blocks_per_worker": kv_blocks, "rows": rows}
        print_table(name, kv_blocks, rows)
    (out / "prefix_routing.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "prefix_routing.png")
    print(f"wrote {out / 'prefix_routing.json'} and {out / 'prefix_routing.png'}")


def print_table(name: str, kv_blocks: int, rows: list[dict]) -> None:
    oracle = rows[-1]["hit_rate"] if rows[-1]["policy"] == "oracle" else float("nan")
    print(f"\nworkload {name}: {kv_blocks} KV blocks per worker")
    print(f"{'policy':<15} {'ok/all':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>6} {'out tok/s':>9} "
          f"{'hit rate':>8} {'of oracle':>9} {'remote':>6} {'decide p99':>10}")
    for r in rows:
        ttft = "" if r["policy"] == "oracle" else f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s"
        p99 = f"{r['decision_p99_s'] * 1e6:.0f} us" if r["decision_p99_s"] else "-"
        print(f"{r['policy']:<15} {r['requests'] - r['failed']:>4}/{r['requests']:<3} {ttft:>19} "
              f"{r['requests_per_s']:>6.2f} {r['output_tokens_per_s']:>9.1f} {r['hit_rate']:>8.1%} "
              f"{r['hit_rate'] / max(oracle, 1e-9):>9.1%} {r['remote_prefills']:>6.0f} {p99:>10}")
    for r in (r for r in rows if r.get("workers")):  # where the compute and the KV pressure went
        where = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.get("decisions", {}).items()))
        work = "; ".join(f"{w['role']} {w['prompt_tokens'] - w['prefix_hits']} not cached, {w['preemptions']} preempted"
                         for w in r.get("workers", []))
        print(f"  {r['policy']}: prefill decisions: {where or '-'}; prompt tokens per worker: {work}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r in report["workloads"][name]["rows"]:
            if r["policy"] == "oracle" or not r["ttfts"]:
                continue
            xs = r["ttfts"]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))],
                    label=f"{r['policy']} (hit {r['hit_rate']:.0%})")
        last = report["workloads"][name]["rows"][-1]
        oracle = f" (oracle hit {last['hit_rate']:.0%})" if last["policy"] == "oracle" else ""
        ax.set_title(f"{name}: TTFT CDF{oracle}")
        ax.set_xlabel("TTFT (s)")
        ax.set_xscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
