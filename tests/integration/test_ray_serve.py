"""pdserve on a real local Ray instance (custom resources declared at ray.init), through HTTP:

- each pool lands on the resource its YAML names; a replica killed by the test is replaced by
  Serve, registers itself, and the router routes to it without a restart;
- a bounded load step with small windows: the decode pool scales up, then back down when the load
  stops; the prefill pool does not move; every request of the run completes;
- two router replicas under cache-aware routing both index the workers' KV events (through the
  StateStore deployment) and send a conversation's second turn where its first turn's blocks are.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import threading
import time

import httpx
import pytest

from tests.integration.conftest import free_port
from tests.integration.test_prefix_routing import BLOCK, FIRST_TURN, metric

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP = "pdserve-test"
BASE = {
    "engine": {"model": "random:tiny", "num_kv_blocks": 256, "max_num_seqs": 16, "num_threads": 1},
    "router": {"poll_interval_s": 0.2},
    "state_store": {"heartbeat_s": 0.5, "ttl_s": 2.0},
    "ray": {"app_name": APP, "metrics_interval_s": 0.5},
}


@pytest.fixture(scope="module")
def ray_url():
    """Ray on this machine with two node groups' worth of custom resources, Serve's HTTP proxy on a free port."""
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PDSERVE_WORKER_HOST="127.0.0.1")
    os.environ["RAY_TMPDIR"] = tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    from pdserve.cluster.ray_launcher import HEAD_DEFAULTS

    for key, value in HEAD_DEFAULTS.items():  # as pdserve's own head: the proxy's patience, the workers' priority
        os.environ.setdefault(key, value)
    ray.init(num_cpus=8, resources={"prefill_node": 2, "decode_node": 3}, include_dashboard=False,
             namespace="pdserve-test", log_to_driver=False, _temp_dir=tmp)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def deploy(cluster: dict, step_trace: str = ""):
    from pdserve.cluster.config import load_serve_config
    from pdserve.cluster.ray_app import build_app
    from pdserve.cluster.ray_launcher import check_placement

    check_placement(load_serve_config(None, cluster))
    serve.run(build_app({"cluster": cluster, **({"step_trace": step_trace} if step_trace else {})}), name=APP,
              route_prefix="/")


def merged(**sections) -> dict:
    return {**BASE, **sections}


def ready_workers(url: str) -> list[dict]:
    try:
        r = httpx.get(url + "/ready", timeout=2)
    except httpx.HTTPError:
        return []
    return [w for w in r.json().get("workers", []) if w["healthy"]] if r.status_code in (200, 503) else []


# Every deadline below is stretched this much: with two busy loops on a 2-core machine, Ray's dozen
# processes start Serve in ~50 s instead of ~5 and a replica comes back several times slower; the
# waits end as soon as their condition holds, so only a failing run takes longer.
PATIENCE = 3


def wait_for(condition, seconds: float, what: str, interval: float = 0.2):
    seconds *= PATIENCE
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


def running(deployment: str) -> int:
    status = serve.status().applications[APP].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def alive(deployment: str) -> int:
    """Replicas starting or running (a woken replica registers and serves before Serve calls it RUNNING)."""
    status = serve.status().applications[APP].deployments[deployment]
    return sum(n for state, n in status.replica_states.items() if state not in ("STOPPING", "STOPPED"))


def complete(url: str, prompt: str | list[int], max_tokens: int = 8, timeout: float = 60) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "random:tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                  "ignore_eos": True}, timeout=timeout * PATIENCE)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    return body


def worker_tokens(address: str) -> int:
    """Tokens a worker has generated (its own Stats over gRPC)."""
    import grpc

    from pdserve.proto.v1 import worker_pb2 as pb
    from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).generation_tokens_total


def test_pools_land_on_their_resources_and_a_killed_replica_is_replaced(ray_url):
    cluster = merged(pools={
        "prefill": {"replicas": 1, "num_cpus": 1, "resources": {"prefill_node": 1}},
        "decode": {"replicas": 2, "num_cpus": 1, "resources": {"decode_node": 1}, "grace_s": 5},
    })
    deploy(cluster)
    try:
        wait_for(lambda: len(ready_workers(ray_url)) == 3, 60, "three workers in the router's rotation")
        # Placement: each replica holds the resource its pool names, and nothing else holds any.
        available = ray.available_resources()
        assert (available.get("prefill_node", 0), available.get("decode_node", 0)) == (1.0, 1.0)
        decode = serve.get_deployment_handle("DecodeWorker", app_name=APP)
        prefill = serve.get_deployment_handle("PrefillWorker", app_name=APP)
        infos = {}
        for _ in range(30):
            info = decode.info.remote().result(timeout_s=30 * PATIENCE)
            infos[info["replica"]] = info
            if len(infos) == 2:
                break
        assert len(infos) == 2
        assert all(i["resources"].get("decode_node") == 1.0 for i in infos.values())
        assert prefill.info.remote().result(timeout_s=30 * PATIENCE)["resources"].get("prefill_node") == 1.0

        complete(ray_url, "hello " * 200, 8)  # long: prefilled on the prefill pool
        victim = next(iter(infos.values()))
        errors: list[str] = []

        def traffic(stop: threading.Event):
            while not stop.is_set():
                try:
                    complete(ray_url, "a short prompt", 16)
                except AssertionError as e:
                    errors.append(str(e))

        stop = threading.Event()
        clients = [threading.Thread(target=traffic, args=(stop,)) for _ in range(2)]
        for c in clients:
            c.start()
        time.sleep(1)
        os.kill(victim["pid"], signal.SIGKILL)  # the replica's process dies, in-flight requests with it
        replaced = wait_for(lambda: [w for w in ready_workers(ray_url) if w["worker_id"].startswith("decode-")
                                     and w["worker_id"] != victim["worker_id"]
                                     and w["worker_id"] not in {i["worker_id"] for i in infos.values()}],
                            90, "a replacement decode replica in the router's rotation")
        time.sleep(2)
        stop.set()
        for c in clients:
            c.join(60 * PATIENCE)
        assert not errors, errors[:3]  # requests during the kill moved to the other decode worker
        new = replaced[0]
        before = worker_tokens(new["address"])
        for _ in range(6):  # least-loaded over two idle workers: concurrent requests reach the new one
            threads = [threading.Thread(target=complete, args=(ray_url, "again", 8)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60 * PATIENCE)
        assert worker_tokens(new["address"]) > before, "the router never sent a request to the new replica"
        assert running("DecodeWorker") == 2
    finally:
        serve.delete(APP)


def test_a_load_step_scales_the_loaded_pool_up_then_down_and_loses_nothing(ray_url):
    window = {"upscale_window_s": 2, "downscale_window_s": 6, "max_step": 1}
    cluster = merged(pools={
        "prefill": {"replicas": 1, "num_cpus": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 2,
                                                                  "target_queued_prompt_tokens": 100000, **window}},
        "decode": {"replicas": 1, "num_cpus": 1, "grace_s": 10,
                   "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_running_requests": 2, **window}},
    })
    watching, load = threading.Event(), threading.Event()  # set: the watcher, the clients stop
    threads: list[threading.Thread] = []
    deploy(cluster)
    try:
        wait_for(lambda: len(ready_workers(ray_url)) == 2, 60, "both workers in the router's rotation")
        counts: list[tuple[float, int, int]] = []  # (t, prefill, decode) running replicas

        def watch():
            while not watching.is_set():
                counts.append((time.monotonic(), running("PrefillWorker"), running("DecodeWorker")))
                time.sleep(0.25)

        results: list[int] = []
        errors: list[str] = []

        def client(stop: threading.Event, long: bool):
            prompt = "tell me more " * (60 if long else 2)  # some long prompts: the prefill pool works too
            while not stop.is_set():
                try:
                    results.append(complete(ray_url, prompt, 48)["usage"]["completion_tokens"])
                except Exception as e:  # noqa: BLE001 - every failure is a lost request
                    errors.append(f"{type(e).__name__}: {e}")

        watcher = threading.Thread(target=watch)
        clients = [threading.Thread(target=client, args=(load, i == 0)) for i in range(6)]
        threads += [watcher, *clients]
        for t in threads:
            t.start()
        # The step: six clients back to back, three times what one replica is asked to hold.
        wait_for(lambda: len([w for w in ready_workers(ray_url) if w["worker_id"].startswith("decode-")]) == 2,
                 60, "a second decode replica serving")
        time.sleep(3)  # the new replica takes its share of the load
        load.set()
        for c in clients:
            c.join(120 * PATIENCE)
        served_during_load = len(results)
        wait_for(lambda: running("DecodeWorker") == 1 and len(ready_workers(ray_url)) == 2, 60,
                 "the decode pool back at one replica")
        watching.set()
        watcher.join(10 * PATIENCE)
        assert not errors, errors[:3]
        assert served_during_load > 0 and all(n == 48 for n in results)
        assert max(d for _, _, d in counts) == 2 and counts[-1][2] == 1
        assert {p for _, p, _ in counts} == {1}, "the prefill pool moved"
        complete(ray_url, "still serving", 8)
    finally:
        # A failed wait must not leave the clients loading the next test's application (they would
        # keep its pool from going back to zero) nor the watcher polling a deleted one.
        load.set()
        watching.set()
        for t in threads:
            t.join(120 * PATIENCE)
        serve.delete(APP)


def test_a_pool_at_zero_wakes_for_a_request_and_goes_back_to_zero(ray_url, tmp_path):
    """... and the replica traces its engine's steps (`pdserve serve --launcher ray --step-trace`), the
    trace closed when Serve stops it."""
    from pdserve.bench.step_trace import read_trace

    cluster = merged(pools={
        "prefill": {"replicas": 0},
        "decode": {"replicas": 0, "num_cpus": 1, "grace_s": 5, "autoscaling": {
            "min_replicas": 0, "max_replicas": 1, "upscale_window_s": 1, "downscale_window_s": 4,
            "cold_start_timeout_s": 90 * PATIENCE}},
    })
    deploy(cluster, step_trace=str(tmp_path / "{pid}.jsonl"))
    try:
        assert running("DecodeWorker") == 0 and not ready_workers(ray_url)
        complete(ray_url, "wake up", 8, timeout=120)  # waits for the cold start, then is served
        served = time.monotonic()
        assert [w for w in ready_workers(ray_url) if w["worker_id"].startswith("decode-")]
        wait_for(lambda: alive("DecodeWorker") == 0, 60, "the idle pool back at zero")
        traces = sorted(tmp_path.glob("*.jsonl"))
        assert len(traces) == 1  # the woken replica's, its steps written as it stops
        steps = wait_for(lambda: read_trace(traces[0])[1], 30, "the stopped replica's steps in its trace")
        header = read_trace(traces[0])[0]
        assert header["role"] == "decode" and header["worker_id"].startswith("decode-")
        assert [f.prefill_tokens > 0 for _, _, f in steps].count(True) == 1  # the prompt, then its decodes
        assert sum(f.decode_seqs for _, _, f in steps) == 7  # 8 tokens: one from the prefill step
        # Not sooner than a full quiet window at one replica (the quiet seen at zero does not count);
        # Serve's status may lag, never lead.
        gap = time.monotonic() - served
        print(f"the woken pool was back at zero {gap:.1f} s after serving (downscale window 4 s)")
        assert gap >= 4 - 0.5
        complete(ray_url, "and again", 8, timeout=120)
    finally:
        serve.delete(APP)


def test_two_router_replicas_send_a_second_turn_to_the_worker_holding_the_first(ray_url):
    """Cache-aware routing on Ray (issue 14, both launchers): the decode workers publish their KV
    events through the StateStore deployment, and each of two router replicas indexes them (and the
    other's routes); a conversation's second turn, through whichever replica Serve's proxy picks,
    lands where its first turn's blocks are and reuses them."""
    cluster = merged(pools={"prefill": {"replicas": 0}, "decode": {"replicas": 2, "num_cpus": 1, "grace_s": 5}},
                     router={**BASE["router"], "policy": "cache_aware"}, ray={**BASE["ray"], "router_replicas": 2})
    deploy(cluster)
    try:
        wait_for(lambda: len(ready_workers(ray_url)) == 2 and running("Router") == 2, 60,
                 "two decode workers in rotation behind two router replicas")
        rng = random.Random(17)
        firsts = [[rng.randrange(1000, 40000) for _ in range(FIRST_TURN)] for _ in range(4)]
        for first in firsts:
            complete(ray_url, first, 4)
        blocks = len(firsts) * (FIRST_TURN // BLOCK)
        # Each read of /metrics reaches one replica: eight reads in a row, every one with the blocks, are
        # both replicas' indexes (all eight reaching the same one: 1 in 128).
        wait_for(lambda: all(metric(ray_url, "pdserve_router_prefix_index_blocks") >= blocks for _ in range(8)),
                 60, "the first turns' KV events in both router replicas' indexes")
        hit = FIRST_TURN // BLOCK * BLOCK
        for first in firsts:
            second = first + [rng.randrange(1000, 40000) for _ in range(40)]
            for _ in range(3):  # through whichever replica the proxy picks, each time
                wait_for(lambda: idle_in_a_row(ray_url), 60, "both router replicas' snapshots show idle workers")
                assert complete(ray_url, second, 4)["usage"]["prompt_tokens_details"]["cached_tokens"] >= hit
    finally:
        serve.delete(APP)


def idle_in_a_row(url: str, reads: int = 8) -> bool:
    """``reads`` reads of /metrics in a row show no request on any worker. Each read reaches one router
    replica, so both have reported idle snapshots (all eight reaching one replica: 1 in 128). With the
    tiny model a prefix hit saves less than a stale snapshot of a busy worker costs it, so without
    this the choice would hang on when each replica last polled (tests/integration/test_prefix_routing.py)."""
    return not any(metric(url, "pdserve_worker_num_running") + metric(url, "pdserve_worker_num_waiting")
                   for _ in range(reads))
