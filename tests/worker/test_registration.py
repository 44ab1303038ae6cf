"""A worker's registration over a running engine thread, with both state stores (Redis: a real
redis-server): each heartbeat drains the engine's KV events into the store, numbered within the
engine's epoch; what the engine dropped while nobody drained shows as a gap in the numbers (what a
consumer resyncs on) and in the worker's drop counter."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from pdserve.decode_worker.server import DecodeServicer
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.state.store import StateStoreConfig, make_state_store
from pdserve.worker.config import WorkerConfig
from pdserve.worker.registration import Registration
from tests.redis_server import redis_server  # noqa: F401 (a fixture)


@pytest.fixture(params=["memory", "redis"])
def store_config(request) -> StateStoreConfig:
    if request.param == "memory":
        return StateStoreConfig()
    server = request.getfixturevalue("redis_server")
    return StateStoreConfig(backend="redis", url=server.url(), namespace=f"t{uuid.uuid4().hex[:8]}")


async def serve(engine: AsyncEngine, first: int, n: int) -> None:
    """n requests with distinct 40-token prompts (2 full blocks each), all at once."""
    async def one(i: int) -> None:
        tokens = [1000 + 40 * i + j for j in range(40)]
        async for _ in engine.generate(f"r{i}", tokens, SamplingParams(max_tokens=4, temperature=0)):
            pass

    await asyncio.gather(*(one(i) for i in range(first, first + n)))


def test_heartbeats_publish_numbered_events_and_what_was_dropped_is_a_gap(make_engine, store_config):
    engine = make_engine(num_kv_blocks=16)  # keeps 64 events
    buffer = engine.kv.pool.events
    async_engine = AsyncEngine(engine)
    servicer = DecodeServicer(async_engine, "d1", WorkerConfig(), "127.0.0.1:1")

    async def main() -> None:
        store = make_state_store(store_config)
        await store.start()
        registration = Registration(store, servicer, interval_s=1.0)
        try:
            await serve(async_engine, 0, 2)
            await registration.beat()
            first = (await store.read_kv_events()).events
            assert [e.seq for e in first] == list(range(1, buffer.last_seq + 1)) and buffer.dropped == 0
            assert {(e.worker_id, e.epoch) for e in first} == {("d1", buffer.epoch)}
            assert all(len(h) == 32 for e in first for h in e.block_hashes)  # 16-byte hashes, hex

            await serve(async_engine, 2, 30)  # no heartbeat meanwhile: the engine's buffer overflows
            await registration.beat()
            second = (await store.read_kv_events(count=10_000)).events[len(first):]
            seqs = [e.seq for e in second]
            assert seqs == list(range(seqs[0], buffer.last_seq + 1)) and len(seqs) == 4 * 16
            assert seqs[0] - first[-1].seq - 1 == buffer.dropped > 0
            dropped = servicer.metrics.registry.get_sample_value("pdserve_worker_kv_events_dropped_total")
            assert dropped == buffer.dropped
        finally:
            await store.close()

    async_engine.start()
    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
