"""`pdserve serve` as a user runs it: served from its ready line on, a taken port refused at once, every process
stopped (exit 0) on SIGTERM or Ctrl-C to serve or to its process group, none left after a SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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


def start_serve(*flags: str, launcher: str = "processes", cwd: str | None = None, env: dict | None = None,
                command: list[str] | None = None, timeout: float = 180,
                models: tuple[str, ...] = ("random:tiny",)) -> tuple[subprocess.Popen, str]:
    """``pdserve serve`` in a session of its own (so a test can signal its whole process group), returned
    once it prints its ready line: from then on, requests must be served."""
    port = free_port()
    command = command or [sys.executable, "-m", "pdserve.cluster.cli"]
    proc = subprocess.Popen([*command, "--log-level", "WARNING", "serve", "--launcher", launcher, "--port", str(port),
                             *(f for m in models for f in ("--model", m)), "--num-kv-blocks", "64", *flags],
                            stdout=subprocess.PIPE, text=True, cwd=cwd, env=env, start_new_session=True)
    ready = threading.Event()
    url = f"http://127.0.0.1:{port}"

    def follow():  # drained until the end: the workers' output comes through serve's stdout
        with proc.stdout:
            for line in proc.stdout:
                if line.startswith(f"PDSERVE_READY {url}"):
                    ready.set()

    threading.Thread(target=follow, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"pdserve serve printed no ready line (exit status {proc.returncode})")
    return proc, url


def complete(url: str, prompt: str = "hi", max_tokens: int = 3, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/completions", json={"model": "random:tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                  "ignore_eos": True}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def wait_gone(pids: list[int], seconds: float = 40) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


GRACE_S = 30.0  # pools.<role>.grace_s's default: a stop must end within it and a few seconds


def stop(proc: subprocess.Popen, sig: int, target: str) -> float:
    """Send ``sig`` to serve's pid or to its whole process group (a shell's Ctrl-C, a supervisor);
    returns how long it took to exit."""
    start = time.monotonic()
    if target == "group":
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    proc.wait(GRACE_S + 30)
    return time.monotonic() - start


@pytest.mark.parametrize("sig,target", [(signal.SIGTERM, "pid"), (signal.SIGINT, "pid"), (signal.SIGTERM, "group"),
                                        (signal.SIGINT, "group"), (signal.SIGKILL, "pid")])
def test_serve_stops_every_process(sig, target):
    """The first request right after the ready line is served; a stop exits 0 (asked for: SIGTERM or
    SIGINT, to serve or to its group) within the grace period, and no worker outlives serve."""
    proc, url = start_serve("--prefill", "1", "--decode", "2")
    workers = children(proc.pid)
    assert len(workers) == 3  # one prefill worker and two decode workers
    complete(url)
    took = stop(proc, sig, target)
    if sig != signal.SIGKILL:
        assert proc.returncode == 0
        assert took < GRACE_S + 5
    assert wait_gone(workers), "a worker outlived pdserve serve"


def test_workers_do_not_import_a_pdserve_folder_in_the_working_directory(tmp_path):
    """Run from a clone's parent (a folder named pdserve beside us): the workers still import the
    installed package, not that folder as a namespace package (every request answered 503)."""
    (tmp_path / "pdserve").mkdir()
    entry_point = os.path.join(os.path.dirname(sys.executable), "pdserve")
    proc, url = start_serve("--prefill", "1", cwd=str(tmp_path), command=[entry_point])
    try:
        complete(url, "hello " * 300)  # long enough for the prefill worker (128 tokens and more)
    finally:
        stop(proc, signal.SIGTERM, "pid")
    assert proc.returncode == 0


def test_served_workers_take_calls_only_with_the_cluster_token():
    """pdserve serve makes a cluster token (cluster_token.py): the router and the prefill worker pushing
    KV hold it (a long prompt is prefilled remotely and served), a caller without it is refused
    UNAUTHENTICATED by every worker."""
    import grpc

    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

    proc, url = start_serve("--prefill", "1")
    try:
        complete(url, "hello " * 300)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert any(line.startswith('pdserve_router_prefill_decisions_total{outcome="remote"} 1')
                   for line in metrics.splitlines()), "the long prompt was not prefilled remotely"
        workers = httpx.get(url + "/ready", timeout=10).json()["workers"]
        assert len(workers) == 2
        for worker in workers:
            with grpc.insecure_channel(worker["address"]) as channel, pytest.raises(grpc.RpcError) as e:
                pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, worker
    finally:
        stop(proc, signal.SIGTERM, "pid")
    assert proc.returncode == 0


@pytest.mark.parametrize("launcher", ["processes", "ray"])
def test_a_taken_port_is_refused_before_anything_starts(launcher):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        out = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "serve", "--launcher", launcher, "--port",
                              str(port), "--model", "random:tiny"], capture_output=True, text=True, timeout=120,
                             env=env)
    assert out.returncode == 2
    # One line naming the port, and nothing logged before it: no worker, no Ray, no model was started.
    assert out.stderr.strip().splitlines() == [f"pdserve serve: error: router.port: port {port} on 127.0.0.1 is "
                                               f"already in use; stop what holds it or choose another (--port)"]


@pytest.mark.slow
def test_serve_on_ray_serves_after_its_ready_line_and_stops_on_a_group_sigterm(tmp_path):
    """The default launcher: a local Ray instance (its own processes), the pools as Serve replicas.

    Run from a directory holding a folder named pdserve (Ray puts the driver's directory on its
    workers' path); the first request right after the ready line is served; SIGTERM to serve's
    whole process group (a shell, a supervisor) reaches serve but not Ray's processes, so the
    replicas drain and serve exits 0 within the grace period, leaving nothing running. With
    ``--api-key`` the Router replica asks for the key (401 in OpenAI's shape without it).
    """
    (tmp_path / "pdserve").mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    entry_point = os.path.join(os.path.dirname(sys.executable), "pdserve")
    key = "sk-ray-replica-test"
    proc, url = start_serve("--prefill", "1", "--api-key", key, launcher="ray", cwd=str(tmp_path), env=env,
                            command=[entry_point], timeout=300)
    ray_processes: list[int] = []
    try:
        complete(url, "hi " * 200, key=key)  # long: prefilled on the prefill pool
        refused = httpx.post(url + "/v1/completions", json={"model": "random:tiny", "prompt": "hi"},
                             headers={"Authorization": "Bearer sk-wrong"}, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
        ray_processes = descendants(proc.pid)  # ray start, gcs, raylet, the replicas' workers, ...
        assert len(ray_processes) >= 5
        took = stop(proc, signal.SIGTERM, "group")
        assert proc.returncode == 0
        assert took < GRACE_S + 10
        assert wait_gone(ray_processes, 30), "a Ray process outlived pdserve serve"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in ray_processes:  # in their own session: nothing else would stop them
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_small_cpu_machine_serves_colocated_unless_told_otherwise(tmp_path, monkeypatch):
    """Under 4 CPUs, pdserve serve's default is colocated (a prefill pool of its own would halve each
    pool's cores); --prefill or the config file's pools.prefill still decide, and so does a machine
    of 4 CPUs or more."""
    import os as os_

    from pdserve.cluster import serve_cli
    from pdserve.cluster.cli import build_parser

    def effective(*argv: str, cpus: int = 2):
        monkeypatch.setattr(os_, "sched_getaffinity", lambda _pid: set(range(cpus)))
        return serve_cli._effective_serve_config(build_parser().parse_args(["serve", *argv]))[0].pools.prefill.replicas

    config = tmp_path / "cluster.yaml"
    config.write_text("pools:\n  prefill: {replicas: 2}\n")
    assert effective() == 0
    assert effective("--prefill", "1") == 1
    assert effective("--config", str(config)) == 2
    assert effective(cpus=4) == 1
    assert effective("--ray-address", "auto") == 1  # a cluster's machines are not this one
