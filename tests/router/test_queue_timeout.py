"""A worker's queue timeout: a worker scheduling by priority ends a request still unstarted after
``queue_timeout_s`` (later requests of a higher class kept going ahead of it) with
RESOURCE_EXHAUSTED. The client gets the 429 the router's own queue gives, not retried elsewhere;
a prefill worker's timeout sends the prompt to its decode worker. A Router in this process over
workers answering from a script (the worker's side: tests/worker/test_queue_timeout.py)."""

from __future__ import annotations

import grpc
import orjson
import pytest

from pdserve.proto.v1 import worker_pb2 as pb
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run

FULL = pb.GenerateResponse(token_ids=[7], text="x", finished=True, finish_reason="length")


class _Decode:
    """Generate: RESOURCE_EXHAUSTED (``full``) or one token; every request kept."""

    def __init__(self, full: bool):
        self.full, self.requests = full, []

    def Generate(self, request):
        self.requests.append(request)
        if self.full and not request.output_token_ids:
            return ScriptedCall(error=grpc.StatusCode.RESOURCE_EXHAUSTED)
        return ScriptedCall([FULL])

    async def Reserve(self, request, timeout=None):
        return pb.ReserveResponse(handle=request.request_id)

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


class _Prefill:
    def __init__(self):
        self.requests = []

    def Prefill(self, request):
        self.requests.append(request)
        return ScriptedCall(error=grpc.StatusCode.RESOURCE_EXHAUSTED)


def _worker(role: str, stub, index: int = 0):
    w = in_rotation(role)
    w.address, w.info.worker_id = f"127.0.0.1:{10 + index}", f"{role}-{index}"
    w.stub = stub
    return w


def _completion(client, stream: bool, prompt=(1, 2)):
    return run(client.post("/v1/completions", json={"model": MODEL, "prompt": list(prompt), "max_tokens": 1,
                                                    "stream": stream}))


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_workers_queue_timeout_is_a_429_and_is_not_retried(make_client, stream):
    stubs = [_Decode(full=True), _Decode(full=True)]
    client = make_client([_worker("decode", s, i) for i, s in enumerate(stubs)], queue_timeout_s=7.5,
                         retry_after_s=3)
    for _ in range(3):
        r = _completion(client, stream)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "3"
        error = orjson.loads(r.content)["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "retry shortly" in error["message"]
    sent = [m for s in stubs for m in s.requests]
    assert len(sent) == 3  # one worker each: a queue that long is not a failed worker
    assert {m.queue_timeout_s for m in sent} == {7.5}  # the router's bound, on every worker request
    metrics = run(client.get("/metrics")).text
    assert 'pdserve_router_faults_total{reason="queue_timeout"} 3.0' in metrics


def test_a_prefill_workers_queue_timeout_leaves_the_prompt_to_its_decode_worker(make_client):
    prefill, decode = _Prefill(), _Decode(full=False)
    client = make_client([_worker("prefill", prefill), _worker("decode", decode)], queue_timeout_s=4)
    r = _completion(client, False, prompt=range(100, 400))  # long enough to be prefilled remotely
    assert r.status_code == 200, r.text
    assert [m.queue_timeout_s for m in prefill.requests] == [4]
    (resumed,) = decode.requests
    assert resumed.prefill_here and resumed.queue_timeout_s == 4  # bounded again where it now waits
