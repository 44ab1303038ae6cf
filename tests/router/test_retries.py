"""A request whose decode workers all failed before streaming, while the rest were out of rotation for
a moment (a killed replica, and a busy machine's missed polls taking the other out): it waits for a
worker it has not tried instead of answering 503 at once. A Router in this process over scripted
workers."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.pool import WorkerHandle
from tests.router.conftest import MODEL, ScriptedCall, in_rotation, run


class _Dead:
    def Generate(self, request):
        return ScriptedCall(error=grpc.StatusCode.UNAVAILABLE)

    async def Abort(self, request, timeout=None):
        return pb.AbortResponse()


class _Alive(_Dead):
    def Generate(self, request):
        return ScriptedCall([pb.GenerateResponse(token_ids=[7], text="x", finished=True, finish_reason="length")])


def _workers() -> tuple[WorkerHandle, WorkerHandle]:
    dead = in_rotation("decode")
    dead.stub = _Dead()
    info = pb.WorkerInfo(worker_id="decode-1", role="decode", model=MODEL, max_model_len=8192)
    alive = WorkerHandle("127.0.0.1:2", info=info, healthy=False)  # out of rotation a moment (missed polls)
    alive.stub = _Alive()
    return dead, alive


def _complete(client):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1})


def test_a_request_whose_tried_workers_all_failed_waits_for_another(make_client):
    dead, alive = _workers()
    client = make_client([dead, alive], startup_wait_s=30)
    pool = client.router.pool

    async def body():
        request = asyncio.create_task(_complete(client))
        while dead.healthy:  # its failure takes the dead worker out of rotation
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not request.done()  # waiting for another worker, not answered 503
        alive.healthy = True  # back in rotation: its next poll answered
        pool.changed.set()
        return await request

    r = run(body())
    assert r.status_code == 200, r.text


def test_without_a_wait_the_request_is_answered_503(make_client):
    dead, alive = _workers()
    client = make_client([dead, alive], startup_wait_s=0)
    r = run(_complete(client))
    assert r.status_code == 503 and "every decode worker failed" in r.json()["error"]["message"]


class _FinishedThenKilled(_Dead):
    """A worker killed after sending its last message, before the call's closing status."""

    def __init__(self):
        self.calls = 0

    def Generate(self, request):
        self.calls += 1
        return ScriptedCall([pb.GenerateResponse(token_ids=[7], text="x"),
                             pb.GenerateResponse(token_ids=[8], text="y", finished=True, finish_reason="length")],
                            error=grpc.StatusCode.UNAVAILABLE)


class _Counting(_Alive):
    def __init__(self):
        self.calls = 0

    def Generate(self, request):
        self.calls += 1
        return super().Generate(request)


def test_a_stream_lost_after_its_last_message_is_answered_not_migrated(make_client):
    """Its worker killed between the finished message and the status: the answer is complete; a
    continuation would have sampled one token past max_tokens (17 of 16, in the Ray kill test)."""
    lost, other = in_rotation("decode"), in_rotation("decode")
    lost.stub, other.stub = _FinishedThenKilled(), _Counting()
    other.info = pb.WorkerInfo(worker_id="decode-1", role="decode", model=MODEL, max_model_len=8192)
    other.healthy = False  # the request goes to the one that is lost
    client = make_client([lost, other], startup_wait_s=0)
    r = run(client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 and r.json()["choices"][0]["finish_reason"] == "length"
    assert (lost.stub.calls, other.stub.calls) == (1, 0)
