"""The prefix index fed as the router feeds it: a real worker server in this process (the tiny model)
registered in the in-memory state store, the router's pool polling it, the feed reading the store.
The index follows the worker's real block pool through a late join, new blocks, lost events (a
resync over the worker's KVSnapshot RPC) and the worker leaving the rotation."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from pdserve.decode_worker.server import DecodeServicer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.proto.v1 import worker_pb2_grpc as pb_grpc
from pdserve.router.index_feed import PrefixIndexFeed
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import WorkerPool
from pdserve.router.prefix_index import PrefixIndex, keys_of, prompt_keys
from pdserve.state.store import MemoryStateStore, StateStoreConfig
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import WorkerServer
from tests.worker.serving import generated


async def until(condition, timeout_s: float = 30.0) -> None:
    """Wait for ``condition()`` (the feed works in its own tasks)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_feed_follows_a_real_worker_through_a_late_join_a_gap_and_its_leaving(make_engine):
    engine = make_engine(num_kv_blocks=64)
    pool_of_engine = engine.kv.pool
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 3 * engine.block_size + 3)) for i in range(6)]

    def real_keys() -> np.ndarray:
        return np.sort(keys_of(pool_of_engine.snapshot().block_hashes))

    async def main():
        store = MemoryStateStore(StateStoreConfig(heartbeat_s=60, ttl_s=120))  # beats only when told
        server = WorkerServer(engine, WorkerConfig(port=0, heartbeat_s=60), DecodeServicer)
        await server.start(store)
        wid = server.servicer.worker_id
        metrics, index = RouterMetrics(), PrefixIndex()
        pool = WorkerPool([server.address], poll_interval_s=60)
        feed = PrefixIndexFeed(index, store, pool, metrics, interval_s=0.01)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.WorkerStub(channel)
                await generated(stub, "before", prompts[0])  # the router is not there yet
                await server.registration.beat()
                await pool.start()
                await feed.start()  # joins late: the worker resyncs from its snapshot
                await until(lambda: index.is_synced(wid))
                assert np.array_equal(index.keys_of_worker(wid), real_keys()) and len(real_keys()) >= 3

                for i, prompt in enumerate(prompts[1:4]):  # new blocks arrive as events
                    await generated(stub, f"r{i}", prompt)
                await server.registration.beat()
                await until(lambda: np.array_equal(index.keys_of_worker(wid), real_keys()))
                fingerprint, bs = engine.loaded.fingerprint, engine.block_size
                assert index.lookup(prompt_keys(prompts[2], fingerprint, bs)) == {wid: 3}
                assert index.lookup(prompt_keys(prompts[2], fingerprint, bs, "another tenant")) == {}

                await generated(stub, "lost", prompts[4])
                pool_of_engine.events.drain()  # these events never reach the store: a gap
                await generated(stub, "after", prompts[5])
                await server.registration.beat()
                await until(lambda: index.is_synced(wid) and np.array_equal(index.keys_of_worker(wid), real_keys()))
                assert index.lookup(prompt_keys(prompts[4], fingerprint, bs)) == {wid: 3}

                snapshot = await stub.KVSnapshot(pb.KVSnapshotRequest())
                assert (snapshot.worker_id, snapshot.epoch) == (wid, pool_of_engine.events.epoch)
                assert len(snapshot.block_hashes) == 16 * len(real_keys())

                pool.mark_down(pool.workers[0], "test")  # out of rotation: its entries go at once
                assert index.workers() == {} and index.num_blocks == 0
            resyncs = {(s.labels["reason"], s.labels["result"]): s.value
                       for s in metrics.prefix_index_resyncs.collect()[0].samples if s.name.endswith("_total")}
            events = {s.labels["outcome"]: s.value
                      for s in metrics.prefix_index_events.collect()[0].samples if s.name.endswith("_total")}
            return resyncs, events, metrics.prefix_index_blocks._value.get()
        finally:
            await feed.close()
            await pool.close()
            await server.stop(0)

    resyncs, events, blocks = asyncio.run(main())
    assert resyncs == {("joined", "ok"): 1, ("gap", "ok"): 1}
    # the events published before the router joined were buffered or ignored: the snapshot holds them
    assert events["applied"] > 0 and events["resync"] == 1 and blocks == 0
