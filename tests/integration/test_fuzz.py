"""Fuzzing over real processes. The router's API: schemathesis strategies from the router's own
/openapi.json, driven by Hypothesis, valid and invalid bodies for chat, completions, models,
tokenize and detokenize: every answer is 2xx or 4xx, a 4xx in OpenAI's error shape, within a
deadline. The workers' gRPC: arbitrary bytes as every method's messages (Drain aside: a valid
empty message drains the worker, which is its job): every call ends within a deadline with a status
that is not UNKNOWN or INTERNAL (bytes that do not parse: INVALID_ARGUMENT, worker/malformed.py).
Afterwards the router answers, the workers serve, and they hold no request and no block."""

from __future__ import annotations

from collections import Counter

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.integration.conftest import start_cluster, stop_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "random:tiny"
EXAMPLES = 40  # per operation and generation mode (valid, invalid), per gRPC method and worker
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize=True)
METHODS = {"Generate": "unary_stream", "Abort": "unary_unary", "Health": "unary_unary", "Stats": "unary_unary",
           "Info": "unary_unary", "KVSnapshot": "unary_unary", "Reserve": "unary_unary",
           "PushKV": "stream_unary", "Prefill": "unary_stream"}


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(MODEL, decode=1, prefill=1, engine_flags=["--num-kv-blocks", "256", "--max-model-len", "256"])
    yield c
    stop_cluster(c)


def assert_serving_and_nothing_held(cluster) -> None:
    assert httpx.get(cluster.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(cluster.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    for stats in cluster.stats():
        assert stats.num_running == 0 and stats.num_waiting == 0 and not stats.draining
        assert stats.kv_usage == 0.0, stats  # every block back (cached ones count as free)


def wait_ready(client: httpx.Client, timeout_s: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)


def fuzz_operation(client: httpx.Client, op, mode: GenerationMode, answers: Counter, failures: list) -> None:
    label = f"{op.method.upper()} {op.path} {mode.value}"

    @given(case=op.as_strategy(generation_mode=mode))
    @SETTINGS
    def run(case):
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
        body = {k: v for k, v in kwargs.items() if k in ("json", "content", "headers", "params")}
        if "data" in kwargs:
            body["content"] = kwargs["data"]
        if mode is GenerationMode.POSITIVE and isinstance(body.get("json"), dict):
            body["json"]["model"] = MODEL  # past the 404, into validation and the engine
        try:
            response = client.request(case.method, case.formatted_path, **body)
            if response.status_code == 503 and "no_worker_available" in response.text:
                # Not the input's doing: a worker out of the router's rotation for a moment (a busy
                # machine's late polls). Once one is back, the same request again.
                wait_ready(client)
                response = client.request(case.method, case.formatted_path, **body)
        except httpx.TimeoutException:
            failures.append(f"{label}: no answer within {client.timeout.read} s for {body.get('json')!r:.400}")
            return
        answers[f"{label} {response.status_code // 100}xx"] += 1
        if response.status_code >= 500:
            failures.append(f"{label} {response.status_code} for {body.get('json')!r:.400}")
        elif response.status_code >= 400 and op.path != "/ready":
            if not {"message", "type", "param", "code"} <= set(response.json().get("error", {})):
                failures.append(f"{label} {response.status_code}: {response.text[:200]}")

    try:
        run()
    except Unsatisfiable:  # an operation without inputs has no invalid ones
        assert mode is GenerationMode.NEGATIVE, label


def test_every_answer_is_2xx_or_an_openai_4xx_and_nothing_leaks(cluster):
    answers: Counter = Counter()
    failures: list[str] = []
    schema = schemathesis.openapi.from_url(cluster.base_url + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} >= {
        ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
        ("POST", "/tokenize"), ("POST", "/detokenize")}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fuzz_operation(client, op, mode, answers, failures)
    print("\nanswers:", dict(sorted(answers.items())))
    assert not failures, failures[:5]
    assert sum(n for key, n in answers.items() if key.endswith("2xx") and "completions" in key) > 0
    assert_serving_and_nothing_held(cluster)


def fuzz_method(channel: grpc.Channel, method: str, kind: str, statuses: Counter) -> None:
    call = getattr(channel, kind)(f"/pdserve.v1.Worker/{method}")  # bytes in, bytes out

    @given(payload=st.binary(max_size=512))
    @SETTINGS
    def run(payload):
        try:
            if kind == "unary_stream":
                list(call(payload, timeout=30))
            elif kind == "stream_unary":
                call(iter([payload, payload]), timeout=30)
            else:
                call(payload, timeout=30)
            statuses[f"{method} OK"] += 1
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, (method, payload)  # a hang
            # gRPC's 5xx: a servicer that raised (UNKNOWN), or the server's own failure (INTERNAL)
            assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, payload, e.details())
            statuses[f"{method} {e.code().name}"] += 1

    run()


def test_malformed_grpc_messages_get_a_status_and_the_workers_keep_serving(cluster):
    statuses: Counter = Counter()
    for worker in cluster.workers:
        with grpc.insecure_channel(worker.address) as channel:
            for method, kind in METHODS.items():
                fuzz_method(channel, method, kind, statuses)
    print("\nstatuses:", dict(sorted(statuses.items())))
    assert_serving_and_nothing_held(cluster)
