"""Autoscaling on Ray Serve: a load step from idle to a rate one decode replica cannot hold, and back.

    python benchmarks/autoscale.py                       # the default model, about 5 minutes
    python benchmarks/autoscale.py --model random:tiny   # the mechanics only, faster

1. Ray's overhead: the same sequential requests against `pdserve serve --launcher processes` (plain
   worker processes, the router under uvicorn) and against the Ray-launched cluster (Serve's HTTP proxy,
   the Router replica, worker replicas), each idle at one prefill and one decode worker.
2. The step: Poisson arrivals at --rate for --step-s seconds against the Ray cluster, whose decode pool
   autoscales (min 1, max --max-replicas, target --target-running running requests per replica); the
   prefill pool is fixed. Then the load stops and the pool scales back down.

Reported: the time from the step to a new decode replica serving traffic (in the router's rotation and
having generated tokens), TTFT/TPOT p90 before (the idle run), during (step -> new replica serving) and
after (new replica serving -> end of the step), scale events (changes of running replicas per pool),
and requests lost (failed or cut short; must be 0). Writes JSON and a PNG (replicas and latency over
time) to --result-dir. Everything on 127.0.0.1; Ray is started here and stopped at the end.

With ``--sim-profile PATH`` (a latency profile of the workers' engine: one thread, this machine; e.g. the
one ``benchmarks/sim_validate.py`` writes), the step is also simulated (issue 17's validation): the same
cluster file through ``SimConfig.from_serve``, the step's own requests and arrival times, a new replica
serving the start-up time measured here (Ray's STARTING to RUNNING) after it is asked for, the autoscaler
deciding every --sim-interval-s; the decode pool's scale events, run and simulated, side by side, each
difference against the autoscaler's window for that direction.

    python benchmarks/autoscale.py --resimulate docs/bench/sim_validate/autoscale_step.json \
        --sim-profile docs/bench/sim_validate/profile_1thread.json

simulates a recorded run's step again (its arguments, requests, arrival times and measured start-up time,
from its JSON) without Ray or a model server: for a change to the simulator, against the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.api import run_bench
from pdserve.bench.config import BenchConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy_workers(url: str) -> list[dict]:
    try:
        r = httpx.get(url + "/ready", timeout=2)
        return [w for w in r.json().get("workers", []) if w["healthy"]]
    except (httpx.HTTPError, ValueError):
        return []


def wait_workers(url: str, n: int, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while len(healthy_workers(url)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: fewer than {n} workers in rotation after {seconds} s")
        time.sleep(0.5)


def worker_tokens(address: str) -> int:
    import grpc

    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).generation_tokens_total


def bench_config(url: str, args, **overrides) -> BenchConfig:
    return BenchConfig(base_url=url, tokenizer=args.model, dataset_name="random", random_input_len=args.input_len,
                       random_output_len=args.output_len, seed=args.seed, result_dir=args.result_dir, **overrides)


def bench(url: str, args, **overrides):
    return asyncio.run(run_bench(bench_config(url, args, **overrides))).runs[0]["records"]


def p90_ms(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, 90) * 1e3) if values else None


def p50_ms(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, 50) * 1e3) if values else None


def fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def lost(records) -> int:
    """Requests that failed or came back short. A stream whose every token detokenized to nothing
    (random weights can do that; the harness calls it no_tokens) is complete when the server's usage
    counts every token."""
    def complete(r) -> bool:
        return (r.ok or r.error == "no_tokens") and r.output_tokens == r.requested_output_tokens
    return sum(1 for r in records if not complete(r))


def sequential(url: str, args) -> tuple[list, list]:
    """The idle runs: requests of the step's shape one at a time, then short ones (--overhead-output-len
    tokens: latency is mostly the path a request takes, what Ray's HTTP proxy and replica hop add to)."""
    shaped = bench(url, args, num_prompts=args.overhead_requests, max_concurrency=1, warmup_requests=2,
                   progress=False)
    short = bench(url, args, num_prompts=args.overhead_requests, max_concurrency=1, warmup_requests=2,
                  progress=False, max_output_len=args.overhead_output_len)
    return shaped, short


def plain_processes_run(args) -> tuple[list, list]:
    """The idle run against `pdserve serve --launcher processes` (one prefill, one decode worker)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.cli", "--log-level", "WARNING", "serve",
                             "--launcher", "processes", "--port", str(port), "--model", args.model,
                             "--num-threads", "1", "--prefill", "1"])  # (on < 4 cores it serves colocated by default)
    try:
        wait_workers(url, 2)
        return sequential(url, args)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def cluster_config(args, port: int) -> dict:
    return {
        "engine": {"model": args.model, "num_threads": 1},
        "router": {"port": port},
        "pools": {
            "prefill": {"replicas": 1, "num_cpus": 1},
            "decode": {"replicas": 1, "num_cpus": 1, "grace_s": 30, "autoscaling": {
                "min_replicas": 1, "max_replicas": args.max_replicas, "target_running_requests": args.target_running,
                "upscale_window_s": args.upscale_window_s, "downscale_window_s": args.downscale_window_s,
                "max_step": 1}},
        },
        "state_store": {"heartbeat_s": 0.5, "ttl_s": 2.0},
        "ray": {"num_cpus": 1 + args.max_replicas, "metrics_interval_s": 0.5},
    }


class Watcher(threading.Thread):
    """Running replicas per pool every 0.25 s, and when a new decode worker first generates tokens."""

    def __init__(self, url: str, app: str):
        super().__init__(daemon=True)
        self.url, self.app = url, app
        self.samples: list[tuple[float, int, int]] = []  # (time.time(), prefill, decode)
        self.decode_starting: list[tuple[float, int]] = []  # (time.time(), decode replicas STARTING)
        self.first_decode: set[str] = {w["worker_id"] for w in healthy_workers(url)}
        self.new_serving_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self.stop.is_set():
            deployments = serve.status().applications[self.app].deployments
            running = [deployments[d].replica_states.get("RUNNING", 0) for d in ("PrefillWorker", "DecodeWorker")]
            self.samples.append((time.time(), *running))
            self.decode_starting.append((time.time(), deployments["DecodeWorker"].replica_states.get("STARTING", 0)))
            if self.new_serving_at is None:
                for w in healthy_workers(self.url):
                    if w["worker_id"].startswith("decode-") and w["worker_id"] not in self.first_decode:
                        if worker_tokens(w["address"]) > 0:
                            self.new_serving_at = time.time()
            time.sleep(0.25)

    def events(self, column: int, since: float = 0.0, until: float = float("inf")) -> list[tuple[float, int]]:
        """(time, new count) each time the pool's running replicas changed."""
        out, last = [], None
        for s in self.samples:
            if last is not None and s[column] != last and since <= s[0] <= until:
                out.append((s[0], s[column]))
            last = s[column]
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: smollm2-135m-instruct)")
    p.add_argument("--rate", type=float, default=2.0, help="step load, requests per second (default: 2.0)")
    p.add_argument("--step-s", type=float, default=60.0, help="how long the step lasts (default: 60)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request (default: 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--max-replicas", type=int, default=2, help="decode pool's max_replicas (default: 2)")
    p.add_argument("--target-running", type=int, default=4,
                   help="decode pool's target_running_requests per replica (default: 4)")
    p.add_argument("--upscale-window-s", type=float, default=5.0, help="upscale_window_s (default: 5)")
    p.add_argument("--downscale-window-s", type=float, default=15.0, help="downscale_window_s (default: 15)")
    p.add_argument("--overhead-requests", type=int, default=20,
                   help="sequential requests of the idle run, per launcher (default: 20)")
    p.add_argument("--overhead-output-len", type=int, default=4,
                   help="output tokens of the short requests that measure Ray's overhead (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--sim-profile", default=None,
                   help="a latency profile (JSON, one thread, this machine) to simulate the step with and set "
                        "the scale events side by side (default: no simulation)")
    p.add_argument("--sim-interval-s", type=float, default=0.5,
                   help="with --sim-profile: how often the simulated autoscaler decides (default: 0.5, Ray's "
                        "metrics interval in this cluster)")
    p.add_argument("--resimulate", metavar="JSON", default=None,
                   help="no run: simulate again the step of a run this script recorded (its autoscale.json), with "
                        "--sim-profile (else the profile path it names), and write the JSON with the new simulation "
                        "to --result-dir")
    p.add_argument("--result-dir", default="bench-results", help="where JSON and PNG go (default: bench-results)")
    args = p.parse_args()
    if args.resimulate:
        resimulate(Path(args.resimulate), args.sim_profile, Path(args.result_dir))
        return
    if args.sim_profile:  # refused now, not after the run
        from pdserve.bench.latency_model import Profile

        Profile.load(args.sim_profile)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)

    print("1/3 idle run, plain processes ...", flush=True)
    plain, plain_short = plain_processes_run(args)

    from pdserve.cluster import ray_launcher
    from pdserve.cluster.config import load_serve_config

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = load_serve_config(None, cluster_config(args, port))
    print("2/3 idle run, Ray Serve ...", flush=True)
    started = ray_launcher.connect(config.ray)
    try:
        ray_launcher.check_placement(config)
        ray_launcher.run_app(config)
        wait_workers(url, 2)
        on_ray, ray_short = sequential(url, args)

        print(f"3/3 load step: {args.rate:g} req/s for {args.step_s:g} s, then quiet ...", flush=True)
        watcher = Watcher(url, config.ray.app_name)
        watcher.start()
        step_at = time.time()
        step_config = bench_config(url, args, request_rate=args.rate, duration=args.step_s, num_prompts=100000,
                                   progress=False)
        step = asyncio.run(run_bench(step_config)).runs[0]["records"]
        step_end = time.time()
        deadline = time.monotonic() + args.downscale_window_s + 90
        while watcher.samples[-1][2] > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
        watcher.stop.set()
        watcher.join(10)
    finally:
        ray_launcher.shutdown(config, started)

    serving = watcher.new_serving_at
    during = [r for r in step if r.start_wall < (serving or float("inf"))]
    after = [r for r in step if serving is not None and r.start_wall >= serving]
    decode_events = watcher.events(2, since=step_at)
    prefill_events = watcher.events(1, since=step_at)
    under_load = watcher.events(2, since=step_at, until=step_end)
    gaps = np.diff([step_at] + [t for t, _ in under_load]) if under_load else []
    back_to_one = next((t for t, n in decode_events if n == 1), None)

    rows = [("plain processes, idle", plain), ("Ray Serve, idle (before)", on_ray),
            ("step: before a new replica serves (during)", during), ("step: after it serves (after)", after)]
    print("\n| phase | requests | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p90 (ms) | E2E p50 (ms) | lost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    table = []
    for name, records in rows:
        ok = [r for r in records if r.ok and not r.warmup]
        row = {"phase": name, "requests": len([r for r in records if not r.warmup]),
               "ttft_p50_ms": p50_ms([r.ttft for r in ok]), "ttft_p90_ms": p90_ms([r.ttft for r in ok]),
               "tpot_p90_ms": p90_ms([r.tpot for r in ok]), "e2e_p50_ms": p50_ms([r.latency for r in ok]),
               "lost": lost([r for r in records if not r.warmup])}
        table.append(row)
        print(f"| {name} | {row['requests']} | {fmt(row['ttft_p50_ms'], 1)} | {fmt(row['ttft_p90_ms'], 1)} | "
              f"{fmt(row['tpot_p90_ms'], 1)} | {fmt(row['e2e_p50_ms'], 1)} | {row['lost']} |")
    print(f"\nRay's overhead, short requests ({args.input_len} prompt tokens, {args.overhead_output_len} output), "
          "one at a time:")
    print("\n| launcher | requests | TTFT p50 (ms) | TTFT p90 (ms) | E2E p50 (ms) | E2E p90 (ms) | lost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    short_rows = []
    for name, records in (("plain processes", plain_short), ("Ray Serve", ray_short)):
        ok = [r for r in records if r.ok and not r.warmup]
        row = {"launcher": name, "ttft_p50_ms": p50_ms([r.ttft for r in ok]),
               "ttft_p90_ms": p90_ms([r.ttft for r in ok]), "e2e_p50_ms": p50_ms([r.latency for r in ok]),
               "e2e_p90_ms": p90_ms([r.latency for r in ok]),
               "lost": lost([r for r in records if not r.warmup])}
        short_rows.append(row)
        print(f"| {name} | {len(ok)} | {fmt(row['ttft_p50_ms'], 1)} | {fmt(row['ttft_p90_ms'], 1)} | "
              f"{fmt(row['e2e_p50_ms'], 1)} | {fmt(row['e2e_p90_ms'], 1)} | {row['lost']} |")
    overhead = {k: (short_rows[1][k] / short_rows[0][k]) if short_rows[0][k] and short_rows[1][k] else None
                for k in ("ttft_p50_ms", "e2e_p50_ms")}
    added = {k: (short_rows[1][k] - short_rows[0][k]) if short_rows[0][k] and short_rows[1][k] else None
             for k in ("ttft_p50_ms", "e2e_p50_ms")}
    print(f"\nRay / plain: TTFT p50 x{fmt(overhead['ttft_p50_ms'], 2)} ({fmt(added['ttft_p50_ms'], 1)} ms added), "
          f"E2E p50 x{fmt(overhead['e2e_p50_ms'], 2)} ({fmt(added['e2e_p50_ms'], 1)} ms added)")
    print(f"step -> new decode replica serving: {fmt(serving - step_at if serving else None, 1)} s (target < 30 s)")
    print(f"scale events: decode {[(round(t - step_at, 1), n) for t, n in decode_events]}, "
          f"prefill {[(round(t - step_at, 1), n) for t, n in prefill_events]} (s after the step, replicas)")
    shortest = min(gaps) if len(gaps) else None
    print(f"under constant load: {len(under_load)} decode event(s), shortest gap {fmt(shortest, 1)} s "
          f"(upscale window {args.upscale_window_s:g} s)")
    print(f"load stopped -> back to one decode replica: {fmt(back_to_one - step_end if back_to_one else None, 1)} s "
          f"(downscale window {args.downscale_window_s:g} s)")
    every = [rs for _, rs in rows] + [plain_short, ray_short]
    total_lost = sum(lost([r for r in rs if not r.warmup]) for rs in every)
    print(f"requests lost, whole run: {total_lost} of {sum(len(rs) for rs in every)}")

    simulated = None
    if args.sim_profile:
        real = real_decode_events(watcher, step_at)
        moves = policy_moves(os.environ["RAY_TMPDIR"], "decode")
        # The policy's own decision, from Serve's controller log: what the simulator's "asked" is (its
        # replica is asked for at the decision); Ray's STARTING state shows after the actor is created.
        real["decided"] = next((t - step_at for t, old, new in moves if t >= step_at and new > old), None)
        simulated = simulate_step(config, args, step_config, real)

    result = {"args": vars(args), "table": table, "short_requests": short_rows, "overhead_ratio": overhead,
              "overhead_added_ms": added,
              "step_to_serving_s": serving - step_at if serving else None,
              "decode_events": [(t - step_at, n) for t, n in decode_events],
              "prefill_events": [(t - step_at, n) for t, n in prefill_events],
              "scale_down_after_load_s": back_to_one - step_end if back_to_one else None,
              "lost": total_lost,
              "replicas": [(t - step_at, pf, dc) for t, pf, dc in watcher.samples],
              "step_records": [dataclasses.asdict(r) for r in step], "simulated": simulated}
    (out / "autoscale.json").write_text(json.dumps(result, indent=1, default=str))
    plot(out / "autoscale.png", watcher, step, step_at, step_end, serving, args)
    print(f"\nwrote {out / 'autoscale.json'} and {out / 'autoscale.png'}")


def real_decode_events(watcher: Watcher, step_at: float) -> dict[str, float | None]:
    """Seconds after the step: a second decode replica asked for (Ray's first STARTING one), serving (RUNNING),
    and the pool back to one RUNNING replica after that."""
    asked = next((t - step_at for t, n in watcher.decode_starting if t >= step_at and n > 0), None)
    up = next((t - step_at for t, _, n in watcher.samples if t >= step_at and n >= 2), None)
    down = None if up is None else next((t - step_at for t, _, n in watcher.samples
                                         if t - step_at > up and n <= 1), None)
    return {"asked": asked, "serving": up, "back_to_one": down}


def policy_moves(ray_tmp: str, role: str) -> list[tuple[float, int, int]]:
    """(time.time(), from, to) of each move of ``role``'s pool that its policy logged in Serve's controller
    log (cluster/ray_app.py's ``PoolAutoscalingPolicy``; the log's times are this machine's local time)."""
    line = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*autoscaler " + role
                      + r": (\d+) -> (\d+) replicas")
    moves = []
    for path in sorted(Path(ray_tmp).glob("**/logs/serve/controller_*.log")):
        for text in path.read_text(errors="replace").splitlines():
            m = line.match(text)
            if m and m[2] != m[3]:
                moves.append((datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m[2]), int(m[3])))
    return sorted(moves)


def simulated_decode_events(pools: dict) -> dict[str, float | None]:
    """The same three times in the simulator's decode timeline ((time, serving, asked for))."""
    line = pools["decode"]
    asked = next((t for t, _, n in line if n >= 2), None)
    up = next((t for t, n, _ in line if n >= 2), None)
    down = None if up is None else next((t for t, n, _ in line if t > up and n <= 1), None)
    return {"asked": asked, "serving": up, "back_to_one": down}


def resimulate(path: Path, profile: str | None, out: Path) -> None:
    """The step of a recorded run (``path``, this script's JSON) simulated again: the run's arguments (its
    profile replaced by ``profile`` when given), its cluster file and requests, its measured events."""
    from pdserve.cluster.config import load_serve_config

    recorded = json.loads(path.read_text())
    if not recorded.get("simulated"):
        raise SystemExit(f"{path}: no simulation recorded (the run had no --sim-profile): its real events are "
                         "not all in it")
    args = argparse.Namespace(**recorded["args"])
    args.sim_profile = profile or args.sim_profile
    args.result_dir = str(out)
    real = {row["event"]: row["real_s"] for row in recorded["simulated"]["events"]}
    config = load_serve_config(None, cluster_config(args, free_port()))
    step = bench_config("http://127.0.0.1:1", args, request_rate=args.rate, duration=args.step_s, num_prompts=100000,
                        progress=False)
    recorded["simulated"] = simulate_step(config, args, step, real)
    recorded["args"] = vars(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale.json").write_text(json.dumps(recorded, indent=1, default=str))
    print(f"\nwrote {out / 'autoscale.json'}")


def simulate_step(config, args, step: BenchConfig, real: dict[str, float | None]) -> dict:
    """The step on the simulator: the same cluster file, requests and arrivals; the measured start-up time."""
    from pdserve.bench.latency_model import Profile
    from pdserve.bench.sim import SimConfig, simulate
    from pdserve.bench.sim_cli import requests_from_bench

    profile = Profile.load(args.sim_profile)
    startup_s = (real["serving"] - real["asked"] if real["asked"] is not None and real["serving"] is not None
                 else SimConfig.startup_s)
    requests = [r for r in requests_from_bench(step, args.rate) if r.arrival < args.step_s]
    sim_config = SimConfig.from_serve(config, profile, startup_s=startup_s, autoscale_interval_s=args.sim_interval_s,
                                      settle_s=args.downscale_window_s + 60)
    result = simulate(sim_config, profile, requests)
    sim = simulated_decode_events(result.pools)
    windows = {"asked": args.upscale_window_s, "serving": args.upscale_window_s,
               "back_to_one": args.downscale_window_s}
    print(f"\nsimulated ({len(requests)} requests; a new replica serves {startup_s:.1f} s after it is asked for, "
          f"as measured):\n")
    print("| decode pool event | run (s after the step) | simulated | difference | within one window |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    keys = [("asked", "second replica asked for"), ("serving", "second replica serving"),
            ("back_to_one", "back to one replica")]
    if real.get("decided") is not None:  # runs that read the controller's log
        keys.insert(0, ("decided", "the policy decides on a second replica"))
        sim["decided"] = sim["asked"]  # the simulator asks for it at the decision
        windows["decided"] = args.upscale_window_s
    for key, name in keys:
        diff = None if real[key] is None or sim[key] is None else sim[key] - real[key]
        within = None if diff is None else abs(diff) <= windows[key]
        rows.append({"event": key, "real_s": real[key], "sim_s": sim[key], "diff_s": diff,
                     "window_s": windows[key], "within_window": within})
        print(f"| {name} | {fmt(real[key], 1)} | {fmt(sim[key], 1)} | {fmt(diff, 1)} | "
              f"{'-' if within is None else ('yes' if within else 'no')} ({windows[key]:g} s) |")
    return {"startup_s": startup_s, "requests": len(requests), "events": rows,
            "timeline": result.pools["decode"], "summary": result.summary().to_dict()}


def plot(path: Path, watcher: Watcher, step, step_at: float, step_end: float, serving: float | None, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [s[0] - step_at for s in watcher.samples]
    a1.step(t, [s[2] for s in watcher.samples], where="post", label="decode replicas running")
    a1.step(t, [s[1] for s in watcher.samples], where="post", label="prefill replicas running", linestyle="--")
    a1.set_ylabel("replicas")
    a1.set_yticks(range(0, args.max_replicas + 2))
    ok = [r for r in step if r.ok and r.ttft is not None]
    a2.scatter([r.start_wall - step_at for r in ok], [r.ttft * 1e3 for r in ok], s=6, label="TTFT")
    a2.scatter([r.start_wall - step_at for r in ok], [(r.tpot or 0) * 1e3 for r in ok], s=6, label="TPOT")
    a2.set_yscale("log")
    a2.set_ylabel("ms")
    a2.set_xlabel("seconds since the step")
    for ax in (a1, a2):
        ax.axvspan(0, step_end - step_at, color="orange", alpha=0.1, label="load step")
        if serving:
            ax.axvline(serving - step_at, color="green", linestyle=":", label="new replica serving")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"decode pool autoscaling: {args.rate:g} req/s step, {args.model}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
