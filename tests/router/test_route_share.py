"""RouteShare: routers behind one state store count each other's routes as their own."""

from __future__ import annotations

import asyncio
import time

from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.metrics import RouterMetrics
from pdserve.router.recent_routes import RecentRoutes
from pdserve.router.route_share import RouteShare
from pdserve.state.store import MemoryStateStore, StateStoreConfig
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run


def recents() -> dict[str, RecentRoutes]:
    return {"decode": RecentRoutes(ttl_s=5.0), "prefill": RecentRoutes(ttl_s=5.0)}


def sent_received(metrics: RouterMetrics) -> tuple[float, float]:
    return (metrics.shared_routes.labels("sent")._value.get(), metrics.shared_routes.labels("received")._value.get())


def test_a_route_noted_by_one_router_is_held_by_the_others_for_its_model_and_pool():
    async def main():
        store = MemoryStateStore(StateStoreConfig())
        a_recents, b_recents = {"": recents()}, {"": recents()}
        a = RouteShare(store, a_recents, RouterMetrics())
        b = RouteShare(store, b_recents, RouterMetrics())
        a.note("", "decode", [1, 2, 3], "d0")  # before either started: still sent, and read by b
        await a.start()
        await b.start()
        await a.close()  # the rounds are driven by hand below
        await b.close()
        a.note("", "prefill", [1, 2], "p0")
        a.note("other-model", "decode", [7], "d9")  # a model b does not serve: ignored there
        b.note("", "decode", [5, 6], "d1")
        assert await a.exchange_once() == 3  # read back: a skips its own (its dispatcher added them)
        assert await b.exchange_once() == 4
        await a.exchange_once()

        keys = [1, 2, 3, 4]
        assert b_recents[""]["decode"].lookup(keys, now=time.monotonic()) == {"d0": 3}
        assert b_recents[""]["prefill"].lookup(keys, now=time.monotonic()) == {"p0": 2}
        assert a_recents[""]["decode"].lookup([5, 6], now=time.monotonic()) == {"d1": 2}
        assert a_recents[""]["decode"].lookup(keys, now=time.monotonic()) == {}  # its own: added by its dispatcher
        assert sent_received(a.metrics) == (3, 1) and sent_received(b.metrics) == (1, 2)

    asyncio.run(main())


def test_a_router_shares_on_its_own_while_it_runs():
    async def main():
        store = MemoryStateStore(StateStoreConfig())
        b_recents = {"": recents()}
        a = RouteShare(store, {"": recents()}, RouterMetrics(), interval_s=0.01)
        b = RouteShare(store, b_recents, RouterMetrics(), interval_s=0.01)
        await a.start()
        await b.start()
        try:
            a.note("", "decode", [1, 2], "d0")
            for _ in range(500):  # until b's round has read it
                if b_recents[""]["decode"].lookup([1, 2], now=time.monotonic()):
                    break
                await asyncio.sleep(0.01)
            assert b_recents[""]["decode"].lookup([1, 2], now=time.monotonic()) == {"d0": 2}
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_route_is_remembered_when_picked_and_again_at_its_first_token(make_client):
    """At its first token the prompt's blocks are stored and its KV events a heartbeat away: the
    route is noted again (and shared), so a request that queued past recent_routes_s is not forgotten."""
    decode = in_rotation("decode")
    decode.info.block_size, decode.info.model_fingerprint = 16, "fp"

    class _Worker:
        def Generate(self, request):
            return ScriptedCall([pb.GenerateResponse(token_ids=[7], text="x", finished=True, finish_reason="length")])

    decode.stub = _Worker()
    client = make_client([decode])
    noted = []
    client.router.models[0].dispatcher.on_route = lambda role, keys, worker: noted.append((role, len(keys), worker))
    r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(40)), "max_tokens": 1}))
    assert r.status_code == 200, r.text
    assert noted == [("decode", 2, "decode-0")] * 2  # 40 tokens: two full blocks of 16
