"""Per-tenant budgets (router/budgets.py) on a clock the test moves, then through a Router in this
process: 429 with Retry-After and OpenAI's x-ratelimit-* headers, tokens reserved at admission and
the unused part given back, sequences (prompts x n) counted, other tenants untouched; and the
router's own admission counting sequences, not requests."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.auth import AuthConfig, Authenticator, TenantConfig, key_digest
from pdserve.router.budgets import Budgets, Limits, RateLimited
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_refill_continuously():
    clock = Clock()
    budgets = Budgets({"t": Limits(requests_per_minute=3)}, clock)
    for _ in range(3):
        budgets.admit("t")
    with pytest.raises(RateLimited) as e:
        budgets.admit("t")
    assert e.value.headers["Retry-After"] == "20"  # one request per 20 s
    assert e.value.headers["x-ratelimit-limit-requests"] == "3"
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "RPM" in str(e.value) and "20s" in str(e.value)
    clock.now += 20
    budgets.admit("t")  # refilled by one
    budgets.admit("other")  # a tenant without limits is never counted
    assert budgets.headers("other") == {}


def test_tokens_are_reserved_at_admission_and_the_unused_part_given_back():
    clock = Clock()
    budgets = Budgets({"t": Limits(tokens_per_minute=1000)}, clock)
    r = budgets.reserve("t", tokens=700, sequences=1)
    with pytest.raises(RateLimited) as e:
        budgets.reserve("t", tokens=400, sequences=1)  # 300 left
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "300"
    assert e.value.headers["Retry-After"] == "6"  # 100 more tokens at 1000/min
    budgets.release(r, used_tokens=200)  # 500 of the 700 back
    assert budgets.headers("t")["x-ratelimit-remaining-tokens"] == "800"
    budgets.reserve("t", tokens=400, sequences=1)
    with pytest.raises(RateLimited) as e:
        budgets.reserve("t", tokens=1001, sequences=1)  # larger than the limit: waiting cannot help
    assert "Retry-After" not in e.value.headers and "Request too large" in str(e.value)


def test_sequences_at_once_are_held_until_released_and_a_refusal_takes_nothing():
    clock = Clock()
    budgets = Budgets({"t": Limits(tokens_per_minute=1000, max_concurrent_sequences=4)}, clock)
    a = budgets.reserve("t", tokens=100, sequences=3)
    with pytest.raises(RateLimited, match="sequences at once"):
        budgets.reserve("t", tokens=100, sequences=2)
    assert budgets.headers("t")["x-ratelimit-remaining-tokens"] == "900"  # the refused request took no tokens
    budgets.release(a, used_tokens=100)
    budgets.reserve("t", tokens=100, sequences=4)
    with pytest.raises(RateLimited, match="Request too large"):
        Budgets({"t": Limits(max_concurrent_sequences=2)}, clock).reserve("t", tokens=1, sequences=3)


def test_negative_limits_are_refused_naming_the_key():
    from pdserve.cluster.config import load_serve_config
    from pdserve.configs import ConfigError

    with pytest.raises(ConfigError, match="config.auth.tenants.t.tokens_per_minute: must not be negative"):
        load_serve_config(None, {"auth": {"tenants": {"t": {"tokens_per_minute": -1}}}})


# ---- through the router -------------------------------------------------------------------------

class _Gate:
    """A decode worker that answers two tokens; the first request it sees after a gate is set gets its
    last token only when the test opens the gate (later requests are answered at once)."""

    def __init__(self):
        self.gate = None
        self.held = None  # the held request's id, less its choice index

    def Generate(self, request):
        worker = self
        rid = request.request_id.rsplit("-", 1)[0]
        if self.gate is not None and self.held is None:
            self.held = rid

        class Call(ScriptedCall):
            async def read(self):
                if len(self.messages) == 1 and rid == worker.held:
                    await worker.gate.wait()
                return await super().read()

        return Call([pb.GenerateResponse(token_ids=[7], text="x"),
                     pb.GenerateResponse(token_ids=[8], text="y", finished=True, finish_reason="length")])

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


def _router(make_client, **tenant):
    worker = in_rotation("decode")
    worker.stub = _Gate()
    auth = AuthConfig(tenants={"t": TenantConfig(key_sha256=[key_digest("sk-t")], **tenant),
                               "u": TenantConfig(key_sha256=[key_digest("sk-u")])})
    return make_client([worker], auth=Authenticator(auth), stream_idle_timeout_s=5), worker.stub


def _complete(client, key="sk-t", n=1, max_tokens=2, prompt=(1, 2, 3)):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens, "n": n})


def test_a_tenant_over_its_request_budget_gets_429_with_openais_headers(make_client):
    client, _ = _router(make_client, requests_per_minute=2)
    assert [run(_complete(client)).status_code for _ in range(2)] == [200, 200]
    r = run(_complete(client))
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-limit-requests"] == "2"
    assert run(_complete(client, key="sk-u")).status_code == 200  # another tenant is not held back


def test_answers_that_pass_carry_the_tenants_ratelimit_headers_too(make_client):
    """As OpenAI's: every answer tells the client where its budget stands (a JSON answer after its
    unused tokens came back; a stream as it starts, with its reservation held), not only a 429."""
    client, _ = _router(make_client, requests_per_minute=5, tokens_per_minute=30)
    answered = run(_complete(client))  # 3 prompt + 2 max_tokens reserved, 3 + 2 used
    assert answered.status_code == 200
    assert answered.headers["x-ratelimit-limit-requests"] == "5"
    assert answered.headers["x-ratelimit-remaining-requests"] == "4"
    assert answered.headers["x-ratelimit-limit-tokens"] == "30"
    assert int(answered.headers["x-ratelimit-remaining-tokens"]) in (25, 26)  # 30 - 5, refilling 0.5/s
    assert answered.headers["x-ratelimit-reset-tokens"].endswith("s")
    streamed = run(client.post("/v1/completions", headers={"Authorization": "Bearer sk-t"},
                               json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["x-ratelimit-remaining-requests"] == "3"
    assert int(streamed.headers["x-ratelimit-remaining-tokens"]) <= 22  # its own 5 still reserved
    unlimited = run(_complete(client, key="sk-u"))
    assert unlimited.status_code == 200 and not any(h.startswith("x-ratelimit") for h in unlimited.headers)


def test_tokens_reserved_for_max_tokens_x_n_and_refunded_when_the_request_ends(make_client):
    # 3 prompt tokens + 10 max_tokens x 2 = 23 reserved; 3 + 2 x 2 = 7 used (each choice stops at 2 tokens)
    client, _ = _router(make_client, tokens_per_minute=30)
    assert run(_complete(client, n=2, max_tokens=10)).status_code == 200
    assert run(_complete(client, n=2, max_tokens=10)).status_code == 200  # 16 came back: room again
    r = run(_complete(client, n=2, max_tokens=20))  # 43 > 30: too large whatever the wait
    assert r.status_code == 429 and "Request too large" in r.json()["error"]["message"]


def test_sequences_in_flight_count_prompts_times_n(make_client):
    client, stub = _router(make_client, max_concurrent_sequences=3)

    async def body():
        stub.gate = asyncio.Event()
        first = asyncio.create_task(_complete(client, n=2))  # holds 2 of 3 until the gate opens
        await asyncio.sleep(0.05)  # pacing only: the refusal below is checked whatever the timing
        refused = await _complete(client, n=2)
        alone = await _complete(client, key="sk-u", n=2)  # another tenant
        stub.gate.set()
        done = await first
        after = await _complete(client, n=3)
        return refused, alone, done, after

    refused, alone, done, after = run(body())
    assert refused.status_code == 429 and "sequences at once" in refused.json()["error"]["message"]
    assert alone.status_code == 200 and done.status_code == 200 and after.status_code == 200


def test_the_routers_cap_counts_sequences(make_client):
    worker = in_rotation("decode")
    worker.stub = _Gate()
    client = make_client([worker], max_concurrent_requests=3, stream_idle_timeout_s=5)

    async def body():
        worker.stub.gate = asyncio.Event()
        first = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                                                         "max_tokens": 2, "n": 2}))
        await asyncio.sleep(0.05)
        refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2,
                                                             "n": 2})
        fits = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
        worker.stub.gate.set()
        return refused, fits, await first

    refused, fits, first = run(body())
    assert refused.status_code == 429 and "sequences in flight" in refused.json()["error"]["message"]
    assert fits.status_code == 200 and first.status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
])
def test_stop_strings_and_ids_are_capped_with_a_400_naming_the_field(make_client, body, param):
    client = make_client([in_rotation("decode")])
    r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body}))
    assert r.status_code == 400 and r.json()["error"]["param"] == param
