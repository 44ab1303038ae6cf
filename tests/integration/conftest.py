"""Real processes on 127.0.0.1: decode workers and a router, started and stopped by the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from pdserve.cluster.launcher import WorkerProcess, spawn, start_worker, stop_workers, wait_ready


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    base_url: str
    workers: list[WorkerProcess]
    router: subprocess.Popen
    model: str
    extra: dict = field(default_factory=dict)

    def worker_metric(self, index: int, name: str) -> float:
        """A counter summed over its labels, from worker ``index``'s own /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.extra['metrics_ports'][index]}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def stats(self) -> list:
        import grpc

        from pdserve.proto.v1 import worker_pb2 as pb
        from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

        out = []
        for w in self.workers:
            if w.process.poll() is not None:
                continue
            with grpc.insecure_channel(w.address) as ch:
                out.append(pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5))
        return out


def start_router(addresses: list[str], model: str, *flags: str, ready: bool = True,
                 log_level: str = "WARNING") -> tuple[subprocess.Popen, str]:
    """A router subprocess; waits for /ready (some worker up), or only /health when ``ready`` is False."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cluster.cli", "--log-level", log_level, "router", "--model", model,
           "--port", str(port), "--poll-interval-s", "0.2", *flags]
    for a in addresses:
        cmd += ["--worker", a]
    proc = spawn(cmd)  # dies with this process
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            if httpx.get(url + ("/ready" if ready else "/health"), timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise TimeoutError("router did not become ready")


def stop_routers(routers: list[tuple[subprocess.Popen, str]]) -> None:
    """SIGTERM to every router of ``start_router``, then wait for each (they drain at once)."""
    for proc, _ in routers:
        proc.send_signal(signal.SIGTERM)
    for proc, _ in routers:
        proc.wait(30)


def start_cluster(model: str, decode: int, engine_flags: list[str], router_flags: list[str] = (), prefill: int = 0,
                  prefill_flags: list[str] = (), decode_flags: list[str] = ()) -> Cluster:
    """Workers (one thread each when they share the machine) and a router in front of them."""
    threads = max(1, (os.cpu_count() or 2) // (decode + prefill))
    workers = []
    for role, count, extra in (("prefill", prefill, prefill_flags), ("decode", decode, decode_flags)):
        for _ in range(count):
            # Metrics on a port the worker binds itself (a port picked here could be taken by another
            # worker's ephemeral gRPC port before this one binds it).
            workers.append(start_worker(role, ["--host", "127.0.0.1", "--port", "0", "--model", model,
                                               "--num-threads", str(threads), "--no-load-progress",
                                               "--metrics-port", "0", *engine_flags, *extra]))
    try:
        wait_ready(workers, timeout_s=300)
        router, url = start_router([w.address for w in workers], model, *router_flags)
    except BaseException:
        stop_workers(workers, grace_s=5)
        raise
    return Cluster(url, workers, router, model, {"metrics_ports": [w.metrics_port for w in workers]})


def stop_cluster(cluster: Cluster) -> None:
    if cluster.router.poll() is None:
        cluster.router.send_signal(signal.SIGTERM)
        try:
            cluster.router.wait(30)
        except subprocess.TimeoutExpired:
            cluster.router.kill()
    stop_workers(cluster.workers, grace_s=10)


@pytest.fixture(scope="session")
def served():
    """`pdserve serve`-like: the default model behind two decode workers and a router."""
    cluster = start_cluster("smollm2-135m-instruct", decode=2, engine_flags=["--kv-cache-memory-gb", "0.5"])
    yield cluster
    stop_cluster(cluster)
