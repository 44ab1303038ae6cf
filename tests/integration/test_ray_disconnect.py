"""Leaving the Ray head that ``pdserve serve`` started: a thread of ours that still calls Ray after the
disconnect (``serve.run`` waiting for RUNNING when the stop came) must not connect the process again,
or stopping the head kills the process (Ray's core worker exits it with status 1 when its raylet dies).
The same head's worker processes (where the replicas run) keep the starting command's priority, not Ray's
nice 15 (``ray_launcher.WORKER_PRIORITY``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = r"""
import threading
import ray
from pdserve.cluster import ray_launcher
from pdserve.cluster.config import RayConfig

head = ray_launcher.connect(RayConfig(num_cpus=1))

@ray.remote
def priority():
    import os
    return os.nice(0)

import os
print("worker nice:", ray.get(priority.remote()) - os.nice(0), "above ours", flush=True)
ref = ray.put(1)
ray_launcher.disconnect()
late = []

def poll():  # what serve.run's wait does each second
    try:
        late.append(ray.get(ref))
    except Exception as e:
        late.append(type(e).__name__)

t = threading.Thread(target=poll)
t.start()
t.join()
print("late call:", late, "connected again:", ray.is_initialized(), flush=True)
print("head exit:", ray_launcher.stop_head(head), flush=True)
"""


def test_a_call_after_disconnect_does_not_reconnect_and_the_head_stops_under_a_clean_exit():
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_worker_niceness", None)  # what the head sets itself
    with tempfile.TemporaryDirectory() as cwd:  # not the clone's root: no stray pdserve on the workers' path
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "connected again: False" in done.stdout, done.stdout
    assert "worker nice: 0 above ours" in done.stdout, done.stdout  # Ray's default would be 15 above
    assert "late call: [1]" not in done.stdout, done.stdout
