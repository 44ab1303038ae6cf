"""The state store, both backends on the same cases (Redis: a real redis-server): registration,
heartbeats, expiry, the KV-event stream; Redis going away answers the last known state with one
warning, and a Redis that comes back empty is repopulated by the next heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from pdserve.cluster.config import load_serve_config
from pdserve.configs import ConfigError
from pdserve.state.store import (
    STATE_STORES,
    KVEventRecord,
    MemoryStateStore,
    RouteRecord,
    StateStoreConfig,
    WorkerRecord,
    make_state_store,
    register_state_store,
)
from tests.redis_server import RedisServer, redis_binary, redis_server  # noqa: F401 (a fixture)


@pytest.fixture(params=["memory", "redis"])
def store_config(request):
    """A config per backend; each Redis test gets its own key namespace."""
    def make(**options) -> StateStoreConfig:
        if request.param == "memory":
            return StateStoreConfig(**options)
        server = request.getfixturevalue("redis_server")
        return StateStoreConfig(backend="redis", url=server.url(), namespace=f"t{uuid.uuid4().hex[:8]}", **options)

    return make


def run(config: StateStoreConfig, body):
    async def main():
        store = make_state_store(config)
        await store.start()
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def record(worker_id: str, role: str = "decode", **load) -> WorkerRecord:
    return WorkerRecord(worker_id, role, f"127.0.0.1:{abs(hash(worker_id)) % 50000 + 1000}", model="m",
                        model_fingerprint="fp", timestamp=time.time(), **load)


def test_register_heartbeat_list_deregister(store_config):
    async def body(store):
        await store.heartbeat(record("d1"))
        await store.heartbeat(record("p1", role="prefill"))
        assert [w.worker_id for w in await store.workers()] == ["d1", "p1"]
        await store.heartbeat(record("d1", num_running=3, kv_usage=0.5, draining=True))
        d1 = (await store.workers())[0]
        assert (d1.num_running, d1.kv_usage, d1.draining, d1.role) == (3, 0.5, True, "decode")
        await store.deregister("d1")
        assert [w.worker_id for w in await store.workers()] == ["p1"]

    run(store_config(), body)


def test_a_worker_whose_heartbeat_stops_expires(store_config):
    async def body(store):
        await store.heartbeat(record("quiet"))
        for _ in range(4):  # the other one keeps beating past the first one's ttl
            await store.heartbeat(record("alive"))
            await asyncio.sleep(0.1)
        assert [w.worker_id for w in await store.workers()] == ["alive"]

    run(store_config(ttl_s=0.3, heartbeat_s=0.1), body)


def test_kv_events_read_from_a_cursor(store_config):
    def event(i: int) -> KVEventRecord:
        return KVEventRecord("d1", "stored" if i % 2 else "removed", (f"{i:04x}", f"{i + 1:04x}"))

    async def body(store):
        assert (await store.read_kv_events()).events == []
        await store.publish_kv_events([event(i) for i in range(3)])
        first = await store.read_kv_events()
        assert first.events == [event(i) for i in range(3)] and not first.resync
        await store.publish_kv_events([event(3), event(4)])
        second = await store.read_kv_events(first.cursor)
        assert second.events == [event(3), event(4)] and not second.resync
        assert (await store.read_kv_events(second.cursor)).events == []
        assert len((await store.read_kv_events(count=2)).events) == 2

    run(store_config(), body)


def test_the_event_stream_is_bounded_and_a_reader_left_behind_resyncs(store_config):
    async def body(store):
        await store.publish_kv_events([KVEventRecord("d1", "stored", ("aa",))])
        early = await store.read_kv_events()
        await store.publish_kv_events([KVEventRecord("d1", "stored", (f"{i:x}",)) for i in range(1000)])
        late = await store.read_kv_events(early.cursor, count=10_000)
        assert late.resync
        assert len(late.events) <= 200  # Redis trims approximately (whole nodes of ~100 entries)

    run(store_config(max_events=10), body)


def test_routes_are_read_from_when_the_reader_started_and_then_from_its_cursor(store_config):
    def route(i: int) -> RouteRecord:
        return RouteRecord("r1", "", "decode" if i % 2 else "prefill", f"w{i}", (i + 1, 2**63 + i, 2**64 - 1))

    async def body(store):
        await store.publish_routes([route(0)])  # before the reader: a hint already past, not read
        start = await store.read_routes()
        assert start.routes == []
        await store.publish_routes([route(i) for i in range(1, 4)])
        first = await store.read_routes(start.cursor, count=2)
        assert first.routes == [route(1), route(2)]  # keys round-trip whole (64-bit)
        second = await store.read_routes(first.cursor)
        assert second.routes == [route(3)]
        assert (await store.read_routes(second.cursor)).routes == []
        assert (await store.read_routes()).routes == []  # another new reader: from now

    run(store_config(), body)


def test_a_cursor_from_before_the_memory_store_restarted_resyncs():
    """The Ray StateStore replica can restart empty: a reader's cursor is then ahead of the counter."""
    async def body(store):
        await store.publish_kv_events([KVEventRecord("d1", "stored", (f"{i:x}",)) for i in range(5)])
        old_cursor = (await store.read_kv_events()).cursor
        restarted = make_state_store(StateStoreConfig())
        await restarted.publish_kv_events([KVEventRecord("d1", "stored", ("aa",))])
        batch = await restarted.read_kv_events(old_cursor)
        assert batch.resync and batch.events == [KVEventRecord("d1", "stored", ("aa",))]

    run(StateStoreConfig(), body)


def test_redis_going_away_answers_the_last_known_state_and_resyncs(caplog):
    server = RedisServer(redis_binary())
    server.start()
    config = StateStoreConfig(backend="redis", url=server.url(), ttl_s=30, heartbeat_s=0.5)

    async def body(store):
        await store.heartbeat(record("d1"))
        assert [w.worker_id for w in await store.workers()] == ["d1"]
        cursor = (await store.read_kv_events()).cursor
        server.stop()
        with caplog.at_level(logging.WARNING, logger="pdserve.state.redis_store"):
            for _ in range(3):
                assert [w.worker_id for w in await store.workers()] == ["d1"]  # the last known state
                await store.heartbeat(record("d1"))  # dropped, no exception
                await store.publish_kv_events([KVEventRecord("d1", "stored", ("aa",))])
                assert (await store.read_kv_events(cursor)).events == []
            warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(warnings) == 1, "one warning per outage"
            server.start()  # empty: no persistence
            assert await store.workers() == []  # the truth again: nobody has beaten yet
            await store.heartbeat(record("d1"))  # the worker's next heartbeat registers it again
            assert [w.worker_id for w in await store.workers()] == ["d1"]
            assert (await store.read_kv_events(cursor)).resync
            assert not (await store.read_kv_events(cursor)).resync
            assert any("is back" in r.getMessage() for r in caplog.records)

    try:
        run(config, body)
    finally:
        server.stop()


def test_backends_by_name_load_lazily_and_accept_fakes():
    assert isinstance(make_state_store(StateStoreConfig()), MemoryStateStore)
    assert STATE_STORES["redis"] == "pdserve.state.redis_store:RedisStateStore"  # a string until chosen
    register_state_store("fake", lambda config: MemoryStateStore(config))
    try:
        assert isinstance(make_state_store(StateStoreConfig(backend="fake")), MemoryStateStore)  # type: ignore
    finally:
        del STATE_STORES["fake"]


@pytest.mark.parametrize(("text", "message"), [
    ("state_store: {backend: redis}", "state_store.url: the redis backend needs a redis:// URL"),
    ("state_store: {backend: etcd}", "config.state_store.backend: 'etcd' is not one of"),
    ("state_store: {ttl_s: 1, heartbeat_s: 2}", "state_store.ttl_s: must be longer than heartbeat_s"),
    ("state_store: {heartbeat_s: 0}", "state_store.heartbeat_s: must be positive"),
    ("state_store: {urll: x}", "config.state_store: unknown key(s) ['urll']"),
])
def test_the_yaml_section_is_validated_naming_the_key(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_serve_config(path)
    assert message in str(e.value)


def test_the_yaml_section_configures_redis(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("state_store: {backend: redis, url: 'redis://10.0.0.5:6379/2', ttl_s: 3, heartbeat_s: 0.5}\n")
    store = load_serve_config(path).state_store
    assert (store.backend, store.url, store.ttl_s, store.heartbeat_s) == ("redis", "redis://10.0.0.5:6379/2", 3, 0.5)


class _SwallowingClient:
    """A Redis client whose read turns a cancellation into a timeout, or swallows it outright (what
    redis-py did once while Redis restarted under load: the router then never finished stopping)."""

    def __init__(self, convert: bool):
        self.convert, self.reading = convert, asyncio.Event()

    async def xread(self, streams, count):
        from redis.exceptions import TimeoutError as RedisTimeoutError

        self.reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.convert:
                raise RedisTimeoutError("Timeout reading from redis") from None
        return []


@pytest.mark.parametrize("convert", [True, False], ids=["turned-into-a-timeout", "swallowed"])
def test_a_cancelled_redis_call_stays_cancelled_whatever_the_client_does(convert):
    from pdserve.state.redis_store import RedisStateStore

    async def body():
        store = RedisStateStore(StateStoreConfig(backend="redis", url="redis://127.0.0.1:1/0"))
        store.client = client = _SwallowingClient(convert)
        task = asyncio.create_task(store.read_kv_events("", 10))
        await client.reading.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.reachable  # not taken for an outage

    asyncio.run(body())


def test_stopping_tasks_is_bounded_even_when_one_ignores_its_cancellation(caplog):
    from pdserve.state.store import stop_tasks

    async def stubborn(released):
        while not released.is_set():
            try:
                await released.wait()
            except asyncio.CancelledError:
                pass  # a bug somewhere below: the loop goes on

    async def body():
        released = asyncio.Event()
        polite = asyncio.create_task(asyncio.sleep(3600), name="polite")
        stuck = asyncio.create_task(stubborn(released), name="stuck")
        await asyncio.sleep(0)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="pdserve.state.store"):
            await stop_tasks([polite, stuck, None], "test", timeout_s=0.2)
        took = time.monotonic() - started
        assert polite.cancelled() and not stuck.done()
        released.set()  # let the test end
        await stuck
        return took

    assert asyncio.run(body()) < 5
    assert "1 task(s) did not stop" in caplog.text and "stuck" in caplog.text
