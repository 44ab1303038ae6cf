"""The plain-process launcher: a worker lives as long as the process that started it, whichever
thread started it (the death signal is tied to the starting thread: a replacement started from
``asyncio.to_thread`` used to get SIGTERM as that thread ended)."""

from __future__ import annotations

import subprocess
import threading

import grpc
import pytest

from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


def test_a_worker_started_from_a_thread_that_ends_keeps_serving():
    started = []

    def start():  # returns once the worker serves, i.e. once it has set its death signal
        started.append(start_worker("decode", ["--host", "127.0.0.1", "--port", "0", "--model", "random:tiny",
                                               "--num-threads", "1", "--no-load-progress", "--num-kv-blocks", "16",
                                               "--grace-s", "1"]))
        wait_ready(started, timeout_s=300)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    (worker,) = started
    try:
        # With the death signal tied to the ended thread, the idle worker drains (1 s) and exits; an
        # absence is all there is to wait for, so this waits a bounded while for an exit that must not come.
        with pytest.raises(subprocess.TimeoutExpired):
            worker.process.wait(timeout=5)
        with grpc.insecure_channel(worker.address) as channel:
            assert pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=30).num_running == 0
    finally:
        stop_workers([worker], grace_s=10)
