"""Starting and stopping worker processes on this machine (the plain-process launcher).

Each worker is ``python -P -m pdserve.cluster.cli worker <role> --port 0 ...``; it prints
``PDSERVE_WORKER_READY host:port`` on stdout once it serves, which is how the launcher learns
its address. Stopping sends SIGTERM (the worker drains), then SIGKILL after a grace period.

``-P`` keeps the working directory off the worker's ``sys.path``: run from a directory holding a
folder named ``pdserve`` (a clone's parent), ``-m`` would import that folder as a namespace
package instead of the installed one, and every request would fail.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)
READY = "PDSERVE_WORKER_READY"
PARENT_ENV = "PDSERVE_PARENT_PID"  # the worker dies with this process (see die_with_launcher)


@dataclass
class WorkerProcess:
    role: str
    process: subprocess.Popen
    address: str = ""
    metrics_port: int | None = None  # from the ready line, when the worker serves metrics
    forwarder: threading.Thread | None = None  # copies the worker's stdout after it is ready

    @property
    def pid(self) -> int:
        return self.process.pid


# The worker's death signal (PR_SET_PDEATHSIG) fires when the *thread* that started it ends, not the
# process: a worker started from a short-lived thread (asyncio.to_thread, a pool's) got SIGTERM and
# drained away as soon as that thread finished. Everything ``spawn`` starts is started from this one
# thread, which lives as long as the process.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="worker-spawner")


def spawn(cmd: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """Start a pdserve command that dies with this process (it calls ``die_with_launcher``).

    No preexec_fn: with one, Popen must fork and run Python in the child, and a parent that has
    used gRPC then runs gRPC's fork handlers, which crashed 1-4 children in 200 (SIGABRT at
    start-up). Without it the child is spawned (vfork + exec) and sets its own death signal."""
    return _SPAWNER.submit(subprocess.Popen, cmd, env={**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())},
                           **popen).result()


def start_worker(role: str, args: list[str], env: dict[str, str] | None = None) -> WorkerProcess:
    cmd = [sys.executable, "-P", "-m", "pdserve.cluster.cli", "worker", role, *args]
    return WorkerProcess(role, spawn(cmd, env, stdout=subprocess.PIPE, text=True))


def die_with_launcher() -> None:
    """In a worker started by ``start_worker``: SIGTERM when the launcher dies (even by SIGKILL),
    so no worker outlives the command that started it; exit now if it is already gone."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    die_with_parent()
    if os.getppid() != int(parent):  # the launcher died before the death signal was set
        sys.exit(0)


def die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, even by SIGKILL (Linux), so no worker
    outlives the command that started it."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def wait_ready(workers: list[WorkerProcess], timeout_s: float = 600.0) -> None:
    """Block until every worker has printed its address; raise if one exits first."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        while not w.address:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{w.role} worker (pid {w.pid}) did not become ready in {timeout_s:.0f} s")
            line = w.process.stdout.readline()
            if not line:
                code = w.process.wait()
                raise RuntimeError(f"{w.role} worker (pid {w.pid}) exited with status {code} before serving")
            if line.startswith(READY):
                fields = line.split()
                w.address = fields[1]
                for field in fields[2:]:
                    if field.startswith("metrics="):
                        w.metrics_port = int(field.removeprefix("metrics="))
            else:
                sys.stdout.write(line)
        # Keep the pipe drained so the worker never blocks writing to it.
        w.forwarder = threading.Thread(target=_forward, args=(w.process.stdout,), daemon=True)
        w.forwarder.start()


def _forward(stream) -> None:
    try:
        for line in stream:
            sys.stdout.write(line)
    except (ValueError, OSError):  # the pipe was closed under us: the worker is gone
        pass


def signal_workers(workers: list[WorkerProcess]) -> None:
    """SIGTERM every worker still running: each deregisters and drains its in-flight requests."""
    for w in workers:
        if w.process.poll() is None:
            w.process.send_signal(signal.SIGTERM)


def stop_workers(workers: list[WorkerProcess], grace_s: float = 30.0) -> None:
    """SIGTERM every worker we started, wait for them to drain, SIGKILL what remains."""
    signal_workers(workers)
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s worker (pid %d) did not stop in %.0f s; killing it", w.role, w.pid, grace_s)
            w.process.kill()
            w.process.wait()
        if w.forwarder is not None:
            w.forwarder.join(5)
        if w.process.stdout is not None:
            w.process.stdout.close()
