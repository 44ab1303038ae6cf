"""The router's admission (router/admission.py): a cap on sequences, bounded queues per service
class let in by class then arrival, a full queue shedding the lowest class, a wait that times out,
and a client that leaves while queued taking nothing with it; then service tiers through a Router:
who may ask for which, the class reaching the workers as the engine's priority, and the tier echoed."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.admission import TIER_CLASS, Admission, Refused
from pdserve.router.auth import AuthConfig, Authenticator, TenantConfig, key_digest
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run

PRIORITY, DEFAULT, FLEX = TIER_CLASS["priority"], TIER_CLASS["default"], TIER_CLASS["flex"]


def test_without_a_queue_past_the_cap_is_refused_at_once_and_one_request_alone_always_fits():
    async def body():
        a = Admission(max_sequences=4)
        await a.acquire(3, DEFAULT)
        with pytest.raises(Refused, match="too many sequences in flight"):
            await a.acquire(2, PRIORITY)
        await a.acquire(1, FLEX)
        a.release(4)
        await a.acquire(10, DEFAULT)  # alone: admitted whatever its size
        assert a.in_flight == 10

    run(body())


def test_queued_requests_are_let_in_by_class_then_arrival():
    async def body():
        a = Admission(max_sequences=1, queue_size=8)
        await a.acquire(1, DEFAULT)
        order = []

        async def wait(name, klass):
            await a.acquire(1, klass)
            order.append(name)

        tasks = [asyncio.create_task(wait(name, klass)) for name, klass in
                 (("flex-1", FLEX), ("default-1", DEFAULT), ("priority-1", PRIORITY), ("flex-2", FLEX),
                  ("priority-2", PRIORITY))]
        await asyncio.sleep(0)
        for _ in tasks:
            a.release(1)  # one finishes: the next in line gets its sequence
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert run(body()) == ["priority-1", "priority-2", "default-1", "flex-1", "flex-2"]


def test_a_full_queue_sheds_the_newest_of_the_lowest_class_for_a_higher_one():
    async def body():
        a = Admission(max_sequences=1, queue_size=2)
        await a.acquire(1, DEFAULT)
        flex_old = asyncio.create_task(a.acquire(1, FLEX))
        flex_new = asyncio.create_task(a.acquire(1, FLEX))
        await asyncio.sleep(0)
        with pytest.raises(Refused, match="queue of 2 requests is full"):
            await a.acquire(1, FLEX)  # outranks nobody: refused itself
        high = asyncio.create_task(a.acquire(1, PRIORITY))
        await asyncio.sleep(0)
        with pytest.raises(Refused, match="shed"):
            await flex_new
        a.release(1)
        await high
        assert not flex_old.done() and a.shed == 1
        a.release(1)
        await flex_old

    run(body())


def test_a_wait_times_out_and_a_client_leaving_the_queue_takes_nothing():
    async def body():
        a = Admission(max_sequences=1, queue_size=4, queue_timeout_s=0.05)
        await a.acquire(1, DEFAULT)
        with pytest.raises(Refused, match="waited 0.05 s"):
            await a.acquire(1, DEFAULT)
        leaving = asyncio.create_task(a.acquire(1, DEFAULT))
        await asyncio.sleep(0)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert a.waiting == 0 and a.in_flight == 1
        a.release(1)
        assert a.in_flight == 0

    run(body())


# ---- service tiers through the router ------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request):
        self.requests.append(request)
        return ScriptedCall([pb.GenerateResponse(token_ids=[7], text="x", finished=True, finish_reason="length")])

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


@pytest.fixture
def tiered(make_client):
    worker = in_rotation("decode")
    worker.stub = _Recorder()
    auth = AuthConfig(tenants={
        "gold": TenantConfig(key_sha256=[key_digest("sk-gold")], service_tiers=["priority", "default", "flex"]),
        "basic": TenantConfig(key_sha256=[key_digest("sk-basic")])})  # default and flex only
    return make_client([worker], auth=Authenticator(auth)), worker.stub


def _chat(client, key, **extra):
    return run(client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                 **extra}))


def test_each_tier_reaches_the_engine_as_its_class_and_is_echoed(tiered):
    client, recorder = tiered
    for key, tier, echoed in (("sk-gold", "priority", "priority"), ("sk-gold", None, "default"),
                              ("sk-gold", "auto", "default"), ("sk-basic", "flex", "flex")):
        r = _chat(client, key, **({"service_tier": tier} if tier else {}))
        assert r.status_code == 200, r.text
        assert r.json()["service_tier"] == echoed
    assert [m.sampling.priority for m in recorder.requests] == [PRIORITY, DEFAULT, DEFAULT, FLEX]
    r = _chat(client, "sk-gold", stream=True)
    chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and all('"service_tier":"default"' in c for c in chunks)


def test_a_client_cannot_raise_its_own_class(tiered):
    client, recorder = tiered
    r = _chat(client, "sk-basic", service_tier="priority")
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"
    assert "default" in r.json()["error"]["message"] and "flex" in r.json()["error"]["message"]
    r = _chat(client, "sk-basic", priority=0)  # vLLM's field, more urgent than default
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert _chat(client, "sk-basic", priority=5).status_code == 200
    assert recorder.requests[-1].sampling.priority == 5
    assert _chat(client, "sk-gold", priority=0).status_code == 200


def test_unknown_tiers_in_a_tenant_are_refused_naming_the_key():
    from pdserve.cluster.config import load_serve_config
    from pdserve.configs import ConfigError

    with pytest.raises(ConfigError, match=r"config.auth.tenants.t.service_tiers: \['gold'\]"):
        load_serve_config(None, {"auth": {"tenants": {"t": {"service_tiers": ["gold", "default"]}}}})


def test_per_class_latency_and_slo_attainment_are_counted(make_client):
    from pdserve.router.app import SLOConfig

    worker = in_rotation("decode")
    worker.stub = _Recorder()
    client = make_client([worker], slo={"default": SLOConfig(ttft_ms=60_000, tpot_ms=60_000),
                                        "flex": SLOConfig(ttft_ms=1e-6, tpot_ms=60_000)})
    for tier in ("default", "flex", "flex", "priority"):
        r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1,
                                                     "service_tier": tier}))
        assert r.status_code == 200 and r.json()["service_tier"] == tier
    text = run(client.get("/metrics")).text

    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{") and not line.startswith("#"))

    assert value('pdserve_router_slo_requests_total{met="yes",tier="default"}') == 1
    assert value('pdserve_router_slo_requests_total{met="no",tier="flex"}') == 2  # an SLO no request meets
    assert 'tier="priority"' not in "".join(line for line in text.splitlines() if "slo_requests" in line)
    assert value('pdserve_router_class_time_to_first_token_seconds_count{tier="flex"}') == 2


def test_slo_classes_must_be_service_classes():
    from pdserve.cluster.config import load_serve_config
    from pdserve.configs import ConfigError

    with pytest.raises(ConfigError, match=r"router.slo: \['gold'\] are not service classes"):
        load_serve_config(None, {"router": {"slo": {"gold": {"ttft_ms": 100}}}})
