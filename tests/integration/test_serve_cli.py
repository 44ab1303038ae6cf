"""`pdserve serve` as a user runs it: it serves, and stops all its processes on SIGTERM or SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.integration.conftest import free_port

pytestmark = pytest.mark.integration


def stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (s := stat(e)) and int(s[1]) == pid]


def alive(pid: int) -> bool:
    s = stat(pid)
    return s is not None and s[0] != "Z"


def start_serve(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.cli", "--log-level", "WARNING", "serve",
                             "--launcher", "processes", "--port", str(port), "--model", "random:tiny",
                             "--num-kv-blocks", "64", *flags])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise TimeoutError("pdserve serve did not become ready")


def wait_gone(pids: list[int], seconds: float = 40) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_serve_stops_every_process(sig):
    proc, url = start_serve("--decode", "2")
    workers = children(proc.pid)
    assert len(workers) == 3  # one prefill worker (the default) and two decode workers
    r = httpx.post(url + "/v1/completions", json={"model": "random:tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    proc.send_signal(sig)
    proc.wait(60)
    assert wait_gone(workers), "a worker outlived pdserve serve"


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.slow
def test_serve_on_ray_serves_and_stops_every_process():
    """The default launcher: a local Ray instance (its own processes), the pools as Serve replicas."""
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cluster.cli", "--log-level", "WARNING", "serve",
                             "--port", str(port), "--model", "random:tiny", "--num-kv-blocks", "64"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, "pdserve serve exited"
            try:
                r = httpx.get(url + "/ready", timeout=1)
                if r.status_code == 200 and len([w for w in r.json()["workers"] if w["healthy"]]) == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError("pdserve serve (Ray) did not become ready")
        r = httpx.post(url + "/v1/completions", json={"model": "random:tiny", "prompt": "hi " * 200,
                                                      "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        ray_processes = descendants(proc.pid)  # gcs, raylet, the replicas' workers, ...
        assert len(ray_processes) >= 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert wait_gone(ray_processes, 60), "a Ray process outlived pdserve serve"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
