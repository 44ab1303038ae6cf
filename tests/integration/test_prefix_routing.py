"""Cache-aware routing over real processes: two decode workers (the tiny random model) publishing
their KV events to a real Redis, two routers reading it. A conversation's second turn goes to the
worker holding its first turn's blocks, through either router; once that worker is gone (stopped,
a fresh one started in its place), no router predicts hits on it any more. Without a state store
(no events reach the router), the router's own recent routes send second turns home; with routers
sharing Redis and no events at all, one router's routes send the other's second turns home."""

from __future__ import annotations

import asyncio
import random
import signal

import grpc
import httpx
import pytest

from pdserve.cluster.launcher import start_worker, stop_workers, wait_ready
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from tests.integration.conftest import start_cluster, start_router, stop_cluster, stop_routers
from tests.integration.test_shared_state import listed, wait_for
from tests.redis_server import RedisServer, redis_binary

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "random:tiny"
BLOCK = 16
FIRST_TURN = 200  # tokens: 12 full blocks cached after the first turn
CONVERSATIONS = 4


def worker(url: str = ""):
    """A decode worker publishing to the Redis at ``url`` ("": publishing nowhere)."""
    store = ["--redis", url, "--heartbeat-s", "0.2", "--ttl-s", "3"] if url else []
    return start_worker("decode", ["--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--num-threads", "1",
                                   "--no-load-progress", "--num-kv-blocks", "512", *store, "--grace-s", "5"])


def metric(url: str, name: str, label: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


def cached_tokens(url: str, model: str, prompt: list[int]) -> int:
    """The request's reused prompt tokens, sent once the router sees every worker idle. With the tiny
    model a prefix hit saves milliseconds, less than what a snapshot still showing the last request
    running adds to its worker's cost (snapshots are polled; on a loaded machine the last one can be
    seconds old), so without the wait a hit depends on when the router last polled."""
    wait_for(lambda: metric(url, "pdserve_worker_num_running") + metric(url, "pdserve_worker_num_waiting") == 0,
             60, "the router's snapshots show every worker idle")
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def first_turn_beside_a_long_request(url: str, model: str, prompt: list[int], filler: list[int]) -> None:
    """The first turn while a long request holds one worker: it goes to the other one (the router
    sends the long one to either), so the conversations spread over both workers."""
    started = asyncio.Event()

    async def long_request() -> None:
        body = {"model": model, "prompt": filler, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with httpx.AsyncClient(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started.set()

    holder = asyncio.create_task(long_request())
    await started.wait()
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                        "temperature": 0})
        assert r.status_code == 200, r.text
    await holder


@pytest.fixture
def redis():
    server = RedisServer(redis_binary())
    server.start()
    yield server
    server.stop()


def test_second_turns_follow_the_cached_blocks_through_both_routers_and_not_past_a_restart(redis):
    rng = random.Random(14)
    firsts = [[rng.randrange(1000, 40000) for _ in range(FIRST_TURN)] for _ in range(CONVERSATIONS)]
    seconds = [f + [rng.randrange(1000, 40000) for _ in range(40)] for f in firsts]
    hit = FIRST_TURN // BLOCK * BLOCK
    workers = [worker(redis.url()) for _ in range(2)]
    stopped, routers = [], []
    try:
        wait_ready(workers, timeout_s=120)
        routers = [start_router([], MODEL, "--redis", redis.url()) for _ in range(2)]
        urls = [url for _, url in routers]
        for url in urls:
            wait_for(lambda u=url: listed(u) == {w.address for w in workers}, 30, "each router lists both workers")
        model = httpx.get(urls[0] + "/v1/models", timeout=5).json()["data"][0]["id"]

        for first in firsts:
            filler = [rng.randrange(1000, 40000) for _ in range(20)]
            asyncio.run(first_turn_beside_a_long_request(urls[0], model, first, filler))
        blocks = CONVERSATIONS * (FIRST_TURN // BLOCK)
        for url in urls:  # both routers' indexes hold every first turn (events through Redis)
            wait_for(lambda u=url: metric(u, "pdserve_router_prefix_index_blocks") >= blocks, 60,
                     "the KV events of the first turns reach the router")

        # Each second turn, through either router, lands where its first turn's blocks are: the
        # worker reports reusing them (no other worker holds any of them).
        before = [prefix_hits(w) for w in workers]
        for second in seconds:
            for url in urls:
                assert cached_tokens(url, model, second) >= hit
            if second is seconds[0]:  # the worker that reused conversation 0's blocks holds them
                holder = next(w for w, b in zip(workers, before) if prefix_hits(w) > b)
        for url in urls:
            assert metric(url, "pdserve_router_cached_tokens_total", 'source="predicted"') >= CONVERSATIONS * hit

        # That worker stops and a fresh one starts: the router predicts no hit for conversation 0.
        holder.process.send_signal(signal.SIGTERM)
        holder.process.wait(30)
        workers.remove(holder)
        stopped.append(holder)  # its output pipe is closed with the rest
        workers.append(worker(redis.url()))
        wait_ready(workers[-1:], timeout_s=120)
        for url in urls:
            wait_for(lambda u=url: listed(u) == {w.address for w in workers}, 30,
                     "each router has dropped the stopped worker and lists the fresh one")
        predicted = metric(urls[0], "pdserve_router_cached_tokens_total", 'source="predicted"')
        assert cached_tokens(urls[0], model, seconds[0]) == 0
        assert metric(urls[0], "pdserve_router_cached_tokens_total", 'source="predicted"') == predicted
    finally:
        stop_routers(routers)
        stop_workers(workers + stopped, grace_s=10)


def test_routers_sharing_redis_send_second_turns_home_on_each_others_routes_alone(redis):
    """The workers publish nowhere (given to the routers by address), so neither router's index
    ever learns a block: what the router that did not route a first turn knows of it is the
    route the other router shared through Redis (router.share_routes)."""
    rng = random.Random(16)
    firsts = [[rng.randrange(1000, 40000) for _ in range(FIRST_TURN)] for _ in range(CONVERSATIONS)]
    hit = FIRST_TURN // BLOCK * BLOCK
    workers = [worker() for _ in range(2)]
    routers = []
    try:
        wait_ready(workers, timeout_s=120)
        # Routes held far longer than the test: on a loaded machine each turn may wait many seconds
        flags = ("--redis", redis.url(), "--recent-routes-s", "3600")
        routers = [start_router([w.address for w in workers], MODEL, *flags) for _ in range(2)]
        urls = [url for _, url in routers]
        model = httpx.get(urls[0] + "/v1/models", timeout=5).json()["data"][0]["id"]
        for first in firsts:  # through router 0 only
            filler = [rng.randrange(1000, 40000) for _ in range(20)]
            asyncio.run(first_turn_beside_a_long_request(urls[0], model, first, filler))
        sent = metric(urls[0], "pdserve_router_shared_routes_total", 'direction="sent"')
        assert sent >= 2 * CONVERSATIONS  # each first turn: at its route, and again at its first token
        wait_for(lambda: metric(urls[1], "pdserve_router_shared_routes_total", 'direction="received"') >= sent,
                 30, "router 1 has read router 0's routes")
        for first in firsts:  # through router 1 only
            second = first + [rng.randrange(1000, 40000) for _ in range(40)]
            assert cached_tokens(urls[1], model, second) >= hit
        assert metric(urls[1], "pdserve_router_cached_tokens_total", 'source="predicted"') >= CONVERSATIONS * hit
        for url in urls:
            assert metric(url, "pdserve_router_prefix_index_blocks") == 0  # no events: not the index
    finally:
        stop_routers(routers)
        stop_workers(workers, grace_s=10)


def prefix_hits(w) -> int:
    """Prompt tokens the worker has found in its prefix cache (its load snapshot)."""
    with grpc.insecure_channel(w.address) as ch:
        return pb_grpc.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5).prefix_cache_hits


def test_without_a_state_store_second_turns_follow_this_routers_own_routes():
    rng = random.Random(15)
    firsts = [[rng.randrange(1000, 40000) for _ in range(FIRST_TURN)] for _ in range(CONVERSATIONS)]
    cluster = start_cluster(MODEL, decode=2, engine_flags=["--num-kv-blocks", "512"])
    try:
        for first in firsts:
            filler = [rng.randrange(1000, 40000) for _ in range(20)]
            asyncio.run(first_turn_beside_a_long_request(cluster.base_url, cluster.model, first, filler))
        for first in firsts:
            second = first + [rng.randrange(1000, 40000) for _ in range(40)]
            assert cached_tokens(cluster.base_url, cluster.model, second) >= FIRST_TURN // BLOCK * BLOCK
        assert metric(cluster.base_url, "pdserve_router_prefix_index_blocks") == 0  # no events: not the index
    finally:
        stop_cluster(cluster)
