"""Two routers sharing one Redis, over real processes: plain-process workers register themselves,
both routers find the same workers (none given with --worker), a worker that joins later is
found and one whose heartbeat stops is dropped by both, and Redis stopped and restarted mid-run
fails no request. ``pdserve serve --redis`` registers its workers and deregisters them on stop."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready
from pdserve.state.store import StateStoreConfig, make_state_store
from tests.integration.conftest import start_router, stop_routers
from tests.integration.test_serve_cli import start_serve
from tests.redis_server import RedisServer, redis_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "random:tiny"
TTL_S, HEARTBEAT_S = 2.0, 0.5


def worker(url: str):
    return start_worker("decode", ["--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--num-threads", "1",
                                   "--no-load-progress", "--num-kv-blocks", "64", "--redis", url,
                                   "--heartbeat-s", str(HEARTBEAT_S), "--ttl-s", str(TTL_S), "--grace-s", "5"])


def listed(router_url: str) -> set[str]:
    """The addresses of the healthy workers in a router's rotation."""
    return {w["address"] for w in httpx.get(router_url + "/ready", timeout=5).json()["workers"] if w["healthy"]}


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting until {what}"
        time.sleep(0.2)


def complete(router_url: str, model: str) -> int:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    return httpx.post(router_url + "/v1/completions", json=body, timeout=60).status_code


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(redis_binary())
    server.start()
    yield server
    server.stop()


def test_two_routers_share_the_workers_in_redis(redis, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(f"state_store: {{backend: redis, url: '{redis.url()}', ttl_s: {TTL_S}, "
                      f"heartbeat_s: {HEARTBEAT_S}}}\n")
    workers = [worker(redis.url()) for _ in range(2)]
    routers = []
    try:
        wait_ready(workers, timeout_s=120)
        routers = [start_router([], MODEL, "--config", str(config)) for _ in range(2)]
        urls = [url for _, url in routers]
        addresses = {w.address for w in workers}
        for url in urls:
            wait_for(lambda u=url: listed(u) == addresses, 15, "each router lists both workers")
        model = httpx.get(urls[0] + "/v1/models", timeout=5).json()["data"][0]["id"]
        assert all(complete(url, model) == 200 for url in urls)

        # Redis stopped and restarted (empty) while requests flow through both routers.
        statuses: list[int | str] = []
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                try:
                    statuses.append(complete(urls[i % 2], model))
                except httpx.HTTPError as e:
                    statuses.append(repr(e))
                i += 1

        sender = threading.Thread(target=load)
        sender.start()
        time.sleep(1.0)
        redis.stop()
        time.sleep(TTL_S + 1.0)  # longer than a record lives: nothing may expire while Redis is away
        redis.start()
        time.sleep(TTL_S + 1.0)  # the workers re-register; the routers' grace covers the gap
        stop.set()
        sender.join(60)
        failed = [s for s in statuses if s != 200]
        print(f"requests during the Redis restart: {len(statuses)}, failed: {len(failed)}")
        assert statuses and not failed, failed
        for url in urls:
            assert listed(url) == addresses

        # A worker joins without a router restart; one whose heartbeat stops is dropped by both.
        workers.append(worker(redis.url()))
        wait_ready(workers[-1:], timeout_s=120)
        addresses.add(workers[-1].address)
        for url in urls:
            wait_for(lambda u=url: listed(u) == addresses, 15, "each router lists the new worker")
        killed = workers[0]
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait()
        addresses.discard(killed.address)
        for url in urls:
            wait_for(lambda u=url: killed.address not in {w["address"] for w in
                                                          httpx.get(u + "/ready", timeout=5).json()["workers"]},
                     3 * TTL_S + 5, "each router drops the silent worker")
            assert listed(url) == addresses
            assert complete(url, model) == 200
    finally:
        stop_routers(routers)
        stop_workers(workers, grace_s=10)


def read_store(url: str, what: str):
    async def read():
        store = make_state_store(StateStoreConfig(backend="redis", url=url))
        await store.start()
        try:
            return await store.workers() if what == "workers" else (await store.read_kv_events()).events
        finally:
            await store.close()

    return asyncio.run(read())


def registered(url: str) -> list:
    return read_store(url, "workers")


def test_serve_with_redis_registers_its_workers(redis):
    proc, url = start_serve("--redis", redis.url(1), "--prefill", "1")
    try:
        records = registered(redis.url(1))
        assert sorted(r.role for r in records) == ["decode", "prefill"]
        assert all(r.model and r.model_fingerprint and r.address for r in records)
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1000, 1040)), "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        # The prompt filled two 16-token blocks: the workers publish them with their next heartbeat.
        wait_for(lambda: any(e.kind == "stored" for e in read_store(redis.url(1), "events")), 10,
                 "the workers' KV events reach the stream")
        events = read_store(redis.url(1), "events")
        assert {e.worker_id for e in events} <= {r.worker_id for r in records}
        assert all(len(h) == 32 for e in events for h in e.block_hashes)  # 16-byte hashes, hex
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert registered(redis.url(1)) == []  # deregistered on the way out
